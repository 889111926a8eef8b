"""Stopping ``nowdl run`` on a signal, and what a checkpoint says about resuming it.

``--steps`` is the run's total: a run stopped at step 80 of ``--steps 400`` and started again
with the same command trains steps 81..400 (the stop message gives that command), and one
whose checkpoint already holds ``--steps`` steps has nothing left to train.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from nowdl.cli.runspec import pin_conflicts
from nowdl.runtime.launch import comm
from nowdl.runtime.training.checkpoint import Checkpoint, CheckpointError

__all__ = ["StopSignal", "SAME_STOP_S", "run_state", "reusable_plan", "finished_text", "check_normalize"]

#: Seconds within which a second SIGINT/SIGTERM counts as the first one delivered again.
SAME_STOP_S = 1.0


class StopSignal:
    """SIGTERM/SIGINT ask the run to stop after the current step (a second one stops at once).

    A second signal within :data:`SAME_STOP_S` of the first is the same request delivered twice
    and is ignored: Ctrl-C reaches every process of the terminal's group and torchrun forwards
    it to its workers as well, as Slurm's and torchrun's SIGTERM do."""

    def __init__(self) -> None:
        self.signum = 0
        self._at = 0.0
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._at = signum, now
            return
        if now - self._at < SAME_STOP_S:
            return
        self.__exit__()  # a later signal acts as it did before: stop at once
        signal.raise_signal(signum)

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def agreed(self, world: int) -> int:
        """The signal any rank got (0: none); every rank gets the same answer."""
        if world == 1:
            return self.signum
        t = torch.tensor([self.signum], dtype=torch.int64)
        comm.all_reduce(t, dist.ReduceOp.MAX)  # a host tensor: staged through the GPU on NCCL
        return int(t.item())


def run_state(ck: Checkpoint, args: argparse.Namespace) -> dict[str, Any]:
    """The ``nowdl run`` state of a checkpoint, checked against this run's model."""
    run = ck.record.get("run")
    if not isinstance(run, dict) or not isinstance(run.get("batch_size"), int):
        raise CheckpointError(f"{ck.dir} was not saved by `nowdl run` (no run state in nowdl.json): load it with "
                              "CompiledModel.load_checkpoint, or use another --checkpoint folder")
    spec = str(args.model)
    if not spec.lower().endswith(".json") and run.get("model") != spec:
        raise CheckpointError(f"--checkpoint {ck.dir.parent} holds a run of {run.get('model')!r}, not {spec!r}: "
                              "use another folder for this model")
    return run


def check_normalize(ck: Checkpoint, normalize: Any) -> None:
    """Refuse to resume with another per-band normalisation than the checkpoint's run trained with
    (``normalize``: this run's ``Normalize`` or None)."""
    from nowdl.runtime.data.pixels import Normalize

    run = ck.record.get("run")
    saved = run.get("normalize") if isinstance(run, dict) else None
    before = None if saved is None else Normalize.from_json(saved, f"--checkpoint {ck.dir.parent}")
    now = None if normalize is None else Normalize(tuple(normalize.mean), tuple(normalize.std))
    old, new = (None if n is None else n.mean + n.std for n in (before, now))
    close = old is not None and new is not None and len(old) == len(new) and all(
        abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(old, new, strict=True))  # printed values: 6 digits
    if (before is None) != (now is None) or (before is not None and not close):
        def say(n: Any) -> str:
            return "none" if n is None else n.text()
        raise CheckpointError(f"--checkpoint {ck.dir.parent} trained with --normalize {say(before)} but this run "
                              f"has {say(now)}: resume with the same --normalize"
                              + (f" ({say(before)})" if before is not None else " (none: drop it)"))


def reusable_plan(ck: Checkpoint, args: argparse.Namespace, world: int) -> bool:
    """Whether the checkpoint's plan runs this job as asked (else the run re-plans and reshards)."""
    config = ck.record.get("plan", {}).get("config", {})
    return bool(config.get("gpus") == world and not pin_conflicts(args, config))


def finished_text(ckpt: Any, start: int, steps: int) -> str | None:
    """The line saying a resumed run has nothing left (its checkpoint is at or past ``--steps``),
    or None when steps remain."""
    if start < steps:
        return None
    return (f"nothing to train: {ckpt} is at step {start} and --steps {steps} is the run's total "
            f"(give --steps above {start} to train on)")
