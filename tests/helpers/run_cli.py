"""`nowdl run` in a test: a free local port, gloo ranks (forked by --nproc, or under torchrun), the losses it prints."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "STEP", "free_port", "run_ranks", "run_under_torchrun", "step_losses"]

ROOT = Path(__file__).resolve().parents[2]
#: one step line of `nowdl run` (groups: step, steps, loss)
STEP = re.compile(r"^step (\d+)/(\d+)  loss (\d+\.\d{4})  \d+\.\d\d s  [\d.]+ images/s$", re.M)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_under_torchrun(*args: str, n: int = 2) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node n -m nowdl run ARGS`` on gloo, from the repository root."""
    return run_ranks(*args, n=n, launcher="torchrun")


def run_ranks(*args: str, n: int = 2, launcher: str = "nproc") -> subprocess.CompletedProcess[str]:
    """``nowdl run ARGS`` on ``n`` gloo ranks: forked by ``--nproc n`` (one import of torch, the quicker
    launch), or under ``torchrun`` (``launcher="torchrun"``); from the repository root."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(NOWDL_BACKEND="gloo", OMP_NUM_THREADS="1")
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "nowdl", "run", *args]
    else:
        cmd = [sys.executable, "-m", "nowdl", "run", "--nproc", str(n), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def step_losses(out: str) -> dict[int, str]:
    """The loss each step line of ``out`` prints, by step."""
    return {int(m.group(1)): m.group(3) for m in STEP.finditer(out)}
