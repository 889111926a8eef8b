"""How a stage of sequential tiles gathers its norms' statistics: passes or layer-wise, and what each costs.

[Note: layer-wise norms cost] A stage of sequential tiles whose norms take the image's
statistics runs either the statistics passes ([Note: norm passes cost]: node v runs ``a_v + Kb``
extra forwards and ``b_v`` extra backwards) or the layer-wise schedule ([Note: layer-wise norms],
[Note: layer-wise backward] in ``runtime/spatial/statistics/``): the forward runs every node
once, keeping in host memory what a later pass reads and what the backward starts its segments
from (the *boundary*: values read by a node of a lower backward level); the backward runs each
segment once with autograd, and once more without, up to its norms, for their sums (``s_v = 1``
for those nodes). Per node v, with ``w`` the sub-tiles' windows' mean area over the tiles'
(``window_inflation(mean=True)``: the T windows of a GPU add up to ``w / P`` of the image) and
``out_v`` its output bytes:

- host traffic: ``out_v x w / P`` bytes per copy, at the spec's ``host_link_bw`` and not
  overlapped with compute (``host_s``): a forward-kept value once out and once back per later
  pass that reads it (``1 + r_v``); a boundary value once out, back per lower segment that
  reads it and per sums run that reads it, and its gradient out per such segment, back to add
  the next one's, back as a seed and, for a norm, for its sums (``1 + 3 x segments + sums runs +
  [v is a norm]``);
- host memory per GPU: the boundary of every micro-batch in flight (``inflight``, held from
  forward to backward) plus the larger of the forward's most kept at once and the gradients the
  backward keeps at once (while segment j runs: those of the boundary nodes read from segment j
  or below and lying in segment j or above);
- extra time: ``fwd_v x s_v x w / P`` and the host copies, against the passes'
  ``(fwd_v x (a_v + Kb) + bwd_v x b_v) x w / P``.

The planner (:func:`norm_schedule`) takes the layer-wise schedule where the spec has host memory
and a host link, its peak fits the GPU's share of host memory (``Costs.host_memory``: 80% of the
node's ``host_memory`` over its GPUs, the offload's share, [Note: host offload]) and its time is
below the passes'; else the passes. ``PlannerOptions(norm_schedule=...)`` pins
either; a pinned layer-wise schedule that does not fit is refused (:func:`refuse_layerwise`).
The levels are taken over the whole graph, as for the passes: a stage that ends before the
model's last norm keeps less than charged (an upper bound).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from nowdl.errors import NowdlError
from nowdl.partitioner.costs.costmodel import Costs
from nowdl.plan.plan import format_bytes

__all__ = ["norm_depths", "LayerWise", "layer_wise", "NormSchedule", "norm_schedule", "refuse_layerwise", "reached",
           "NORM_SCHEDULES"]

NORM_SCHEDULES = ("auto", "passes", "layerwise")
_FREE = ("placeholder", "get_attr")  # the stage's inputs and parameters: never kept in host memory


def norm_depths(costs: Costs, norms: frozenset[int] | set[int]) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Each node's producers and consumers in ``costs``'s graph, and its depth: the most norms
    (``norms``, node indices) on a path from the input to it, itself included."""
    n = len(costs.profile.nodes)
    prods: list[list[int]] = [[] for _ in range(n)]
    cons: list[list[int]] = [[] for _ in range(n)]
    for u, v in costs.edges:
        prods[v].append(u)
        cons[u].append(v)
    depth = [0] * n
    for v in range(n):  # nodes are in topological order
        depth[v] = max((depth[u] for u in prods[v]), default=0) + (v in norms)
    return prods, cons, depth


def reached(starts: list[int], edges: Sequence[Sequence[int]]) -> set[int]:
    """The nodes ``starts`` reach along ``edges`` (``starts`` included)."""
    seen: set[int] = set()
    todo = list(starts)
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(edges[v])
    return seen


