"""Test helper (not a test module): run a function on N local CPU processes, as torchrun would.

``run_workers(fn, world_size, *args)`` starts ``world_size`` processes (``forkserver`` start
method: a server process imports torch, nowdl and MONAI once, and each worker is forked from it,
so a test does not pay for those imports in every rank; no CUDA is touched before the fork),
gives each the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT, plus NOWDL_BACKEND=gloo), calls ``fn(rank, world_size, *args)`` in each and
returns the ranks' return values in rank order.

The rendezvous store is hosted by the parent (like torchrun's agent store, via
TORCHELASTIC_USE_AGENT_STORE), so there is no free-port race between picking a port and a
worker binding it. By default the worker joins the gloo group itself before calling ``fn``;
with ``init_group=False``, ``fn`` must call ``nowdl.runtime.launch.group.init_distributed()``
(or ``dist.init_process_group``) itself. Either way the group is destroyed afterwards.

A rank that raises, exits without returning, or is still running at ``timeout_s`` makes
``run_workers`` raise :class:`WorkerError` (with every rank's traceback or exit code, the
unfinished ranks, and the values the other ranks did return); all children are always
joined or killed, so a failing test neither hangs nor leaves processes behind.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_workers", "WorkerError"]


class WorkerError(AssertionError):
    """One or more worker ranks failed, died, or did not finish in time."""

    def __init__(
        self,
        message: str,
        *,
        failures: dict[int, str],
        unfinished: list[int],
        results: dict[int, Any],
    ) -> None:
        super().__init__(message)
        self.failures = failures  # rank -> formatted traceback or exit description
        self.unfinished = unfinished  # ranks killed at the deadline
        self.results = results  # rank -> value, for the ranks that did return


def _worker(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    init_group: bool,
    timeout_s: float,
    results: Any,
) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0")
    if "OMP_NUM_THREADS" in env:  # torch was imported by the fork server, before this variable
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        if init_group:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
            )
        value = fn(rank, world_size, *args)
        message: tuple[str, int, bytes | str] = ("ok", rank, pickle.dumps(value))
    except BaseException:  # report everything, SystemExit included
        message = ("error", rank, traceback.format_exc())
    finally:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer may be gone; the result below matters more
                pass
    results.put(message)
    results.close()
    results.join_thread()


#: imported once by the fork server (what almost every worker needs)
_PRELOAD = ["torch", "torch.distributed", "monai.networks.nets", "nowdl", "nowdl.compiled", "nowdl.trace.tracer",
            "nowdl.profiler.profile_graph", "nowdl.partitioner.search.best_plan",
            "nowdl.runtime.training.trainer", "nowdl.runtime.pipeline.engine", "nowdl.runtime.spatial"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (first use)
    return ctx


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5.0)


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120,
    env: Mapping[str, str] | None = None,
    init_group: bool = True,
    grace_s: float = 10.0,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their values.

    ``fn`` must be a module-level (picklable) function and its return values picklable.
    ``env`` adds or overrides environment variables in the workers. After the first rank
    fails, the others get ``grace_s`` seconds to finish (so that their errors are reported
    too) before they are killed. ``start_method="spawn"`` starts each worker afresh, writing to
    this process's current stderr (the fork server's workers write to the stderr the server
    started with, which pytest's ``capfd`` does not see).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = _context() if start_method == "forkserver" else mp.get_context(start_method)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    # what spawn would give the worker: this process's environment now (the fork server's is
    # the one it started with), then torchrun's variables
    worker_env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "NOWDL_BACKEND": "gloo",
        "OMP_NUM_THREADS": "1",
    }
    worker_env.update(env or {})
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, fn, args, worker_env, init_group, timeout_s, results),
            name=f"nowdl-test-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    reported: set[int] = set()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(reported) < world_size and time.monotonic() < deadline:
            try:
                kind, rank, payload = results.get(timeout=0.05)
            except queue.Empty:
                # A rank that died without reporting (os._exit, signal, segfault).
                for rank, p in enumerate(procs):
                    if rank not in reported and p.exitcode is not None:
                        # Give its queued message a moment to arrive before declaring it dead.
                        try:
                            kind, r, payload = results.get(timeout=0.2)
                        except queue.Empty:
                            failures[rank] = f"exited with code {p.exitcode} without returning"
                            reported.add(rank)
                        else:
                            _record(kind, r, payload, values, failures, reported)
                        break
            else:
                _record(kind, rank, payload, values, failures, reported)
            if failures:
                deadline = min(deadline, time.monotonic() + grace_s)
    finally:
        _stop(procs)
        results.close()
        results.cancel_join_thread()
        del store
    unfinished = [r for r in range(world_size) if r not in reported]
    if failures or unfinished:
        parts = []
        for rank in sorted(failures):
            parts.append(f"--- rank {rank} failed: ---\n{failures[rank].rstrip()}")
        if unfinished:
            why = "after another rank failed" if failures else f"within timeout_s={timeout_s:g}"
            parts.append(f"--- ranks {unfinished} had not finished {why}; killed ---")
        head = f"{len(failures)} of {world_size} ranks failed {sorted(failures)}"
        if unfinished:
            head += f", {len(unfinished)} did not finish {unfinished}"
        raise WorkerError(
            head + "\n" + "\n".join(parts),
            failures=failures,
            unfinished=unfinished,
            results=values,
        )
    return [values[r] for r in range(world_size)]


def _record(
    kind: str,
    rank: int,
    payload: bytes | str,
    values: dict[int, Any],
    failures: dict[int, str],
    reported: set[int],
) -> None:
    reported.add(rank)
    if kind == "ok":
        assert isinstance(payload, bytes)
        values[rank] = pickle.loads(payload)
    else:
        failures[rank] = str(payload)
