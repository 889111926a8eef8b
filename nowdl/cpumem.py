"""CPU ranks keep the memory they free, as CUDA's caching allocator does.

[Note: CPU freed memory] glibc's malloc hands blocks above its mmap threshold (128 KiB, raised
as blocks are freed) straight back to the kernel when they are freed, and trims the heap's
free top. A training step frees every activation in its backward and allocates them again in
the next forward, so on CPU each of them comes back as fresh pages, and touching them costs a
page fault per 4 KiB: measured on this project's 2-core machine (one thread), a whole ResNet-20
forward at 128² took 26-29 ms against 22.2 ms for the sum of its nodes measured one by one (the
profiler reruns a node into memory it just freed), its backward 36-40 ms against 33-35 ms.
With the pages kept (no mmap for heap blocks, no trimming below 2 GiB) the forward is 23 ms:
the step is faster. Measure mode applies the same setting before it times nodes on the CPU
(``nowdl.profiler.profile``), so the profile sees the allocator the runtime will run under
(``bench_runtime.py --quick``, which plans in its parent, two runs each: the predicted stage
forwards were 10.1-12.5 ms before, 9.8-10.2 ms after, against 8.9-10.5 ms measured in both).
CUDA needs none of this (its
caching allocator keeps blocks); the process's resident memory then stays at its peak, as a
GPU's reserved memory does.

:func:`keep_freed_memory` sets that once per process where the C library is glibc;
``NOWDL_CPU_KEEP_FREED=0`` leaves malloc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["keep_freed_memory", "ENV"]

ENV = "NOWDL_CPU_KEEP_FREED"
"""Set to ``0`` to leave the C library's malloc settings as they are."""

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_TRIM_BYTES = 2**31 - 1  # mallopt takes an int: the heap's free top is kept up to 2 GiB

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed blocks for reuse (no mmap'd heap blocks, no trimming).

    Returns whether the setting is in force in this process (False off Linux/glibc, when
    ``NOWDL_CPU_KEEP_FREED=0``, or when ``mallopt`` refused). Safe to call more than once.
    """
    global _done
    if _done is None:
        _done = _apply()
    return _done


def _apply() -> bool:
    if os.environ.get(ENV, "1").strip() == "0" or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES))
