"""Test helper (not a test module): run a distributed worker with every exchange through host staging.

``staged_worker(fn)`` is ``fn`` (a ``run_workers`` worker) run with ``NOWDL_STAGE_HOST=1``: the CPU
tensors the runtime exchanges take the path CUDA tensors take on gloo (runtime/launch/comm.py). The
rank fails if nothing went through staging, so a call site that bypasses it shows up.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

__all__ = ["staged_worker"]


def staged_worker(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with host staging forced, failing the rank if no byte was staged (picklable)."""
    return functools.partial(_staged, fn)


def _staged(fn: Callable[..., Any], rank: int, world: int, *args: Any) -> Any:
    from nowdl.runtime.launch import comm

    os.environ[comm.STAGE_VAR] = "1"
    before = comm.staged_bytes()
    out = fn(rank, world, *args)
    if comm.staged_bytes() == before:
        raise AssertionError(f"rank {rank}: no byte went through host staging under {comm.STAGE_VAR}=1")
    return out
