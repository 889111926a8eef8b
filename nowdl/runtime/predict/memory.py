"""Predict re-plans its windows when a rank needs more memory than the inference plan said.

The windows' form of [Note: re-plan on memory] (runtime/training/memory_guard.py): after each of
the first :data:`WATCH_WINDOWS` measured windows of a plan (``measure_memory``; CUDA's counter
costs nothing, the CPU's tracker slows those windows), every rank's peak is gathered and
compared with its cap ([Note: memory cap]). When one is above, rank 0 plans the windows again
with the budget charged ([Note: memory charge]), every rank builds the new engine (the weights
are the model's own, or the ones predict was given) and the next window runs on it; the windows
already written stay as they are, since a prediction is exact whatever the plan. Windows of
another shape (a later image) are planned with the charged budget too. Once re-planned, a
second excess stops the prediction in one paragraph; the line that says it re-planned is
logged and kept in the summary (``nowdl predict`` prints it).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from nowdl.errors import NowdlError
from nowdl.partitioner.config.candidate import PlanRequest
from nowdl.plan.plan import Plan
from nowdl.runtime.training.memory_cap import charged_budget, over_cap
from nowdl.runtime.training.memory_guard import advice, replanned_line, stop_text
from nowdl.units import format_bytes

__all__ = ["WindowGuard", "WATCH_WINDOWS", "with_gpu_memory"]

log = logging.getLogger(__name__)

#: The measured windows of each plan whose peaks are checked against the cap.
WATCH_WINDOWS = 2


def with_gpu_memory(cm: Any, gpu_memory: int) -> Any:
    """A compiled model like ``cm`` (the same model and options, plans of its own) that plans for
    ``gpu_memory`` bytes per GPU; a model compiled from a plan file plans afresh for its GPU count."""
    req = cm.request
    if req is None:
        made = Plan.load(cm.plan_path)
        budget = cm.planner.budget
        req = PlanRequest(gpus=int(made.config["gpus"]), micro_batches=1, replicas=1, dp=1, time_limit=budget[0],
                          milp=budget[1], mip_gap=cm.planner.mip_gap)
    return type(cm)(cm.model, request=dataclasses.replace(req, gpu_memory=gpu_memory), plan_path=None,
                    options=cm.options, planner=cm.planner)


class WindowGuard:
    """Checks the first measured windows of each window plan against the cap; re-plans once."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.runner: Any = None  # the window runner whose plan is watched
        self.seen = 0
        self.gpu_memory: int | None = None  # what every later plan is made for, once re-planned
        self.budget: int | None = None
        self.notes: list[str] = []  # the re-plan's line

    def watching(self, runner: Any) -> bool:
        """Whether the next window of ``runner`` is checked (a new runner's plan is watched anew)."""
        if runner is not self.runner:
            self.runner, self.seen = runner, 0
        return self.seen < WATCH_WINDOWS

    def check(self, runner: Any, peak: int, window: int, next_x: Any) -> bool:
        """After window ``window`` (1-based, over the whole prediction) ran with this rank's ``peak``
        bytes: re-plan ``runner`` with ``next_x``, the next window, when a rank was above its cap
        (collective); whether it did."""
        plan = runner.plan
        cap, over = over_cap(plan, peak, self.rank, self.world)
        self.seen = WATCH_WINDOWS if cap is None else self.seen + 1
        if cap is None or not over:
            return False
        worst = min(over, key=lambda u: max(u.planned, 1) / max(u.measured, 1))
        said = (f"rank {worst.rank} used {format_bytes(worst.measured)} in window {window}, above its cap of "
                f"{format_bytes(cap)} (planned {format_bytes(worst.planned)})"
                + "".join(f", as did rank {u.rank}" for u in over if u is not worst))
        if self.budget is not None:
            raise NowdlError(stop_text(said, self.budget).replace("the job stops", "the prediction stops"))
        budget = charged_budget(cap, over)
        self.gpu_memory = budget + int(sum((plan.config.get("reserve") or {}).values()))
        try:
            runner.replan(self.gpu_memory, next_x)
        except NowdlError as e:
            raise NowdlError(f"{said}: no window plan fits {format_bytes(budget)} per rank, the cap charged for what "
                             f"was measured (the cap x planned/measured) [{str(e).split('. ')[0]}]: the prediction "
                             f"stops (exit status 2). {advice()}") from None
        self.budget, self.runner, self.seen = budget, runner, 0
        line = replanned_line(said, budget, runner.plan, f"went on from window {window + 1}")
        log.info("%s", line)
        self.notes.append(line)
        return True
