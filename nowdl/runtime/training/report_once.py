"""Errors of the Python API under a launcher: one paragraph for the job, not a traceback per rank.

[Note: API errors under a launcher] A script run by torchrun, srun or mpirun that calls
``nowdl.compile(...).train_step`` raises the same NowdlError on every rank when, say, the plan
was made for another model; Python would print its traceback once per rank. While such a job
runs, :func:`install` replaces the default ``sys.excepthook``: an uncaught NowdlError prints
``nowdl: error: <one paragraph>`` once for the job and the process exits with status 1 as
before. Which rank prints: the first to post the message on the rendezvous store (rank 0 posts
at once, the others after :data:`RANK0_FIRST_S`), so an error every rank hit is printed by rank
0 and one only some rank saw is printed by the first rank that saw it (prefixed with its rank).
Without a store (the ranks never connected) rank 0 prints and the others stay quiet: errors
raised before the ranks connect (options, plan files, the model) are the same on every rank.
Other exceptions, and every error when ``NOWDL_TRACEBACK=1`` is set, keep Python's traceback.
A hook the user installed is left alone.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from types import TracebackType

from nowdl.errors import NowdlError, ReportedError, error_text

__all__ = ["install", "should_print", "RANK0_FIRST_S"]

#: Seconds the ranks other than 0 wait before posting, so that rank 0 prints an error all hit.
RANK0_FIRST_S = 0.5
_KEY = "nowdl/api-error/"


def _rank_world() -> tuple[int, int]:
    """This process's rank and the job's size, as the launcher gave them (torchrun, srun, mpirun)."""
    from nowdl.runtime.launch.group import launch_env

    try:
        env = launch_env()
    except NowdlError:
        return 0, 1
    return env.rank, env.world_size


def should_print(message: str, rank: int, world: int) -> bool:
    """Whether this rank prints ``message``: the first rank to post it on the store (see the note)."""
    if world <= 1:
        return True
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return rank == 0
    try:
        store = dist.distributed_c10d._get_default_store()
        if rank != 0:
            time.sleep(RANK0_FIRST_S)
        key = _KEY + hashlib.sha1(message.encode()).hexdigest()[:16]
        return bytes(store.compare_set(key, "", str(rank))).decode() == str(rank)
    except Exception:  # the store's host is gone: say it here rather than not at all
        return True


def _hook(etype: type[BaseException], e: BaseException, tb: TracebackType | None) -> None:
    if not isinstance(e, NowdlError) or os.environ.get("NOWDL_TRACEBACK") == "1":
        sys.__excepthook__(etype, e, tb)
        return
    if isinstance(e, ReportedError):
        return
    rank, world = _rank_world()
    message = error_text(e)
    if should_print(message, rank, world):
        who = f"rank {rank}: " if rank else ""
        print(f"nowdl: error: {who}{message} (NOWDL_TRACEBACK=1 shows the traceback)", file=sys.stderr, flush=True)


def install() -> None:
    """Use the one-paragraph report for uncaught NowdlErrors in a launched job (WORLD_SIZE > 1),
    unless the user installed an excepthook of their own."""
    if sys.excepthook is sys.__excepthook__ and _rank_world()[1] > 1:
        sys.excepthook = _hook
