"""Error types nowdl raises: each says what was wrong, the numbers, and what to do."""

from __future__ import annotations

__all__ = ["NowdlError", "TraceError", "OneSampleNormError", "PlanError", "InfeasibleError", "TileHaloError", "ProfileError", "ReportedError", "error_text"]


class NowdlError(ValueError):
    """Base class of nowdl's user-facing errors (a ValueError: the input was wrong).

    ``detail`` may hold what only ``-v`` shows (tracebacks, a graph dump).
    """

    detail: str = ""


class TraceError(NowdlError):
    """The model could not be traced, or the traced graph disagrees with the model."""


class OneSampleNormError(TraceError):
    """A BatchNorm sees one value per channel in training (a batch of 1 after global pooling):
    ``node`` names it; the fix is 2 or more samples per micro-batch, or eval-mode norms."""

    node: str = ""


class ProfileError(NowdlError):
    """A node could not be profiled (it names the node and the reason)."""


class PlanError(NowdlError):
    """A plan file or plan request is malformed, from the future, or for another model."""


class InfeasibleError(NowdlError):
    """No partition fits the memory cap; the message says the smallest cap or GPU count that would."""


class TileHaloError(InfeasibleError):
    """The pinned spatial parts cut a node's output into tiles narrower than the halo it reads,
    at any memory cap: ``node`` names the first; the fix is a larger image, fewer parts, or the
    node on a later non-spatial stage."""

    node: str = ""


class ReportedError(NowdlError):
    """A failure already reported for the whole job (rank 0 printed it); exit 2 quietly."""


def error_text(e: BaseException) -> str:
    """One paragraph for ``e``: a NowdlError's message; anything else as ``Type: message`` with a
    hint (out of memory: re-plan; otherwise: -v for the traceback)."""
    if isinstance(e, NowdlError):
        return str(e)
    first = (str(e).strip().splitlines() or [""])[0]
    text = f"{type(e).__name__}: {first}"
    if "out of memory" in first.lower():
        return (text + ". This rank needed more memory than it has: re-plan with a smaller --gpu-memory (the "
                "planner keeps every rank under it) or more GPUs, or pass activation_checkpointing")
    return text + " (unexpected: run again with -v for the traceback, and please report it)"


class NonFiniteError(NowdlError):
    """A step's loss or a gradient is NaN or infinite: the optimizer step did not run."""
