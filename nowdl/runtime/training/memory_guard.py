"""A job that re-plans when a rank needs more memory than its plan said, instead of dying.

[Note: re-plan on memory] After each of the first :data:`WATCH_STEPS` training steps of a plan,
every rank's measured peak (``metrics.PeakMeter``: CUDA's allocator, the aten allocation
tracker on a CPU) is gathered and compared with the cap it is held to ([Note: memory cap] in
memory_cap.py). When one is above, rank 0 re-plans: the same request, every pin and the
micro-batch size kept (so BatchNorm sees the same micro-batches and the run stays exact), with
the budget per rank charged ([Note: memory charge]); every rank then rebuilds its engine on the
new plan from the current weights and optimizer state ([Note: in-memory reshard] in
reshard.py) and the run goes on from the next step. Rank 0 says so in one line. A plan that was
re-planned once is not re-planned again: a second excess, or a re-plan that finds nothing that
fits, stops the job in one paragraph (exit status 2). There is no loop.

[Note: restart on memory] A step that raises out-of-memory (``torch.OutOfMemoryError``) on one
rank cannot be repaired in the process: its peers wait inside the step's exchanges. The rank
writes ``DIR/memory-rank-R.json`` in the ``--checkpoint`` folder (the step; what it needed at
least, which is the peak up to the failed allocation plus its size, a lower bound; its plan's
figure; its cap; the micro-batch size; whether its plan was already a re-plan) and the job stops
with exit status 2 ([Note: error contract] in runtime/launch/failure.py). Under ``torchrun
--max-restarts N`` or a Slurm requeue the same command starts again ([Note: restarts] in
runtime/launch/attempt.py): its rank 0 reads the records, re-plans with the charge, says so in
one line, and the run resumes from the latest checkpoint (from the start when none was saved
yet), as exact as any resume. A record of a plan that was already a re-plan stops every later
attempt at once with one paragraph. A job's first attempt (not a restart) removes the records
an earlier job left.
"""

from __future__ import annotations

import gc
import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan
from nowdl.runtime.launch.attempt import restart_count
from nowdl.runtime.training.memory_cap import Use, charged_budget, gather_use, memory_cap, oom_bytes
from nowdl.runtime.training.reshard import HeldState, gather_state
from nowdl.units import format_bytes

__all__ = ["MemoryGuard", "WATCH_STEPS", "Replan", "replanned_line", "MemoryRecord", "Charge", "write_record",
           "restart_charge", "advice", "stop_text"]

#: The steps of each plan whose peaks are checked against the cap.
WATCH_STEPS = 3

#: ``replan(gpu_memory, old_plan, step)`` -> (the new plan's path, ``build(state)``: the compiled model on it)
Replan = Callable[[int, Plan, int], tuple[str, Callable[[HeldState], Any]]]

_PATTERN = "memory-rank-*.json"


def _plan_of(cm: Any) -> Plan | None:
    return getattr(getattr(cm, "_trainer", None), "plan", None)


def replanned_line(said: str, budget: int, plan: Plan, goes_on: str, describe: Callable[[Plan], str]) -> str:
    """Rank 0's line when a job re-planned: who needed what, the budget, where it goes on, the new
    plan (``describe(plan)``) and the stages that recompute or offload."""
    levers = [f"stage {s.index} {'recomputes' if s.recompute else 'offloads'}" for s in plan.stages
              if s.recompute or s.offload]
    return (f"memory: {said}; re-planned for {format_bytes(budget)} per rank (the cap x planned/measured) and "
            f"{goes_on}: {describe(plan)}" + ("; " + ", ".join(levers) if levers else ""))


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


def _said(over: list[Use], cap: int, step: int) -> tuple[str, Use]:
    worst = min(over, key=lambda u: max(u.planned, 1) / max(u.measured, 1))
    return (f"rank {worst.rank} used {format_bytes(worst.measured)} in step {step}, above its cap of "
            f"{format_bytes(cap)} (planned {format_bytes(worst.planned)})"
            + "".join(f", as did rank {u.rank}" for u in over if u is not worst)), worst


def _fits(e: BaseException) -> str:
    """The planner's count of GPUs that would fit, from its refusal ("" if it names none)."""
    m = re.search(r"(\d+) GPUs would fit it", str(e))
    return f"{m.group(1)} would fit it" if m else ""


