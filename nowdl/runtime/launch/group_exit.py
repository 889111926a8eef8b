"""A rank's end: the default process group is destroyed before the interpreter ends, and a rank
of a launched job leaves without the interpreter's finalization.

Once finalization has begun, a daemon thread that comes back from a C++ call (a store wait
that timed out, gloo's work whose tensors need the GIL) ends the process with "terminate
called without an active exception" (SIGABRT): CPython stops such a thread by unwinding its
C++ frames, which C++ does not allow. Two guards:

* :func:`destroy_at_exit` destroys a group still alive at exit in an exit hook, before
  finalization, so gloo's worker threads hold no work then (pytorch/pytorch#179291 proposed the
  same hook inside ``init_process_group``; it was not merged);
* :func:`exit_rank` ends a ``nowdl`` rank the way the interpreter would up to finalization
  (non-daemon threads joined, exit hooks run, output flushed) and then exits with the status,
  as ``os._exit`` does, so no thread at all can come back into a finalizing interpreter.
  ``tests/runtime/launch/test_group_exit.py`` makes the crash happen with a store wait and no
  group, and shows :func:`exit_rank` avoids it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

import torch.distributed as dist

__all__ = ["destroy_at_exit", "exit_rank"]

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


def exit_rank(code: int) -> NoReturn:
    """End this process with ``code`` as the interpreter would, without its finalization.

    Call it from the main thread, where the program would return from ``main``: it waits for
    the non-daemon threads (as ``threading`` does at exit), runs the exit hooks (the process
    group destroyed, data loader workers stopped, temporary folders removed), flushes stdout
    and stderr, and exits."""
    shutdown = getattr(threading, "_shutdown", None)  # what Py_FinalizeEx calls first
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe or no file: nothing more to say
            stream.flush()
    os._exit(code)
