"""Planning runs without Python's cyclic garbage collector.

[Note: planning without gc] Tracing (torch.export on fake tensors), the estimate-mode profile
and the search make and drop millions of small Python objects. Every so many allocations the
collector runs, and every few of those runs a full collection walks every object the process
holds, torch's own included: on the 2-core machine the wide MONAI graphs of bench_planner
Table 3 planned (K = 4, median of four, alternating in one process) in 3.04 s with the
collector and 2.79 s without it (SwinUNETR), 2.82 s against 2.47 s (UNETR). ``plan()`` in
estimate mode pauses automatic collection and resumes it when it returns: what it leaves in
reference cycles (graphs, fake tensors: no device memory) is collected afterwards as usual.
Measure mode does not pause it (its profile holds real tensors).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]


@contextmanager
def gc_paused(enabled: bool = True) -> Iterator[None]:
    """Pause automatic garbage collection for the block (``enabled=False``: leave it alone);
    it resumes afterwards only if it was on before."""
    was_on = enabled and gc.isenabled()
    if was_on:
        gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
