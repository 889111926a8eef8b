"""``nowdl run`` re-plans when a rank needs more memory than its plan said, instead of dying.

[Note: re-plan on memory] After each of the first :data:`WATCH_STEPS` training steps of a plan,
every rank's measured peak (``metrics.PeakMeter``: CUDA's allocator, the aten allocation
tracker on a CPU) is gathered and compared with the cap it is held to ([Note: memory cap] in
runtime/training/memory_cap.py). When one is above, rank 0 re-plans: the same request, every
pin and the micro-batch size kept (so BatchNorm sees the same micro-batches and the run stays
exact), with the budget per rank charged ([Note: memory charge]); every rank then rebuilds its
engine on the new plan from the current weights and optimizer state ([Note: in-memory
reshard] in runtime/training/reshard.py) and the run goes on from the next step. Rank 0 says so
in one line. A plan that was re-planned once is not re-planned again: a second excess (or a
re-plan that finds nothing that fits) stops the job in one paragraph, exit status 2. There is no
loop.

A step that raises out-of-memory cannot be recovered in the process (its peers wait inside the
step's exchanges); :meth:`MemoryGuard.out_of_memory` turns it into the job's error with the
figures and what a restart does ([Note: restart on memory] in runrecord.py).
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from typing import Any

import torch

from nowdl.cli.runjob import Job, compile_job
from nowdl.cli.runplan import current_plan, plan_job, plan_line
from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan
from nowdl.runtime.data.feed import Feed
from nowdl.runtime.training.memory_cap import Use, charged_budget, gather_use, memory_cap, oom_bytes
from nowdl.runtime.training.reshard import HeldState, gather_state
from nowdl.units import format_bytes

__all__ = ["MemoryGuard", "WATCH_STEPS", "levers_text", "advice", "replanner", "Replan"]

#: The steps of each plan whose peaks are checked against the cap.
WATCH_STEPS = 3

#: ``replan(gpu_memory, old_plan, step)`` -> (the new plan's path, ``build(state)``: the compiled model on it)
Replan = Callable[[int, Plan, int], tuple[str, Callable[[HeldState], Any]]]


def levers_text(plan: Plan) -> str:
    """``; stage 0 offloads, stage 1 recomputes`` (empty: no stage does)."""
    parts = [f"stage {s.index} {'recomputes' if s.recompute else 'offloads'}" for s in plan.stages
             if s.recompute or s.offload]
    return "; " + ", ".join(parts) if parts else ""


def advice(gpu_memory: int | None) -> str:
    """What a user can do when no plan holds in the memory there is."""
    lower = f" (below {format_bytes(gpu_memory)})" if gpu_memory else ""
    return ("Give each rank less to hold: more GPUs (torchrun --nproc-per-node), a smaller --input or --batch-size, "
            f"a lower --gpu-memory{lower} so the planner keeps more room, or the memory levers (--recompute on, "
            "--offload on, --tiles-per-gpu); --log-dir's metrics.jsonl has every rank's measured and planned peak "
            "per step.")


class MemoryGuard:
    """Checks the first steps of each plan against the cap and re-plans once ([Note: re-plan on memory]).

    Args:
        rank, world: this process and the job size.
        emit: prints rank 0's lines.
        replan: ``replan(gpu_memory, old_plan, step)`` -> the new plan's path, planned on rank 0
            and shared, and ``build(state)``, which compiles it and loads ``state`` with step
            ``step``'s batch (0-based; both collective).
        replanned: the plan this run starts on is already a re-plan (a restarted attempt's).
    """

    def __init__(self, rank: int, world: int, emit: Callable[[str], None],
                 replan: Replan,
                 *, replanned: bool = False) -> None:
        self.rank, self.world, self.emit, self.replan = rank, world, emit, replan
        self.replanned = replanned
        self.seen = 0  # steps of this plan checked so far
        self.budget: int | None = None  # the budget of the re-plan

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
        uses = gather_use(peak, plan.ranks[self.rank].predicted_peak_bytes, self.rank, self.world)
        over = [u for u in uses if u.measured > cap]
        if not over:
            return cm
        worst = min(over, key=lambda u: max(u.planned, 1) / max(u.measured, 1))
        said = f"{worst.text(cap)} in step {step}" + (f" (and {len(over) - 1} other rank(s))" if len(over) > 1 else "")
        if self.replanned:
            raise NowdlError(self._again(said, cap))
        budget = charged_budget(cap, over)
        reserve = int(sum((plan.config.get("reserve") or {}).values()))
        try:
            path, build = self.replan(budget + reserve, plan, step)
        except NowdlError as e:
            raise NowdlError(f"{said}; re-planning for {format_bytes(budget)} per rank ([Note: memory charge]) found "
                             f"nothing that fits: {e}. The job stops (exit status 2). {advice(plan.config.get('gpu_memory'))}"
                             ) from None
        state = gather_state(cm._train())
        del cm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        new = build(state)
        del state
        self.replanned, self.seen, self.budget = True, 0, budget
        new_plan = Plan.load(path)
        self.emit(f"memory: {said}; re-planned for {format_bytes(budget)} per rank (the cap x planned/measured) and "
                  f"went on from step {step + 1} with the same weights: {plan_line(new, new_plan)}"
                  f"{levers_text(new_plan)}")
        return new

    def _again(self, said: str, cap: int) -> str:
        how = f"{format_bytes(self.budget)} per rank" if self.budget is not None else "the memory measured before"
        return (f"{said}, on a plan already re-planned for {how} after a rank needed more memory than planned: the job "
                f"stops (exit status 2) rather than re-plan again. {advice(None)}")

    def out_of_memory(self, e: BaseException, cm: Any, step: int) -> NowdlError:
        """The job's error for the out-of-memory ``e`` this rank raised in step ``step`` (1-based)."""
        plan = current_plan(cm)
        needed = oom_bytes(e, torch.cuda.is_available())
        planned = int(plan.ranks[self.rank].predicted_peak_bytes) if plan is not None else 0
        cap = memory_cap(plan) if plan is not None else None
        said = (f"rank {self.rank} ran out of memory in step {step}: it needed at least {format_bytes(needed)}"
                + (f", above its cap of {format_bytes(cap)}" if cap else "") + f" (planned {format_bytes(planned)})")
        if self.replanned:
            return NowdlError(self._again(said, cap or 0))
        budget = charged_budget(cap, [Use(self.rank, needed, planned)]) if cap else None
        fix = f"; or run again with --gpu-memory {format_bytes(budget)} more than the reserve" if budget else ""
        return NowdlError(f"{said}: the job stops (exit status 2){fix}.")


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
