"""Measure mode: per-node forward times scaled so that they add up to one whole forward.

[Note: whole-pass scale] Measure mode times each node alone, several times in a row on the same
inputs: its inputs and weights are hot in the caches, its output lands in memory just freed, and
nothing runs between the repeats. A stage runs its nodes one after another on fresh data, and on
this project's 2-core CPU a whole forward took 1.14-1.28x (ResNet-20 at 128², 73 nodes) and
1.27-1.43x (MONAI UNet at 128², width 8, 56 nodes) the sum of its nodes' forwards (six profiles
each).
After the per-node pass, :func:`whole_pass` runs the whole graph forward and backward
(a few runs, on the nodes' clock and summarised as they are: [Note: thread clock minimum]) and :func:`scale_times` multiplies every node's ``fwd_s`` by whole
forward / sum of node forwards, so a stage's predicted forward is the nodes' share of a real
pass. The backward is left as timed node by node: a stage's backward, one autograd call, measured
at or above its nodes' sum (UNet K = 4 stages 1.5-1.6 ms against 1.6-1.7), while the whole
model's single backward came out below it (0.92-0.96x for the UNet), so scaling by the whole pass
would under-predict the stages. The factors (forward, backward = 1) are kept in
``Profile.time_scale``. The whole pass holds
every activation at once, so it runs only when that fits in half the free memory (CUDA:
``mem_get_info``; CPU: available physical memory); otherwise the times stay per node (factors 1).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from nowdl.profiler.cost import NodeCost

log = logging.getLogger(__name__)

__all__ = ["whole_pass", "scale_times", "free_bytes", "SCALE_BOUNDS", "WHOLE_RUNS"]

WHOLE_RUNS = 3
"""Timed whole passes (after one warm-up): the per-node pass runs each node 7 times by default, so
this adds about half of its time."""

SCALE_BOUNDS = (1 / 3, 3.0)
"""A factor outside these is taken as a measurement gone wrong (a burst of load): not applied."""


def free_bytes(device: torch.device) -> int:
    """Memory a whole pass may use on ``device``: CUDA's free memory, else available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not POSIX: do not risk it
        return 0


def whole_pass(model: torch.nn.Module, inputs: tuple[Any, ...], device: torch.device, costs: Sequence[NodeCost],
               autocast: torch.dtype | None = None) -> tuple[float, float] | None:
    """Seconds of one whole forward and one whole backward of ``model`` on ``inputs``
    (:data:`WHOLE_RUNS` timed runs after one warm-up), on the clock the nodes were timed on and
    summarised as they were: on CPU with one intra-op thread the thread CPU time, least of the
    runs ([Note: thread clock minimum] in measure.py: timed by the wall clock, median, the forward
    scale of the UNet of bench_recompute_planned at 128² came out 2.3-2.8x in five profiles on this
    loaded machine, the whole forward charged the time other jobs held the core; on the thread
    clock 1.2-1.4x, as the Note above), else the wall clock (CUDA: after a synchronize), median.

    None when the pass would hold more than half of :func:`free_bytes` (activations, outputs and
    the largest workspace of ``costs``) or when the model's outputs need no gradient.
    """
    need = sum(n.act_bytes + n.out_bytes for n in costs) + max((n.workspace_bytes for n in costs), default=0)
    if 2 * need > free_bytes(device):
        log.info("whole-pass scale skipped: the pass needs about %d bytes, more than half of the free memory", need)
        return None
    xs = tuple(t.detach().to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
    cuda = device.type == "cuda"
    thread = not cuda and torch.get_num_threads() == 1  # the nodes' clock ([Note: thread clock minimum])
    clock = time.thread_time if thread else time.perf_counter
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(1 + WHOLE_RUNS):  # one warm-up
        if cuda:
            torch.cuda.synchronize(device)
        t0 = clock()
        with torch.autocast(device_type=device.type, dtype=autocast, enabled=autocast is not None):
            out = model(*xs)
        if cuda:
            torch.cuda.synchronize(device)
        t1 = clock()
        roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not roots:
            return None
        grads = [torch.ones_like(t) for t in roots]
        if cuda:
            torch.cuda.synchronize(device)
        t2 = clock()
        torch.autograd.backward(roots, grads)
        if cuda:
            torch.cuda.synchronize(device)
        t3 = clock()
        del out, roots, grads
        for p in model.parameters():
            p.grad = None
        if i >= 1:
            fwd.append(t1 - t0)
            bwd.append(t3 - t2)
    if thread:
        return min(fwd), min(bwd)
    return statistics.median(fwd), statistics.median(bwd)


def scale_times(costs: Sequence[NodeCost], whole_fwd: float, whole_bwd: float | None = None
                ) -> tuple[list[NodeCost], tuple[float, float]]:
    """``costs`` with ``fwd_s`` (and ``bwd_s`` when ``whole_bwd`` is given) scaled to add up to
    the whole pass, and the two factors (1.0 where not scaled, a sum is zero or a factor falls
    outside :data:`SCALE_BOUNDS`).

    >>> c, f = scale_times([NodeCost("a", "call_module", "m", fwd_s=1.0, bwd_s=2.0),
    ...                     NodeCost("b", "call_module", "m", fwd_s=3.0, bwd_s=2.0)], 6.0, 2.0)
    >>> [(n.fwd_s, n.bwd_s) for n in c], f
    ([(1.5, 1.0), (4.5, 1.0)], (1.5, 0.5))
    """
    lo, hi = SCALE_BOUNDS

    def factor(whole: float, parts: float) -> float:
        q = whole / parts if parts > 0 else 1.0
        return q if lo <= q <= hi else 1.0

    f = factor(whole_fwd, sum(n.fwd_s for n in costs))
    b = 1.0 if whole_bwd is None else factor(whole_bwd, sum(n.bwd_s for n in costs))
    return [dataclasses.replace(n, fwd_s=n.fwd_s * f, bwd_s=n.bwd_s * b) for n in costs], (f, b)