@dataclass(frozen=True)
class LayerWise:
    """Per node of the layer-wise forward: whether its output is kept in host memory, the later
    passes that read it back, and per forward pass k (1..K) the nodes kept after it."""

    kept: list[bool]
    reads: list[int]
    keep: list[frozenset[int]]
    level: list[int]  # per node: the most norms on a path to it (a norm's forward level)
    # the backward ([Note: layer-wise backward]): per node, whether the backward reads its forward
    # value from host memory (a user of a lower backward level), the extra forwards of the norms'
    # sums (1: in the part of its segment its level's norms read), and its host copies in the
    # backward, in units of its output on the windows
    boundary: list[bool]
    sums: list[int]
    bwd_copies: list[int]
    grad_span: list[tuple[int, int]]  # per boundary node: the segments its gradient is kept over


def layer_wise(costs: Costs, norms: frozenset[int]) -> LayerWise:
    """The :class:`LayerWise` of ``costs``'s graph with the norms ``norms`` (node indices), as the
    runtime's ``layer_plan`` makes it ([Note: layer-wise norms cost])."""
    nodes = costs.profile.nodes
    n = len(nodes)
    prods, cons, depth = norm_depths(costs, norms)
    kf = max((depth[v] for v in norms), default=0)
    free = {v for v in range(n) if nodes[v].op in _FREE}
    needed = {k: reached([v for v in norms if depth[v] == k], prods) for k in range(1, kf + 1)}
    first = [kf + 1] * n
    for k in range(kf, 0, -1):
        for v in needed[k]:
            if v not in free and not (v in norms and depth[v] == k):
                first[v] = k
    compute = {k: {v for v in needed[k] if v in free or first[v] >= k} for k in range(1, kf + 1)}
    compute[kf + 1] = {v for v in range(n) if v in free or first[v] == kf + 1}
    last = [max((first[c] for c in cons[v]), default=0) for v in range(n)]
    kept = [v not in free and first[v] <= kf and last[v] > first[v] for v in range(n)]
    reads = [sum(1 for k in range(first[v] + 1, kf + 2) if any(c in compute[k] for c in cons[v])) if kept[v] else 0
             for v in range(n)]
    keep = [frozenset(v for v in range(n) if kept[v] and first[v] <= k < last[v]) for k in range(1, kf + 1)]
    back = [0] * n
    for v in range(n - 1, -1, -1):
        back[v] = max((back[c] for c in cons[v]), default=0) + (v in norms)
    in_sums: set[int] = set()
    for j in range(1, max((back[v] for v in norms), default=0) + 1):
        todo, seen = [v for v in norms if back[v] == j], set()
        while todo:
            v = todo.pop()
            if v not in seen and v not in free and back[v] == j:
                seen.add(v)
                todo.extend(prods[v])
        in_sums |= seen
    boundary = [v not in free and any(back[c] < back[v] for c in cons[v]) for v in range(n)]
    copies = []
    for v in range(n):
        segs = {back[c] for c in cons[v] if back[c] != back[v]}  # the lower segments that read it
        sums_segs = {back[c] for c in cons[v] if c in in_sums and back[c] != back[v]}
        # forward value: out once, back per segment and per sums run; gradient: out per segment,
        # back to add the next segment's, back as a seed (and for its norm's sums)
        copies.append(1 + 3 * len(segs) + len(sums_segs) + (v in norms) if boundary[v] else 0)
    span = [(min((back[c] for c in cons[v] if back[c] < back[v]), default=back[v]), back[v]) if boundary[v]
            else (1, 0) for v in range(n)]
    return LayerWise(kept, reads, keep, depth, boundary, [int(v in in_sums) for v in range(n)], copies, span)


@dataclass(frozen=True)
class NormSchedule:
    """A sequential-tile stage's choice ([Note: layer-wise norms cost]): ``mode`` "" (no norm takes
    the image's statistics), "passes" or "layerwise"; the layer-wise figures per GPU and micro-batch
    (``host_bytes`` its peak in host memory, ``host_s`` its host copies, ``host_node_s`` those per
    node), ``saved_s`` the passes' time it saves (before its host copies), ``norm`` the norm a
    refusal names (the forward's most kept waits for its statistics)."""

    mode: str
    host_bytes: float = 0.0
    host_s: float = 0.0
    saved_s: float = 0.0
    host_node_s: tuple[float, ...] = ()
    norm: str = ""
    sums: tuple[int, ...] = ()  # per node, layer-wise: the extra forwards of the norms' sums


