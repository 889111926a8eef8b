"""A job that re-plans when a rank needs more memory than its plan said, instead of dying.

[Note: re-plan on memory] After each of the first :data:`WATCH_STEPS` training steps of a plan,
every rank's measured peak (``metrics.PeakMeter``: CUDA's allocator, the aten allocation
tracker on a CPU) is gathered and compared with the cap it is held to ([Note: memory cap] in
memory_cap.py); CPU ranks only under ``NOWDL_MEMORY_CAP``, since a plan's budget is a GPU's and
the tracker slows a CPU step. When one is above, rank 0 re-plans: the same request, every pin
and the micro-batch size kept (so BatchNorm sees the same micro-batches and the run stays
exact), with the budget per rank charged ([Note: memory charge]); every rank then rebuilds its
engine on the new plan from the current weights and optimizer state ([Note: in-memory
reshard] in reshard.py) and the run goes on from the next step. Rank 0 says so in one line. A
plan that was re-planned once is not re-planned again: a second excess, or a re-plan that finds
nothing that fits, stops the job in one paragraph (exit status 2). There is no loop.

[Note: restart on memory] A step that raises out-of-memory (``torch.OutOfMemoryError``) on one
rank cannot be repaired in the process: its peers wait inside the step's exchanges. The rank
writes ``DIR/memory-rank-R.json`` in the ``--checkpoint`` folder (the step; what it needed at
least: the peak up to the failed allocation plus its size, a lower bound; its plan's figure; its
cap; the micro-batch size) and the job stops with exit status 2 ([Note: error contract] in
runtime/launch/failure.py). Under ``torchrun --max-restarts N`` or a Slurm requeue the same
command starts again ([Note: restarts] in runtime/launch/attempt.py): its rank 0 reads the
records, re-plans with the charge, says so in one line, and the run resumes from the latest
checkpoint (from the start when none was saved yet), as exact as any resume. The in-process
re-plan and a stop write their records too, so that a restart (after any failure) runs the
re-plan again, and a job that stopped stops every later attempt at once with its paragraph
instead of trying again. A job's first attempt (not a restart) removes the records an earlier
job left.
"""

from __future__ import annotations

import dataclasses
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
from nowdl.runtime.training.memory_cap import Use, charged_budget, memory_cap, oom_bytes, over_cap
from nowdl.runtime.training.reshard import HeldState, gather_state, release
from nowdl.units import format_bytes

__all__ = ["MemoryGuard", "WATCH_STEPS", "Replan", "plan_text", "replanned_line", "MemoryRecord", "Charge", "write_record",
           "restart_charge", "advice", "stop_text"]

#: The steps of each plan whose peaks are checked against the cap.
WATCH_STEPS = 3

#: ``replan(gpu_memory, old_plan, step)`` -> (the new plan's path, ``build(state)``: the compiled model on it)
Replan = Callable[[int, Plan, int], tuple[str, Callable[[HeldState], Any]]]

_PATTERN = "memory-rank-*.json"


def _plan_of(cm: Any) -> Plan | None:
    return getattr(getattr(cm, "_trainer", None), "plan", None)


def plan_text(plan: Plan) -> str:
    """``plan: 2 stage(s) x 4 micro-batch(es) (1f1b), replicas 1, dp 1, 2 rank(s)``, and the spatial
    stages' tiles (``nowdl run`` prints it after the first step)."""
    c = plan.config
    return (f"{'inference plan' if c.get('inference') else 'plan'}: {c.get('stages')} stage(s) x "
            f"{c.get('micro_batches')} micro-batch(es) ({c.get('schedule')}), replicas {c.get('replicas')}, dp "
            f"{c.get('dp')}, {c.get('gpus')} rank(s)"
            + "".join(f"; {s.tiles()}" + (f", {len(s.fused)} fused halo run(s)" if s.fused else "")
                      for s in plan.stages if s.parts > 1))


def replanned_line(said: str, budget: int, plan: Plan, goes_on: str) -> str:
    """Rank 0's line when a job re-planned: who needed what, the budget, where it goes on, the new
    plan and the stages that recompute or offload."""
    levers = [f"stage {s.index} {'recomputes' if s.recompute else 'offloads'}" for s in plan.stages
              if s.recompute or s.offload]
    return (f"memory: {said}; re-planned for {format_bytes(budget)} per rank (the cap x planned/measured) and "
            f"{goes_on}: {plan_text(plan)}" + ("; " + ", ".join(levers) if levers else ""))


