"""The default process group's end: destroyed at interpreter exit if the program did not.

A process that exits with a gloo process group still alive can abort in interpreter
finalization ("terminate called without an active exception", SIGABRT): gloo's worker threads
still hold work whose tensors need the GIL (pytorch/pytorch#190489; its fix, an atexit hook in
``init_process_group``, was not merged). nowdl's workers used to exit that way after their last
``train_step``; in one of five full test runs (2026-11-25) a rank of the two-node torchrun test
ended with SIGABRT that way.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

__all__ = ["destroy_at_exit"]

_REGISTERED = [False]


def _destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer may be gone already; exiting matters more
            pass


def destroy_at_exit() -> None:
    """Destroy the default process group at exit, if it is still alive then (once per process;
    a program that destroys it itself is not affected)."""
    if not _REGISTERED[0]:
        atexit.register(_destroy)
        _REGISTERED[0] = True
