"""What a rank that ran out of memory leaves for the job's next attempt, and what that attempt makes of it.

[Note: restart on memory] A step that raises out-of-memory (``torch.OutOfMemoryError``) on one
rank cannot be repaired in the process: its peers wait inside the step's exchanges. The rank
writes ``DIR/memory-rank-R.json`` in the ``--checkpoint`` folder (the step, what it needed at
least, its plan's figure, its cap, the micro-batch size, and whether its plan was already a
re-plan) and the job stops with exit status 2 ([Note: error contract] in
runtime/launch/failure.py). Under ``torchrun --max-restarts N`` or a Slurm requeue the same
command starts again ([Note: restarts] in runtime/launch/attempt.py): its rank 0 reads the
records, re-plans with the charge of [Note: memory charge] (runtime/training/memory_cap.py),
says so in one line, and the run resumes from the latest checkpoint (from the start when none
was saved yet), as exact as any resume. A record of a plan that was already a re-plan stops
every later attempt at once with one paragraph: there is no loop. A job's first attempt (not a
restart) removes the records an earlier job left.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nowdl.errors import NowdlError
from nowdl.runtime.launch.attempt import restart_count
from nowdl.runtime.training.memory_cap import Use, charged_budget
from nowdl.units import format_bytes

__all__ = ["MemoryRecord", "Charge", "write_record", "restart_charge", "advice", "stop_text"]

_PATTERN = "memory-rank-*.json"


def advice(fit: str = "") -> str:
    """What a user can do when the memory a job measured does not hold on its GPUs."""
    more = f" ({fit})" if fit else ""
    return (f"Give each rank less to hold: more GPUs{more}, a smaller --input or --batch-size, the memory levers "
            "(--recompute on, --offload on, --tiles-per-gpu), or a --gpu-memory below the GPU's so every plan keeps "
            "more room; --log-dir's metrics.jsonl has each rank's measured and planned peak per step.")


def stop_text(said: str, budget: int | None) -> str:
    """The paragraph that stops a job whose re-planned plan needed more memory than its cap too."""
    how = f" for {format_bytes(budget)} per rank" if budget else ""
    return (f"{said}, on a plan already re-planned{how} because a rank needed more memory than planned: the job "
            f"stops (exit status 2) rather than re-plan again. {advice()}")


@dataclass(frozen=True)
class MemoryRecord:
    """One rank's out-of-memory, as the next attempt reads it ([Note: restart on memory])."""

    rank: int
    step: int  # 1-based
    measured: int  # at least what the step needed
    planned: int  # the plan's figure for the rank
    cap: int  # what the rank was held to ([Note: memory cap])
    reserve: int  # the plan's reserve (its GPU memory less its budget)
    micro_batch: int  # samples per micro-batch of the plan
    replanned: bool  # the plan was already a re-plan
    budget: int | None = None  # the budget of that re-plan

    def said(self, when: str = "") -> str:
        """``rank 1 ran out of memory in step 2{when}: it needed at least ..., above its cap of ... (planned ...)``."""
        return (f"rank {self.rank} ran out of memory in step {self.step}{when}: it needed at least "
                f"{format_bytes(self.measured)}, above its cap of {format_bytes(self.cap)} (planned "
                f"{format_bytes(self.planned)})")


def write_record(folder: Path, rec: MemoryRecord) -> None:
    """Write ``rec`` as ``folder/memory-rank-R.json`` (atomically; best effort: a folder that
    cannot be written leaves the restart without the charge)."""
    path = folder / f"memory-rank-{rec.rank}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(asdict(rec)))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class Charge:
    """What a restarted attempt re-plans with: the GPU memory to plan for, the micro-batch size
    kept, the budget per rank, and the line that says why."""

    gpu_memory: int
    micro_batch: int
    budget: int
    said: str


def _read(folder: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(folder.glob(_PATTERN)):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return out


def restart_charge(folder: Path, rank: int, world: int) -> Charge | None:
    """The charge a restarted attempt re-plans with (None: no rank ran out of memory in an earlier
    attempt). Collective: rank 0 reads the records (a first attempt removes them) and every rank
    gets the same answer.

    Raises:
        NowdlError: a record of a plan that was already re-planned (the job stops).
    """
    box: list[Any] = [[]]
    if rank == 0:
        if restart_count() > 0:
            box[0] = _read(folder)
        else:
            for f in folder.glob(_PATTERN):
                f.unlink(missing_ok=True)
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    try:
        records = [MemoryRecord(**r) for r in box[0]]
    except TypeError:
        records = []
    if not records:
        return None
    again = [r for r in records if r.replanned]
    if again:
        raise NowdlError(stop_text(again[0].said(" of an earlier attempt"), again[0].budget))
    worst = min(records, key=lambda r: max(r.planned, 1) / max(r.measured, 1))
    said = worst.said(" of the previous attempt") + "".join(f", as did rank {r.rank}" for r in records if r is not worst)
    cap = min(r.cap for r in records)
    budget = charged_budget(cap, [Use(r.rank, r.measured, r.planned) for r in records])
    return Charge(gpu_memory=budget + worst.reserve, micro_batch=worst.micro_batch, budget=budget, said=said)
