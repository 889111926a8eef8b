"""How predict's ranks agree on writes: one error on any rank stops every rank, and window writes
that run on a background thread while the next window computes.

[Note: predict writes] Each rank writes its share of a window's core on one background thread
(:class:`Writes`) while the main thread runs the next window's forward. Before a window's writes
start, the previous window's writes have finished on every rank and the ranks have agreed that
they succeeded (:func:`agree`): cores that are not whole chunks share a chunk with the next
window, and zarr writes a partial chunk by reading, changing and rewriting it, so two windows'
writes must not overlap in time. A failed write (a full disk) raises the same error on every
rank at the next agreement.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from nowdl.errors import NowdlError

__all__ = ["rank_world", "agree", "write_error", "guard", "Writes"]


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agree(error: str | None) -> None:
    """Raise ``error`` on every rank if any rank has one (collective)."""
    _, world = rank_world()
    errors: list[Any] = [error]
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise NowdlError(first)


def write_error(e: OSError, what: str) -> str:
    """The one-paragraph message of a failed write (a full disk named as such)."""
    why = "the disk is full" if e.errno == errno.ENOSPC else f"{e.strerror or e}"
    return (f"writing {what} failed: {why} (errno {errno.errorcode.get(e.errno or 0, e.errno)}); nothing was "
            "written under the output name: free space (or fix the path) and run again")


def _outcome(fn: Callable[[], Any], what: str) -> str | None:
    try:
        fn()
    except OSError as e:
        return write_error(e, what)
    except NowdlError as e:
        return str(e)
    return None


def guard(fn: Callable[[], Any], what: str) -> None:
    """Run ``fn``; every rank agrees on success, or raises the first rank's error (collective)."""
    agree(_outcome(fn, what))


class Writes:
    """One window's writes at a time on a background thread ([Note: predict writes]).

    Every rank calls :meth:`submit` and :meth:`wait` in the same order (both are collective).
    """

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="nowdl-predict-write")
        self.pending: Future[str | None] | None = None

    def submit(self, fn: Callable[[], Any], what: str) -> None:
        """Wait for the previous writes on every rank, then start ``fn`` in the background."""
        self.wait()
        self.pending = self.pool.submit(_outcome, fn, what)

    def wait(self) -> None:
        """Finish the writes in flight; raise on every rank if any rank's failed (collective)."""
        pending, self.pending = self.pending, None
        agree(pending.result() if pending is not None else None)

    def close(self) -> None:
        """Let a write in flight finish (without agreeing: after an error) and stop the thread."""
        self.pool.shutdown(wait=True)
