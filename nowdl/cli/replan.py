"""``nowdl run`` re-plans when a rank needs more memory than its plan said, instead of dying.

[Note: re-plan on memory] After each of the first :data:`WATCH_STEPS` training steps of a plan,
every rank's measured peak (``metrics.PeakMeter``: CUDA's allocator, the aten allocation
tracker on a CPU) is gathered and compared with the cap it is held to ([Note: memory cap] in
runtime/training/memory_cap.py). When one is above, rank 0 re-plans: the same request, every
pin and the micro-batch size kept (so BatchNorm sees the same micro-batches and the run stays
exact), with the budget per rank charged ([Note: memory charge]); every rank then rebuilds its
engine on the new plan from the current weights and optimizer state ([Note: in-memory
reshard] in runtime/training/reshard.py) and the run goes on from the next step. Rank 0 says so
in one line. A plan that was re-planned once is not re-planned again: a second excess, or a
re-plan that finds nothing that fits, stops the job in one paragraph (exit status 2). A step
that raises out-of-memory stops the job for its next attempt to re-plan ([Note: restart on
memory] in runrecord.py). There is no loop.
"""

from __future__ import annotations

import argparse
import gc
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nowdl.cli.runjob import Job, compile_job
from nowdl.cli.runplan import current_plan, plan_job, plan_line
from nowdl.cli.runrecord import MemoryRecord, advice, stop_text, write_record
from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan
from nowdl.runtime.data.feed import Feed
from nowdl.runtime.training.memory_cap import Use, charged_budget, gather_use, memory_cap, oom_bytes
from nowdl.runtime.training.reshard import HeldState, gather_state
from nowdl.units import format_bytes

__all__ = ["MemoryGuard", "WATCH_STEPS", "Replan", "replanner", "replanned_line"]

#: The steps of each plan whose peaks are checked against the cap.
WATCH_STEPS = 3

#: ``replan(gpu_memory, old_plan, step)`` -> (the new plan's path, ``build(state)``: the compiled model on it)
Replan = Callable[[int, Plan, int], tuple[str, Callable[[HeldState], Any]]]


def replanned_line(said: str, budget: int, plan: Plan, goes_on: str) -> str:
    """Rank 0's line when a job re-planned: who needed what, the budget, where it goes on, the new plan."""
    levers = [f"stage {s.index} {'recomputes' if s.recompute else 'offloads'}" for s in plan.stages
              if s.recompute or s.offload]
    return (f"memory: {said}; re-planned for {format_bytes(budget)} per rank (the cap x planned/measured) and "
            f"{goes_on}: {plan_line(None, plan)}" + ("; " + ", ".join(levers) if levers else ""))


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
        records: the ``--checkpoint`` folder, where an out-of-memory is recorded (None: not).
        budget: the budget per rank of the plan the run starts on when it is already a re-plan
            (a restarted attempt's, [Note: restart on memory]).
    """

    def __init__(self, rank: int, world: int, emit: Callable[[str], None], replan: Replan, *,
                 records: Path | None = None, budget: int | None = None) -> None:
        self.rank, self.world, self.emit, self.replan, self.records = rank, world, emit, replan, records
        self.budget = budget  # the budget per rank of the re-plan, once there was one
        self.seen = 0  # steps of this plan checked so far

    @property
    def watching(self) -> bool:
        """Whether the next step is checked."""
        return self.seen < WATCH_STEPS

    def check(self, cm: Any, peak: int, step: int) -> Any:
        """After step ``step`` (1-based) ran with this rank's ``peak`` bytes: the compiled model
        to go on with, re-planned when a rank was above its cap (collective)."""
        plan = current_plan(cm)
        cap = memory_cap(plan) if plan is not None else None
        if cap is None:
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
        self.emit(replanned_line(said, budget, Plan.load(path), f"went on from step {step + 1} with the same weights"))
        return new

    def out_of_memory(self, e: BaseException, cm: Any, step: int) -> NowdlError:
        """The job's error for the out-of-memory ``e`` this rank raised in step ``step`` (1-based),
        recorded for the next attempt ([Note: restart on memory])."""
        plan = current_plan(cm)
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


def replanner(job: Job, feed: Feed, optimizer: Any, compile_params: Any) -> Replan:
    """The guard's re-plan ([Note: re-plan on memory]): ``replan(gpu_memory, plan, step)`` plans
    the run again with ``gpu_memory``, the micro-batch size of ``plan`` kept, on a new copy of the
    model, and returns the plan's path and how to build it with the job's state before ``step``."""
    from nowdl.models.resolve import resolve_model

    def replan(gpu_memory: int, old: Plan, step: int) -> tuple[str, Callable[[HeldState], Any]]:
        rng = torch.get_rng_state()  # the run's RNG goes on as it would have
        torch.manual_seed(job.args.seed)
        fresh, _, _ = resolve_model(job.src.spec, job.src.model_args)
        torch.set_rng_state(rng)
        args = argparse.Namespace(**{**vars(job.args), "gpu_memory": gpu_memory})
        text = plan_job(fresh, args, job.rank, job.world, job.batch, int(old.model["inputs"][0][0]), job.src,
                        optimizer, False, pin_micro_batch=True)
        path = job.tmp / "replan.json"
        path.write_text(text)

        def build(state: HeldState) -> Any:
            cm = compile_job(job, fresh, str(path), optimizer, compile_params, False)
            feed.relayout(step, lazy=any(st.parts > 1 for st in Plan.load(path).stages))  # tiles read lazily
            x, _, _ = feed.next(step)
            cm._train().restore(state, x)
            return cm

        return str(path), build

    return replan
