"""What memory a rank may use, what it used, and the budget a re-plan gets when it used more.

[Note: memory cap] A plan gives every rank a budget: the GPU's capacity (``config["gpu_memory"]``)
less the reserve kept for what the plan does not model (``config["reserve"]``, [Note: memory
reserve] in profiler/devices.py). A rank is held to that budget, measured as the step's peak of
tensor bytes: ``torch.cuda.max_memory_allocated`` on a GPU, the aten allocation tracker on a CPU
(``metrics.PeakMeter``). ``NOWDL_MEMORY_CAP=BYTES`` (e.g. ``120000`` or ``2GiB``) holds every
rank to BYTES instead: a test and debugging knob that makes a plan's real peak exceed its cap
on any machine. ``NOWDL_MEMORY_CAP=BYTES,oom`` also makes a CPU rank raise
``torch.OutOfMemoryError`` at the aten allocation that takes it above BYTES, as CUDA's allocator
does at a full GPU (every step is then tracked: slow; for tests).

[Note: memory charge] When ranks measured more than their cap, the re-plan divides the budget
by the largest factor measured/planned among them: ``cap x planned / measured``. The planner's
figure for a rank is a sum of terms that grow with what the rank holds (weights, saved
activations, workspaces of its operators), and what it misses mostly grows with them too (the
allocator's rounding and fragmentation, a library's workspace scales with its operands), so the
factor the model under-counted by is charged to every term of the next plan. The budget is then
below the failing rank's own planned figure, so the re-plan cannot hand out the same assignment
again. A charge in bytes (the budget less the measured excess) would ask for far less memory
than the job needs when the first plan sat well below its cap, and no plan might fit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan
from nowdl.profiler.memory import AllocTracker
from nowdl.units import format_bytes, parse_bytes

__all__ = ["CAP_ENV", "injected_cap", "memory_cap", "Use", "gather_use", "over_cap", "charged_budget", "CapTracker",
           "oom_bytes"]

#: The environment variable of [Note: memory cap].
CAP_ENV = "NOWDL_MEMORY_CAP"


def injected_cap(environ: Any = None) -> tuple[int | None, bool]:
    """``NOWDL_MEMORY_CAP``: (the cap in bytes or None, whether a CPU rank raises OOM above it)."""
    raw = str((os.environ if environ is None else environ).get(CAP_ENV, "")).strip()
    if not raw:
        return None, False
    size, _, mode = raw.partition(",")
    if mode.strip() not in ("", "oom"):
        raise NowdlError(f"{CAP_ENV}={raw!r}: give a size in bytes (e.g. 120000 or 2GiB), optionally followed by "
                         "',oom' (a CPU rank then raises out-of-memory above it)")
    return parse_bytes(size), mode.strip() == "oom"


def memory_cap(plan: Plan) -> int | None:
    """The bytes a rank of ``plan`` may use (None: the plan has no cap): ``NOWDL_MEMORY_CAP``, else
    the plan's budget, its GPU memory less the reserve ([Note: memory cap])."""
    cap, _ = injected_cap()
    if cap is not None:
        return cap
    gpu = plan.config.get("gpu_memory")
    if not gpu:
        return None
    return int(gpu) - int(sum((plan.config.get("reserve") or {}).values()))


@dataclass(frozen=True)
class Use:
    """What one rank used in a step (``measured``) against its plan's figure (``planned``)."""

    rank: int
    measured: int
    planned: int

    def text(self, cap: int) -> str:
        """``rank 1 used 131.3 KiB, above its cap of 107.4 KiB (planned 144.3 KiB)``."""
        return (f"rank {self.rank} used {format_bytes(self.measured)}, above its cap of {format_bytes(cap)} "
                f"(planned {format_bytes(self.planned)})")


def gather_use(measured: int, planned: float, rank: int, world: int) -> list[Use]:
    """Every rank's :class:`Use`, in rank order, on every rank (collective)."""
    mine = (int(measured), int(planned))
    box: list[Any] = [mine]
    if world > 1:
        box = [None] * world
        dist.all_gather_object(box, mine)
    return [Use(r if world > 1 else rank, int(m), int(p)) for r, (m, p) in enumerate(box)]


def over_cap(plan: Plan | None, peak: int, rank: int, world: int) -> tuple[int | None, list[Use]]:
    """``(the cap, the uses above it)`` after a step or window that peaked at ``peak`` bytes on this
    rank (collective when the plan has a cap; ``(None, [])`` when it has none)."""
    cap = memory_cap(plan) if plan is not None else None
    if plan is None or cap is None:
        return None, []
    return cap, [u for u in gather_use(peak, plan.ranks[rank].predicted_peak_bytes, rank, world) if u.measured > cap]


def charged_budget(cap: int, over: list[Use]) -> int:
    """The budget per rank a re-plan gets after ``over`` (uses above ``cap``): ``cap x planned /
    measured`` of the rank that measured the largest factor above its plan ([Note: memory charge])."""
    if not over:
        raise ValueError("charged_budget needs at least one use above the cap")
    return max(1, int(cap * min(max(u.planned, 1) / max(u.measured, 1) for u in over)))


class CapTracker(AllocTracker):
    """The allocation tracker that raises ``torch.OutOfMemoryError`` when ``static`` plus the
    bytes it tracks pass ``cap`` (``NOWDL_MEMORY_CAP=BYTES,oom``, [Note: memory cap])."""

    def __init__(self, cap: int, static: int) -> None:
        super().__init__()
        self.cap, self.static = cap, static

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        before = self.current
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.static + self.current > self.cap:
            raise torch.OutOfMemoryError(
                f"{CAP_ENV} out of memory. Tried to allocate {self.current - before} bytes with "
                f"{self.static + before} bytes in use of a cap of {self.cap} bytes")
        return out


_ASKED = re.compile(r"Tried to allocate ([0-9.]+) ?(bytes|B|KiB|MiB|GiB|TiB)")
_UNIT = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_INUSE = re.compile(r"with ([0-9]+) bytes in use")


def oom_bytes(e: BaseException, cuda: bool) -> int:
    """At least what the step that raised ``e`` needed: the peak before it plus what it asked for."""
    asked = _ASKED.search(str(e))
    extra = 0 if asked is None else int(float(asked.group(1)) * _UNIT[asked.group(2)])
    if cuda:
        return int(torch.cuda.max_memory_allocated()) + extra
    held = _INUSE.search(str(e))
    return (int(held.group(1)) if held else 0) + extra
