"""Placement: which global rank holds which (data-parallel copy, stage slot, tile) on a cluster of nodes.

[Note: placement] Launchers put rank r on node ``r // gpus_per_node`` ([Note: topology]), so
the planner places work by choosing the rank of every (dp copy d, stage slot j, tile q). On
one node nothing changes: rank = d x ranks-per-pipeline + first rank of slot j + q. Across
nodes, the latency-bound, heavy traffic is kept inside a node:

* the tiles of a spatial stage exchange halos before every conv/pool, many small messages
  per micro-batch: a slot's tile group is never split across nodes when it fits in one;
* MASTER exchanges a stage's gradients between slot s and slot K-1-s: pipelines that span
  several nodes are laid out in paired order (0, K-1, 1, K-2, ...), so each pair shares a node;
* data-parallel copies stay outermost, so the all-reduce group of a slot has one member per
  copy: several per node when a pipeline is smaller than a node, one per node otherwise
  (the all-reduce is then hierarchical: reduce-scatter in the node, ring across, all-gather).

Slots are packed into nodes in that order, first fit: a group that does not fit in what is
left of the current node lets later, smaller groups fill it first. A group larger than a
node starts on a fresh node when it can. Pipeline boundaries (one large message per
micro-batch) may then cross nodes; the cost model charges them at the inter-node link.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nowdl.partitioner.config.candidate import Candidate, PlanRequest
from nowdl.plan.topology import Link, Topology, make_topology, node_spec_for

__all__ = ["Layout", "place", "allreduce_s", "request_topology", "flat_topology"]


def flat_topology(gpus: int, link_bw: float) -> Topology:
    """One node holding every rank, every message at ``link_bw`` (plans made before topologies)."""
    from nowdl.plan.topology import INTRA_LATENCY_S

    link = Link(link_bw, INTRA_LATENCY_S)
    return Topology(1, max(1, gpus), link, link, "flat")


def request_topology(req: PlanRequest, device_spec: Any, spec: Any) -> Topology:
    """The topology of a plan request: its --nodes/--gpus-per-node, else the device spec's node."""
    ar_bw = getattr(spec, "allreduce_bw", None)
    allreduce = Link(float(ar_bw), float(getattr(spec, "allreduce_latency_s", None) or 0.0)) if ar_bw else None
    return make_topology(req.gpus, nodes=req.nodes, gpus_per_node=req.gpus_per_node,
                         node=node_spec_for(device_spec, getattr(spec, "name", None)), link_bw=float(spec.link_bw),
                         link_latency_s=getattr(spec, "link_latency_s", None), allreduce=allreduce)


