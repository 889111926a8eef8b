"""Per-stage module generation from a Plan."""

from nowdl.codegen.stages import split_stages

__all__ = ["split_stages"]
