"""``nowdl run``'s checks before the first step, and where a restarted job ends.

* :func:`check_outputs`: every folder the run writes to (``--checkpoint`` on every rank, since
  each rank writes its shards there; ``--log-dir`` on rank 0, which writes the metrics) gets a
  file written and removed before anything is planned (in the folder, or in the nearest folder
  above it that exists: nothing is created), so a folder that cannot be written is refused in
  one paragraph at once, not after the steps have trained.
* :func:`run_end`: under ``torchrun --max-restarts`` or a Slurm requeue ([Note: restarts] in
  runtime/launch/attempt.py) the same command starts again and resumes from the checkpoint; it
  must finish the run it restarts (end at the step the first attempt aimed for), not run
  ``--steps`` more.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nowdl.errors import NonFiniteError, NowdlError
from nowdl.runtime.launch.attempt import restart_count

__all__ = ["check_outputs", "run_end", "checked_step"]


def _writable(folder: Path, option: str) -> None:
    """Write and remove a file in ``folder``, or in the nearest folder above it that exists (so
    that a run that fails later leaves nothing behind)."""
    try:
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"{folder} is a file")
        here = folder
        while not here.exists() and here != here.parent:
            here = here.parent
        if not here.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        probe = here / f".nowdl-write-test-{socket.gethostname()}-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or str(e)
        raise NowdlError(f"{option} {folder} cannot be written ({reason}): nothing was trained; pass a folder this "
                         f"job can write to (on every node for --checkpoint), or fix its permissions") from None


def check_outputs(args: argparse.Namespace, rank: int) -> None:
    """Refuse, before the first step, an output folder this rank cannot write (see the module doc)."""
    if getattr(args, "checkpoint", None) and not getattr(args, "eval", False):
        _writable(Path(args.checkpoint), "--checkpoint")
    log_dir = getattr(args, "log_dir", None)
    if log_dir is not None and rank == 0:
        _writable(Path(log_dir), "--log-dir")
        metrics = Path(log_dir) / "metrics.jsonl"
        if metrics.exists() and (metrics.is_dir() or not os.access(metrics, os.W_OK)):
            raise NowdlError(f"--log-dir {log_dir}: {metrics} exists and cannot be written: remove it or pass another "
                             "--log-dir")


def run_end(saved_run: dict[str, Any] | None, start: int, steps: int) -> int:
    """The step this run ends at: ``steps`` (``--steps`` is the run's total, a resume included),
    except in a restarted attempt of a job whose checkpoint records the step its run aims for
    (``total``): then that step."""
    total = (saved_run or {}).get("total")
    if restart_count() > 0 and isinstance(total, int) and total >= start:
        return total
    return steps


def checked_step(cm: Any, run_step: Callable[[], Any], meter: Any, feed: Any, step: int, x: Any, evaluating: bool
                 ) -> tuple[Any, int, str]:
    """Run one step (through ``meter`` when metrics are kept): its result, the peak bytes, and the
    step line's note when the step was skipped for a non-finite loss or gradient. A step that stops
    for one says which samples of the batch hold NaN ([Note: non-finite steps])."""
    before = 0 if evaluating else cm.skipped_steps
    try:
        result, peak = meter.run(run_step) if meter is not None else (run_step(), 0)
    except NonFiniteError as e:
        raise NonFiniteError(f"{e}{feed.nonfinite_samples(step, x)}") from None
    skipped = not evaluating and cm.skipped_steps != before
    return result, peak, f"  skipped: not finite ({cm.skipped_steps} so far)" if skipped else ""
