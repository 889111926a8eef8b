"""Error types nowdl raises: each says what was wrong, the numbers, and what to do."""

from __future__ import annotations

__all__ = ["NowdlError", "TraceError", "PlanError", "InfeasibleError", "ProfileError"]


class NowdlError(ValueError):
    """Base class of nowdl's user-facing errors (a ValueError: the input was wrong).

    ``detail`` may hold what only ``-v`` shows (tracebacks, a graph dump).
    """

    detail: str = ""


class TraceError(NowdlError):
    """The model could not be traced, or the traced graph disagrees with the model."""


class ProfileError(NowdlError):
    """A node could not be profiled (it names the node and the reason)."""


class PlanError(NowdlError):
    """A plan file or plan request is malformed, from the future, or for another model."""


class InfeasibleError(NowdlError):
    """No partition fits the memory cap; the message says the smallest cap or GPU count that would."""