class MemoryGuard:
    """Checks the first steps of each plan against the cap and re-plans once ([Note: re-plan on memory]).

    Args:
        rank, world: this process and the job size.
        emit: prints rank 0's lines.
        replan: see :data:`Replan` (both calls collective).
        describe: the plan's description in rank 0's line.
        records: the ``--checkpoint`` folder, where an out-of-memory is recorded (None: not).
        budget: the budget per rank of the plan the run starts on when it is already a re-plan
            (a restarted attempt's, [Note: restart on memory]).
    """

    def __init__(self, rank: int, world: int, emit: Callable[[str], None], replan: Replan,
                 describe: Callable[[Plan], str], *, records: Path | None = None, budget: int | None = None) -> None:
        self.rank, self.world, self.emit, self.replan, self.records = rank, world, emit, replan, records
        self.describe = describe
        self.budget = budget  # the budget per rank of the re-plan, once there was one
        self.seen = 0  # steps of this plan checked so far

    @property
    def watching(self) -> bool:
        """Whether the next step is checked."""
        return self.seen < WATCH_STEPS

    def check(self, cm: Any, peak: int, step: int) -> Any:
        """After step ``step`` (1-based) ran with this rank's ``peak`` bytes: the compiled model
        to go on with, re-planned when a rank was above its cap (collective)."""
        plan = _plan_of(cm)
        cap = memory_cap(plan) if plan is not None else None
        if plan is None or cap is None:
            self.seen = WATCH_STEPS
            return cm
        self.seen += 1
        over = [u for u in gather_use(peak, plan.ranks[self.rank].predicted_peak_bytes, self.rank, self.world)
                if u.measured > cap]
        if not over:
            return cm
        said, _ = _said(over, cap, step)
        if self.budget is not None:
            raise NowdlError(stop_text(said, self.budget))
        budget = charged_budget(cap, over)
        try:
            path, build = self.replan(budget + int(sum((plan.config.get("reserve") or {}).values())), plan, step)
        except NowdlError as e:
            first = str(e).split(". ")[0]
            raise NowdlError(f"{said}: no plan fits {format_bytes(budget)} per rank, the cap charged for what was "
                             f"measured (the cap x planned/measured) [{first}]: the job stops (exit status 2). "
                             f"{advice(_fits(e))}") from None
        state = gather_state(cm._train())
        del cm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        new = build(state)
        del state
        self.budget, self.seen = budget, 0
        self.emit(replanned_line(said, budget, Plan.load(path), f"went on from step {step + 1} with the same weights",
                                 self.describe))
        return new

    def out_of_memory(self, e: BaseException, cm: Any, step: int) -> NowdlError:
        """The job's error for the out-of-memory ``e`` this rank raised in step ``step`` (1-based),
        recorded for the next attempt ([Note: restart on memory])."""
        plan = _plan_of(cm)
        cap = memory_cap(plan) if plan is not None else None
        if plan is None or cap is None:
            return NowdlError(f"rank {self.rank} ran out of memory in step {step} ({str(e).splitlines()[0][:200]}): "
                              f"the job stops (exit status 2). {advice()}")
        reserve = int(sum((plan.config.get("reserve") or {}).values()))
        rec = MemoryRecord(rank=self.rank, step=step, measured=oom_bytes(e, torch.cuda.is_available()),
                           planned=int(plan.ranks[self.rank].predicted_peak_bytes), cap=cap, reserve=reserve,
                           micro_batch=int(plan.model["inputs"][0][0]), replanned=self.budget is not None,
                           budget=self.budget)
        if self.records is not None:
            write_record(self.records, rec)
        if rec.replanned:
            return NowdlError(stop_text(rec.said(), self.budget))
        budget = charged_budget(cap, [Use(rec.rank, rec.measured, rec.planned)])
        if self.records is not None:
            then = (f"a restart (torchrun --max-restarts N, a Slurm requeue) re-plans for {format_bytes(budget)} per "
                    f"rank, the cap x planned/measured, and resumes from the latest checkpoint in {self.records}")
        else:
            then = (f"run it again with --gpu-memory {budget + rec.reserve} (bytes: {format_bytes(budget)} per rank after "
                    "the reserve, the cap x planned/measured), or with --checkpoint DIR under torchrun --max-restarts "
                    "N, which re-plans by itself")
        return NowdlError(f"{rec.said()}: the job stops (exit status 2); {then}.")
