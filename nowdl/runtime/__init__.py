"""Distributed runtime (schedules, communication, launch): see issue 3."""
__all__: list[str] = []
