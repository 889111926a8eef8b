"""What the phases of one ``nowdl run`` share (:class:`Job`), and how it compiles a plan."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from nowdl.cli import validation
from nowdl.cli.losses import make_loss
from nowdl.cli.runrecord import Charge
from nowdl.cli.runspec import RunSource
from nowdl.runtime.data.feed import label_loss
from nowdl.runtime.training.checkpoint import Checkpoint

__all__ = ["Job", "compile_job"]


@dataclass
class Job:
    """What the phases of one ``nowdl run`` share: the options, this rank, the source and batch."""

    args: argparse.Namespace
    rank: int
    world: int
    tmp: Path
    src: RunSource
    batch: int  # samples per step (global)
    micro_batch: int  # samples per micro-batch when rank 0 plans
    ckpt: Path | None  # --checkpoint DIR
    ck: Checkpoint | None  # the checkpoint found there
    ckpt_plan: Path | None  # the checkpoint's plan, when this job can run it as is
    start: int  # steps done before this run
    total: int  # the step this run ends at (runguard.run_end)
    val: validation.ValidationSet | None = None  # --val-data
    charge: Charge | None = None  # a restart after an out-of-memory re-plans with it (runrecord.py)

    @property
    def say(self) -> bool:
        return self.rank == 0

    @property
    def training(self) -> bool:
        """Training with a checkpoint folder: saves at the end and every ``--save-every`` steps."""
        return self.ckpt is not None and not self.args.eval


def compile_job(job: Job, model: nn.Module, plan_path: str, optimizer: Any, compile_params: Any, progress: bool) -> Any:
    """``nowdl.compile`` of ``model`` on the plan at ``plan_path`` with the run's optimizer and loss
    (``compile_params``: ``nowdl.compile``'s parameters)."""
    import nowdl

    args = job.args
    extra: dict[str, Any] = {"precision": args.precision} if "precision" in compile_params else {}
    cm = nowdl.compile(model, plan=plan_path, optimizer=optimizer, loss_fn=label_loss(make_loss(args.loss, args.loss_args)),
                       progress=progress, timeout_s=args.timeout, **extra)
    cm.skip_nonfinite = bool(getattr(args, "skip_nonfinite", False))
    return cm