def _slot_order(cand: Candidate, topo: Topology) -> list[int]:
    k = cand.stages
    if cand.replicas == 2 and topo.multi_node and cand.ranks_per_pipeline() > topo.gpus_per_node:
        order: list[int] = []
        for j in range((k + 1) // 2):
            order += [j] if j == k - 1 - j else [j, k - 1 - j]
        return order
    return list(range(k))


def _pack(sizes: Sequence[int], per_node: int) -> list[int]:
    """Order of units (by index) so that each unit of size <= per_node sits inside one node."""
    fill, fits = 0, True
    for s in sizes:  # the order as given, when no unit straddles a node it could fit in
        if (s <= per_node and fill + s > per_node) or (s > per_node and fill):
            fits = False
            break
        fill = (fill + s) % per_node
    if fits:
        return list(range(len(sizes)))
    queues: dict[int, deque[int]] = {}
    for i, s in enumerate(sizes):
        queues.setdefault(s, deque()).append(i)
    out: list[int] = []
    fill = 0
    while len(out) < len(sizes):
        room = per_node - fill
        heads = [(q[0], s) for s, q in queues.items() if q]
        fitting = [h for h in heads if h[1] <= room]
        i, s = min(fitting) if fitting else min(heads)
        queues[s].popleft()
        out.append(i)
        fill = (fill + s) % per_node
    return out


@dataclass(frozen=True)
class Layout:
    """Ranks of one candidate on one topology: slot j of copy d holds ranks ``start[(d, j)] + q``."""

    cand: Candidate
    topo: Topology
    start: dict[tuple[int, int], int]  # (dp copy, slot) -> its first rank (a slot's tiles are consecutive)
    parts: tuple[int, ...]  # tiles of each stage
    groups: tuple[int, ...]  # ranks of each slot

    @property
    def rank_of(self) -> dict[tuple[int, int, int], int]:
        """(dp copy, slot, tile) -> global rank."""
        return {(d, j, q): r0 + q for (d, j), r0 in self.start.items() for q in range(self.groups[j])}

    def node(self, rank: int) -> int:
        return self.topo.node_of(rank)

    def slot(self, rep: int, stage: int) -> int:
        return stage if rep == 0 else self.cand.stages - 1 - stage

    def group(self, d: int, rep: int, stage: int) -> list[int]:
        """Ranks of the tiles of ``stage`` (replica ``rep``) in data-parallel copy ``d``."""
        r0 = self.start[(d, self.slot(rep, stage))]
        return list(range(r0, r0 + self.parts[stage]))

    def _span(self, d: int, rep: int, stage: int) -> tuple[int, int]:
        r0 = self.start[(d, self.slot(rep, stage))]
        return self.node(r0), self.node(r0 + self.parts[stage] - 1)

    @functools.cached_property
    def _crossings(self) -> tuple[list[bool], list[bool]]:
        """(tiles span nodes, a chain boundary crosses nodes) per stage, over every copy."""
        return _crossings(self.cand.stages, self.cand.replicas, self.cand.dp, self.parts,
                          tuple(sorted(self.start.items())), self.topo.gpus_per_node)

    def tiles_cross(self, stage: int) -> bool:
        """Does a tile group of ``stage`` span several nodes (its halos cross the inter link)?"""
        return self._crossings[0][stage]

    def boundary_cross(self, stage: int) -> bool:
        """Does a boundary tensor into or out of ``stage`` (next stages in the chain) cross nodes?"""
        return self._crossings[1][stage]

    def master_cross(self, stage: int) -> bool:
        """MASTER: are the two replicas of ``stage`` (slots s and K-1-s) on different nodes?"""
        if self.cand.replicas != 2:
            return False
        return any(len({*self._span(d, 0, stage), *self._span(d, 1, stage)}) > 1 for d in range(self.cand.dp))

    def dp_members(self, slot: int) -> list[list[int]]:
        """For each tile q of ``slot``: members of its data-parallel group on each node spanned."""
        out = []
        for q in range(self.groups[slot]):
            count: dict[int, int] = {}
            for d in range(self.cand.dp):
                n = self.node(self.start[(d, slot)] + q)
                count[n] = count.get(n, 0) + 1
            members = sorted(count.values(), reverse=True)
            if members not in out:
                out.append(members)
        return out


@functools.lru_cache(maxsize=1024)
def _crossings(k: int, replicas: int, dp: int, parts: tuple[int, ...], start: tuple[tuple[tuple[int, int], int], ...],
               per_node: int) -> tuple[list[bool], list[bool]]:
    first = np.zeros((dp, k), dtype=np.int64)
    for (d, j), r0 in start:
        first[d, j] = r0
    p = np.asarray(parts, dtype=np.int64)
    tiles = np.zeros(k, dtype=bool)
    edge = np.zeros(k, dtype=bool)
    for rep in range(replicas):
        slots = np.arange(k) if rep == 0 else k - 1 - np.arange(k)
        lo = first[:, slots] // per_node  # dp x k: node of each stage's first tile
        hi = (first[:, slots] + p - 1) // per_node
        tiles |= (lo != hi).any(axis=0)
        if k > 1:
            cross = ((lo[:, :-1] != hi[:, :-1]) | (lo[:, 1:] != hi[:, 1:]) | (lo[:, :-1] != lo[:, 1:])).any(axis=0)
            edge[:-1] |= cross
            edge[1:] |= cross
    return tiles.tolist(), edge.tolist()


@functools.lru_cache(maxsize=1024)
def _starts(groups: tuple[int, ...], order: tuple[int, ...], dp: int, per_node: int,
            multi: bool) -> dict[tuple[int, int], int]:
    units = [(d, j) for d in range(dp) for j in order]
    if multi:
        units = [units[i] for i in _pack([groups[j] for _, j in units], per_node)]
    start: dict[tuple[int, int], int] = {}
    r = 0
    for d, j in units:
        start[(d, j)] = r
        r += groups[j]
    return start


def place(cand: Candidate, topo: Topology) -> Layout:
    """The layout of [Note: placement] for ``cand`` on ``topo``."""
    groups = tuple(cand.group_sizes())
    start = _starts(groups, tuple(_slot_order(cand, topo)), cand.dp, topo.gpus_per_node, topo.multi_node)
    return Layout(cand, topo, start, tuple(cand.stage_parts()), groups)


def allreduce_s(nbytes: float, members: Sequence[int], topo: Topology) -> float:
    """Seconds to all-reduce ``nbytes`` over a group with ``members[i]`` ranks on node i.

    One node: a ring, 2(L-1)/L x bytes at the intra-node bandwidth. Several nodes:
    hierarchical, reduce-scatter inside each node, a ring across nodes on the 1/L shard that
    each rank owns (2(N-1)/N x bytes/L at the inter-node bandwidth, plus 2(N-1) latencies),
    then all-gather inside each node. The fullest node sets the intra part, the emptiest
    (largest shard) the inter part. A measured ``topo.allreduce`` (``nowdl calibrate``) prices
    the intra part at its bus bandwidth plus its per-call latency.
    """
    total = sum(members)
    if total <= 1 or nbytes <= 0:
        return 0.0
    lmax, lmin, n = max(members), min(members), len(members)
    ar = topo.allreduce
    t = 2 * (lmax - 1) / lmax * nbytes / topo.intra.bw if ar is None else \
        (2 * (lmax - 1) / lmax * nbytes / ar.bw + ar.latency_s if lmax > 1 else 0.0)
    if n > 1:
        t += 2 * (n - 1) / n * (nbytes / lmin) / topo.inter.bw + 2 * (n - 1) * topo.inter.latency_s
    return t
