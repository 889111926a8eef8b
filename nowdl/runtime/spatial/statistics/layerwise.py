"""Norms on sequential tiles, layer-wise: each sub-tile's pass boundaries kept in host memory.

[Note: layer-wise norms] The statistics passes ([Note: sequential norms]) re-run every sub-tile
from the stage's input up to each level's norms: a stage whose norms sit K deep runs K prefix
forwards. The *layer-wise* schedule (``StagePlan.norm_schedule == "layerwise"``) runs each node
of the forward once instead: a node is *valid* after the first forward pass that computes it
with every norm it reads already normalised (pass k computes the nodes the level-k norms read;
the level-k norms themselves only hand their input to the statistics then), and pass k+1 (or the
pass that keeps the outputs) starts from what the earlier passes left: the values of valid nodes
that a later pass reads, over each sub-tile's window, kept in host memory (pinned on CUDA; a
copy on CPU) from the pass that computes them until the last pass that reads them. The stage's
inputs and parameters are never cached (the input window stays on the device in either
schedule). Every kept value is the one the statistics passes recompute, by the same ops on the
same window, so both schedules give the same bits. The forward then costs one stage forward plus
the host copies (the planner: [Note: layer-wise norms cost] in
``partitioner/costs/seqnorms/schedule.py``). In training the forward also keeps the values the
layer-wise backward starts its segments from ([Note: layer-wise backward] in ``layerwise_bwd``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from nowdl.errors import NowdlError
from nowdl.runtime.spatial.statistics.seq_norms import NormLevels, NormPasses, NormRun

__all__ = ["LayerPlan", "layer_plan", "HostCache", "host_cache", "release", "CachedRun"]

_FREE = ("placeholder", "get_attr")  # the stage's window inputs and its parameters: never cached


@dataclass(frozen=True)
class LayerPlan:
    """What each forward pass of the layer-wise schedule computes, reads and keeps.

    Passes are 1..K (statistics) and K+1 (the pass that keeps the outputs); ``first[v]``: the pass
    after which node ``v`` is valid; ``compute[k]``: the nodes pass k runs (the free nodes it needs
    too); ``store[k]``: the nodes pass k copies to host memory; ``keep[k]``: the cached nodes still
    held after pass k.
    """

    passes: int
    first: dict[str, int]
    compute: dict[int, frozenset[str]]
    store: dict[int, frozenset[str]]
    keep: dict[int, frozenset[str]]
    # the backward ([Note: layer-wise norms]): per node its backward level (the most norms on a
    # path from it to the outputs), per level j its *segment* (the nodes of level j), the nodes
    # of the segment the level-j norms read, and the nodes whose forward values the backward reads
    # from host memory (those with a user of a lower level)
    back: dict[str, int]
    segment: dict[int, frozenset[str]]
    sums: dict[int, frozenset[str]]
    boundary: frozenset[str]


def layer_plan(gm: fx.GraphModule, levels: NormLevels) -> LayerPlan:
    """The :class:`LayerPlan` of ``gm`` with norm levels ``levels`` ([Note: layer-wise norms])."""
    nodes = list(gm.graph.nodes)
    kf = levels.passes[0]
    free = {n.name for n in nodes if n.op in _FREE}
    first: dict[str, int] = {}
    for k in range(1, kf + 1):
        for v in levels.needed.get(k, frozenset()):
            if v not in first and levels.fwd.get(v) != k and v not in free:
                first[v] = k
    for n in nodes:
        first.setdefault(n.name, kf + 1)
    compute: dict[int, frozenset[str]] = {}
    for k in range(1, kf + 2):
        want = levels.needed.get(k, frozenset()) if k <= kf else frozenset(n.name for n in nodes)
        compute[k] = frozenset(v for v in want if v in free or first[v] >= k)
    last = {n.name: max((first[u.name] for u in n.users), default=0) for n in nodes}  # the last pass that reads it
    store = {k: frozenset(n.name for n in nodes if n.name not in free and first[n.name] == k and last[n.name] > k)
             for k in range(1, kf + 1)}
    keep = {k: frozenset(n.name for n in nodes if n.name not in free and first[n.name] <= k < last[n.name])
            for k in range(1, kf + 1)}
    active = set(levels.fwd)
    back: dict[str, int] = {}
    for n in reversed(nodes):
        back[n.name] = max((back[u.name] for u in n.users), default=0) + (n.name in active)
    kb = max((back[v] for v in active), default=0)
    segment = {j: frozenset(n.name for n in nodes if back[n.name] == j and n.name not in free) for j in range(kb + 1)}
    by_name = {n.name: n for n in nodes}
    sums: dict[int, frozenset[str]] = {}
    for j in range(1, kb + 1):
        seen: set[str] = set()
        todo = [v for v in active if back[v] == j]
        while todo:
            v = todo.pop()
            if v not in seen and v in segment[j]:
                seen.add(v)
                todo.extend(a.name for a in by_name[v].all_input_nodes)
        sums[j] = frozenset(seen)
    boundary = frozenset(n.name for n in nodes if n.name not in free
                         and any(back[u.name] < back[n.name] for u in n.users))
    return LayerPlan(kf, first, compute, store, keep, back, segment, sums, boundary)


class HostCache:
    """Per sub-tile, the kept node values in host memory (pinned when the device is CUDA), for the
    layer-wise schedule ``plan``."""

    def __init__(self, device: torch.device, subs: int, plan: LayerPlan, backward: bool = False,
                 meter: list[int] | None = None) -> None:
        self.device, self.plan = device, plan
        self.values: list[dict[str, Tensor]] = [{} for _ in range(subs)]
        self.meter = meter if meter is not None else [0, 0]  # bytes kept now and at most, shared by the caches
        # the boundary values the backward starts from, kept from the forward
        self.bwd = HostCache(device, subs, plan, meter=self.meter) if backward else None

    def _count(self, nbytes: int) -> None:
        self.meter[0] += nbytes
        self.meter[1] = max(self.meter[1], self.meter[0])

    def release(self) -> None:
        """Drop every kept value."""
        self.keep_only(frozenset())

    def put(self, sub: int, node: str, t: Tensor) -> None:
        if not isinstance(t, Tensor):
            raise NowdlError(f"node {node!r} gives a {type(t).__name__}, which the layer-wise norm schedule cannot keep "
                             "in host memory: plan with PlannerOptions(norm_schedule='passes')")
        if self.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)  # stream-ordered before any copy back
        else:
            host = t.detach().clone()  # a later in-place op must not reach the kept value
        old = self.values[sub].get(node)
        self._count(_nbytes(host) - (_nbytes(old) if old is not None else 0))
        self.values[sub][node] = host

    def add(self, sub: int, node: str, t: Tensor) -> None:
        """Add ``t`` to the kept value (a gradient from one more segment), or keep it."""
        if node in self.values[sub]:
            t = self.get(sub, node).add_(t)
        self.put(sub, node, t)

    def get(self, sub: int, node: str) -> Tensor:
        t = self.values[sub][node]
        if self.device.type == "cuda":
            return t.to(self.device, non_blocking=True)
        return t.clone()

    def keep_only(self, nodes: frozenset[str]) -> None:
        """Drop the values no later pass reads."""
        for vals in self.values:
            for name in [n for n in vals if n not in nodes]:
                self._count(-_nbytes(vals.pop(name)))


def release(cache: HostCache | None) -> None:
    """Drop the forward's own kept values of ``cache`` (None: nothing to drop)."""
    if cache is not None:
        cache.release()


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def host_cache(gm: fx.GraphModule, passes: NormPasses | None, schedule: str, device: torch.device, subs: int,
               backward: bool, meter: list[int] | None = None) -> HostCache | None:
    """The host cache of a micro-batch's layer-wise forward (keeping what the layer-wise backward
    reads too when ``backward``); None unless ``schedule`` is "layerwise" and some norm takes the
    image's statistics."""
    if passes is None or schedule != "layerwise":
        return None
    return HostCache(device, subs, layer_plan(gm, passes.levels), backward, meter)


