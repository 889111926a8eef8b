"""Single-entry single-exit regions: contract them so the exact DP over ideals applies.

[Note: SESE contraction] Graphs of parallel paths (attention blocks, NAS cells, nested skips)
have too many ideals for the exact DP ([Note: ideal DP]). Most of those ideals cut through a
small region a single tensor enters and a single tensor leaves: with a virtual source before
every input and a virtual sink after every output, node ``e`` and its immediate post-dominator
``x`` bound such a region when ``e`` also dominates ``x``; its interior ``R`` (the nodes
between) then has every producer in ``R + {e}`` and every consumer in ``R + {x}``, and ``x``
every producer in ``R + {e}``. The group ``R + {x}`` so receives only ``e``'s tensor and sends
only ``x``'s: merged into one node, the coarse problem's ``evaluate()`` equals the original's
for every split that keeps the group whole (the invariant of [Note: exact merges]). Regions are
nested or disjoint; the outermost ones whose weight (memory and time shares of the whole) is at
most ``w`` are merged, a chain of nodes reduced to one by the greedy merges of ``coarsen``
after them, and ``w`` is the smallest (binary search) whose coarse graph has at most ``cap``
ideals. The DP over those ideals is the exact optimum over the splits that keep every merged
region whole; the fine graph's cuts near it are then searched by [Note: local ideals]. A
heuristic on the fine graph: its gap is measured against a lower bound by the caller.
"""

from __future__ import annotations

import logging
import time

from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.structure import one_to_one, topological_order
from nowdl.partitioner.exact.coarse_dp import split_contracted
from nowdl.partitioner.exact.coarsen import merge_start
from nowdl.partitioner.exact.downsets import Lattice, enumerate_ideals

__all__ = ["sese_regions", "contract_regions", "sese_split", "SESE_CAP"]

log = logging.getLogger(__name__)

SESE_CAP = 1500  # ideals of the contracted graph at most (its DP: about a second on 500 nodes)
_ROOT = -1


def _idoms(order: list[int], preds: list[list[int]]) -> list[int]:
    """Immediate dominators over a DAG (``_ROOT``: only the virtual source dominates)."""
    n = len(order)
    idom = [_ROOT] * n
    depth = [0] * n
    for v in order:
        ps = preds[v]
        if not ps:
            idom[v], depth[v] = _ROOT, 1
            continue
        a = ps[0]
        for b in ps[1:]:
            while a != b:  # the nearest common dominator of a and b
                if a == _ROOT or b == _ROOT:
                    a = b = _ROOT
                    break
                if depth[a] >= depth[b]:
                    a = idom[a]
                else:
                    b = idom[b]
        idom[v] = a
        depth[v] = 1 if a == _ROOT else depth[a] + 1
    return idom


def sese_regions(problem: Problem) -> list[tuple[int, list[int]]]:
    """The post-dominator tree as regions ``(exit, members)``: for each node ``x`` the nodes
    whose every path to an output passes ``x``, and ``x`` (see [Note: SESE contraction]);
    children before parents (topological order reversed)."""
    n = problem.n
    preds: list[list[int]] = [[] for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for u, v in set(problem.edges):
        succs[u].append(v)
        preds[v].append(u)
    order = topological_order(problem)
    ipdom = _idoms(order[::-1], succs)
    members: list[list[int]] = [[v] for v in range(n)]
    # a node's post-dominated nodes come before it in topological order: its list is full when
    # it joins its own post-dominator's
    for v in order:
        x = ipdom[v]
        if x != _ROOT:
            members[x].extend(members[v])
    return [(x, members[x]) for x in order]


def contract_regions(problem: Problem, regions: list[tuple[int, list[int]]], weight: float,
                     chains: int | None = None) -> tuple[Problem, list[list[int]]]:
    """Merge the outermost regions of at most ``weight`` (share of the total memory or time,
    the larger) into their exits; then, with ``chains``, greedy single-consumer merges down to
    that many groups. Returns the coarse problem and its groups (original indices)."""
    g, loads, tot_mem, tot_time = merge_start(problem)
    tied = [set(t) for t in problem.tied]
    taken = [False] * problem.n
    for x, nodes in reversed(regions):  # parents first: the outermost that fit
        if taken[x] or len(nodes) < 2:
            continue
        mem = sum(loads[v][0] for v in nodes) / tot_mem
        tim = sum(loads[v][1] for v in nodes) / tot_time
        if max(mem, tim) > weight:
            continue
        if len({g.tile[v] for v in nodes}) > 1 or len({g.pin[v] for v in nodes} - {None}) > 1:
            continue
        inside = set(nodes)
        if any(t & inside and not t <= inside for t in tied):
            continue
        for v in nodes:
            taken[v] = True
            if v != x:
                g.merge(x, v, x)
    g.exact_pass(0.0)
    if chains is not None and sum(g.alive) > chains:
        g.greedy_pass(chains, warn=False)
    return g.build()


def _lattice(problem: Problem, cap: int, steps: int = 6) -> tuple[Problem, list[list[int]], Lattice] | None:
    """The finest contraction with at most ``cap`` ideals (binary search on the weight, from
    half a stage down; where regions alone leave too many, chains are merged greedily too)."""
    regions = sese_regions(problem)

    def attempt(weight: float) -> tuple[Problem, list[list[int]], Lattice] | None:
        small, groups = contract_regions(problem, regions, weight)
        lat = enumerate_ideals(small, cap)
        if lat is None:
            small, groups = contract_regions(problem, regions, weight, chains=max(8, 4 * problem.k))
            lat = enumerate_ideals(small, cap)
        return None if lat is None else (small, groups, lat)

    top = 1.0 / (2 * problem.k)
    best = attempt(top)
    if best is None:
        return None
    lo, hi = 0.0, top
    for _ in range(steps):
        mid = (lo + hi) / 2
        got = attempt(mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, mid
    return best


def sese_split(problem: Problem, cap: int = SESE_CAP) -> Partition | None:
    """The exact DP over the ideals of ``problem`` with its regions contracted ([Note: SESE
    contraction]), mapped back: solver "sese", status "heuristic". None when the ranks hold two
    stages each (MASTER), no contraction has few enough ideals, or nothing fits the cap."""
    if not one_to_one(problem) or problem.k < 2:
        return None
    t0 = time.perf_counter()
    return split_contracted(problem, _lattice(problem, cap), "sese", t0)