def advice(fit: str = "") -> str:
    """What a user can do when the memory a job measured does not hold on its GPUs."""
    more = f" ({fit})" if fit else ""
    return (f"Give each rank less to hold: more GPUs{more}, a smaller --input or --batch-size, the memory levers "
            "(--recompute on, --offload on, --tiles-per-gpu), or a --gpu-memory below the GPU's so every plan keeps "
            "more room; --log-dir's metrics.jsonl has each rank's measured and planned peak per step.")


@dataclass(frozen=True)
class MemoryRecord:
    """One rank's excess, as the job's next attempt reads it ([Note: restart on memory])."""

    rank: int
    step: int  # 1-based
    measured: int  # the step's peak; with ``oom``, at least what the step needed
    planned: int  # the plan's figure for the rank
    cap: int  # what the rank was held to ([Note: memory cap])
    reserve: int  # the plan's reserve (its GPU memory less its budget)
    micro_batch: int  # samples per micro-batch of the plan
    oom: bool = False  # the step raised out-of-memory
    stopped: str = ""  # the paragraph that stopped the job

    def said(self, when: str = "") -> str:
        """``rank 1 used ... in step 2{when}, above its cap of ... (planned ...)`` (or ran out of memory)."""
        need = (f"ran out of memory in step {self.step}{when}: it needed at least {format_bytes(self.measured)}"
                if self.oom else f"used {format_bytes(self.measured)} in step {self.step}{when}")
        return f"rank {self.rank} {need}, above its cap of {format_bytes(self.cap)} (planned {format_bytes(self.planned)})"