class CachedRun(NormRun):
    """:class:`NormRun` for pass k of the layer-wise schedule (``passes.level`` in a statistics pass,
    else the last): runs ``compute[k]``, takes the earlier passes' nodes from ``cache`` and keeps
    ``store[k]`` there."""

    def __init__(self, gm: fx.GraphModule, passes: NormPasses, sub: int, cache: HostCache) -> None:
        super().__init__(gm, passes, sub)
        self.needed = None  # what runs is ``compute[k]``
        self.plan, self.cache, self.keep = cache.plan, cache, cache.bwd
        self.k = passes.level if passes.mode == "fwd" else cache.plan.passes + 1

    def run_node(self, n: fx.Node) -> Any:
        if n.op != "placeholder" and n.name not in self.plan.compute[self.k]:  # placeholders: the arguments, in order
            if self.plan.first[n.name] < self.k and any(u.name in self.plan.compute[self.k] for u in n.users):
                return self.cache.get(self.sub, n.name)
            return None
        out = super().run_node(n)
        if n.name in self.plan.store.get(self.k, frozenset()):
            self.cache.put(self.sub, n.name, out)
        if self.keep is not None and n.name in self.plan.boundary and self.plan.first[n.name] == self.k:
            self.keep.put(self.sub, n.name, out)  # valid now: the value the backward starts from
        return out