def norm_schedule(costs: Costs, norms: frozenset[int], passes_s: Sequence[float], parts: int,
                  window: float, inflight: int = 1) -> NormSchedule:
    """The schedule a stage of ``parts`` GPUs with windows of mean inflation ``window`` and
    ``inflight`` micro-batches in flight runs; ``passes_s``: per node, the seconds the statistics
    passes add (forwards and backwards, before the window and the parts)."""
    if not norms:
        return NormSchedule("")
    nodes = costs.profile.nodes
    lw = layer_wise(costs, norms)
    if costs.inference:  # no backward: nothing kept for it, no sums
        zero = [0] * len(nodes)
        lw = dataclasses.replace(lw, boundary=[False] * len(nodes), sums=zero, bwd_copies=zero,
                                 grad_span=[(1, 0)] * len(nodes))
    share = [float(x.out_bytes) * window / parts for x in nodes]
    bw = costs.host_link_bw or 0.0
    node_s = tuple(share[v] * ((1 + lw.reads[v] if lw.kept[v] else 0) + lw.bwd_copies[v]) / bw if bw > 0 else 0.0
                   for v in range(len(nodes)))
    held = [sum(share[v] for v in keep) for keep in lw.keep]
    fwd_peak = max(held, default=0.0)
    at = held.index(fwd_peak) + 1 if held else 1  # the pass after which the most is kept: its norms wait
    norm = next((nodes[v].name for v in sorted(norms) if lw.level[v] == at), "")
    bound = sum(share[v] for v in range(len(nodes)) if lw.boundary[v])  # kept from forward to backward
    grads = max((sum(share[v] for v, (lo, hi) in enumerate(lw.grad_span) if lo <= j <= hi)
                 for j in range(max((h for _, h in lw.grad_span), default=0) + 1)), default=0.0)
    peak = inflight * bound + max(fwd_peak, grads)  # segment j holds the gradients its boundary nodes span
    saved = sum((p - x.fwd_s * s) * window / parts for x, p, s in zip(nodes, passes_s, lw.sums, strict=True))
    sched = NormSchedule("layerwise", peak, sum(node_s), saved, node_s, norm, tuple(lw.sums))
    fits = bw > 0 and bool(costs.host_memory) and peak <= float(costs.host_memory or 0.0)
    if costs.norm_schedule == "layerwise" or (costs.norm_schedule == "auto" and fits and sched.host_s < saved):
        return sched
    return NormSchedule("passes", peak, sched.host_s, saved, (), norm)


def refuse_layerwise(costs: Costs, sched: NormSchedule, stage: int) -> None:
    """Raise when a pinned layer-wise schedule (``PlannerOptions(norm_schedule="layerwise")``) does
    not fit the GPU's share of host memory, naming the norm, the bytes and the fixes.

    Raises:
        NowdlError: the schedule is layer-wise and its peak exceeds ``costs.host_memory`` (or the spec
            has no host memory or host link).
    """
    share = float(costs.host_memory or 0.0)
    if sched.mode != "layerwise" or (share and costs.host_link_bw and sched.host_bytes <= share):
        return
    have = (f"the {format_bytes(share)} per GPU the device spec leaves (80% of its host_memory shared by the "
            "node's GPUs)" if share and costs.host_link_bw else "no host memory: the device spec has no host_memory "
            "or no host_link_bw")
    raise NowdlError(f"node {sched.norm!r}: stage {stage}'s norms run layer-wise keep {format_bytes(sched.host_bytes)} "
                     "per GPU in host memory (their pass boundaries and the values the backward starts from, over "
                     f"the sub-tiles' windows, per micro-batch in flight), but there is {have}: pass "
                     "PlannerOptions(norm_schedule='passes') (or 'auto'), give the spec a larger host_memory (and a "
                     "host_link_bw), or use more GPUs or spatial parts (each then keeps a smaller share)")