def _said(records: list[MemoryRecord], when: str = "") -> str:
    """The worst record's words (the largest factor above its plan) and the other ranks named."""
    worst = min(records, key=lambda r: max(r.planned, 1) / max(r.measured, 1))
    return worst.said(when) + "".join(f", as did rank {r.rank}" for r in records if r is not worst)


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
    kept, the budget per rank, and the words that say why."""

    gpu_memory: int
    micro_batch: int
    budget: int
    said: str


def restart_charge(folder: Path, rank: int, world: int) -> Charge | None:
    """The charge a restarted attempt re-plans with (None: no record of an earlier attempt).
    Collective: rank 0 reads the records (a job's first attempt removes them) and every rank gets
    the same answer.

    Raises:
        NowdlError: an earlier attempt of the job stopped for memory (its paragraph).
    """
    box: list[Any] = [[]]
    if rank == 0:
        for f in sorted(folder.glob(_PATTERN)):
            try:
                if restart_count() > 0:
                    box[0].append(json.loads(f.read_text()))
                else:
                    f.unlink()
            except (OSError, ValueError):
                continue
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    try:
        records = [MemoryRecord(**r) for r in box[0]]
    except TypeError:  # another version's records
        records = []
    if not records:
        return None
    stopped = [r.stopped for r in records if r.stopped]
    if stopped:
        raise NowdlError(f"{stopped[0]} (an earlier attempt of this job stopped so: a restart does not try again)")
    cap = min(r.cap for r in records)
    budget = charged_budget(cap, [Use(r.rank, r.measured, r.planned) for r in records])
    return Charge(gpu_memory=budget + records[0].reserve, micro_batch=records[0].micro_batch, budget=budget,
                  said=_said(records, " of an earlier attempt"))


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
        records: the ``--checkpoint`` folder, where excesses are recorded (None: not).
        budget: the budget per rank of the plan the run starts on when it is already a re-plan
            (a restarted attempt's, [Note: restart on memory]).
        watch: check the first steps (False: only report out-of-memory).
    """

    def __init__(self, rank: int, world: int, emit: Callable[[str], None], replan: Replan, *,
                 records: Path | None = None, budget: int | None = None, watch: bool = True) -> None:
        self.rank, self.world, self.emit, self.replan, self.records = rank, world, emit, replan, records
        self.budget = budget  # the budget per rank of the re-plan, once there was one
        self.seen = 0 if watch else WATCH_STEPS  # steps of this plan checked so far

    @property
    def watching(self) -> bool:
        """Whether the next step is checked."""
        return self.seen < WATCH_STEPS

    def _records(self, plan: Plan, cap: int, uses: list[Use], step: int, *, oom: bool = False) -> list[MemoryRecord]:
        reserve = int(sum((plan.config.get("reserve") or {}).values()))
        return [MemoryRecord(rank=u.rank, step=step, measured=u.measured, planned=u.planned, cap=cap, reserve=reserve,
                             micro_batch=int(plan.model["inputs"][0][0]), oom=oom) for u in uses]

    def _keep(self, records: list[MemoryRecord], stopped: str = "", *, agreed: bool = True) -> None:
        """Write ``records`` when there is a folder: rank 0 writes what every rank agreed on, a rank
        its own out-of-memory."""
        if self.records is not None and (self.rank == 0 or not agreed):
            for rec in records:
                write_record(self.records, dataclasses.replace(rec, stopped=stopped))

    def check(self, cm: Any, peak: int, step: int) -> Any:
        """After step ``step`` (1-based) ran with this rank's ``peak`` bytes: the compiled model
        to go on with, re-planned when a rank was above its cap (collective)."""
        plan = _plan_of(cm)
        cap, over = over_cap(plan, peak, self.rank, self.world)
        self.seen = WATCH_STEPS if cap is None else self.seen + 1
        if plan is None or cap is None or not over:
            return cm
        records = self._records(plan, cap, over, step)
        said = _said(records)
        if self.budget is not None:
            raise self._stop(records, stop_text(said, self.budget))
        budget = charged_budget(cap, over)
        try:
            path, build = self.replan(budget + records[0].reserve, plan, step)
        except NowdlError as e:
            first = str(e).split(". ")[0]
            raise self._stop(records, f"{said}: no plan fits {format_bytes(budget)} per rank, the cap charged for "
                                      f"what was measured (the cap x planned/measured) [{first}]: the job stops "
                                      f"(exit status 2). {advice(_fits(e))}") from None
        self._keep(records)
        state = gather_state(cm._train())
        release(cm)
        del cm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        new = build(state)
        del state
        self.budget, self.seen = budget, 0
        self.emit(replanned_line(said, budget, Plan.load(path), f"went on from step {step + 1} with the same weights"))
        return new

    def _stop(self, records: list[MemoryRecord], text: str, *, agreed: bool = True) -> NowdlError:
        self._keep(records, text, agreed=agreed)
        return NowdlError(text)

    def out_of_memory(self, e: BaseException, cm: Any, step: int) -> NowdlError:
        """The job's error for the out-of-memory ``e`` this rank raised in step ``step`` (1-based),
        recorded for the next attempt ([Note: restart on memory])."""
        plan = _plan_of(cm)
        cap = memory_cap(plan) if plan is not None else None
        if plan is None or cap is None:
            return NowdlError(f"rank {self.rank} ran out of memory in step {step} ({str(e).splitlines()[0][:200]}): "
                              f"the job stops (exit status 2). {advice()}")
        use = Use(self.rank, oom_bytes(e, torch.cuda.is_available()), int(plan.ranks[self.rank].predicted_peak_bytes))
        rec = self._records(plan, cap, [use], step, oom=True)
        if self.budget is not None:
            return self._stop(rec, stop_text(rec[0].said(), self.budget), agreed=False)
        self._keep(rec, agreed=False)
        budget = charged_budget(cap, [use])
        if self.records is not None:
            then = (f"a restart (torchrun --max-restarts N, a Slurm requeue) re-plans for {format_bytes(budget)} per "
                    f"rank, the cap x planned/measured, and resumes from the latest checkpoint in {self.records} (from "
                    "the start when none was saved)")
        else:
            then = (f"run it again with --gpu-memory {budget + rec[0].reserve} (bytes: {format_bytes(budget)} per rank "
                    "after the reserve, the cap x planned/measured), or with --checkpoint DIR under torchrun "
                    "--max-restarts N, which re-plans by itself")
        return NowdlError(f"{rec[0].said()}: the job stops (exit status 2); {then}.")


def stop_text(said: str, budget: int | None) -> str:
    """The paragraph that stops a job whose re-planned plan needed more memory than its cap too."""
    how = f" for {format_bytes(budget)} per rank" if budget else ""
    return (f"{said}, on a plan already re-planned{how} because a rank needed more memory than planned: the job "
            f"stops (exit status 2) rather than re-plan again. {advice()}")
