"""The ideals (downsets) of a DAG: every one when there are few, a beam of good ones otherwise.

An ideal holds every producer of its nodes; a chain of ideals ``{} = D_0 < ... < D_K = V``
is a convex split (see [Note: ideal DP] in :mod:`nowdl.partitioner.exact.ideal_dp`, which runs the DP
over them). :func:`enumerate_ideals` lists them all, breadth first by size, up to a cap;
:func:`beam_ideals` keeps a few per size.

[Note: ideal beam] A graph with more ideals than the cap (UNet++'s nested skips, UNETR's
parallel encoder paths, AmoebaNet's cells) gets a beam instead: breadth first by size, each
size keeps the few ideals whose frontier sends the fewest bytes (a cut that good splits have),
plus the prefixes of one topological order. The same DP over that family is a heuristic
(solver "beam", status "heuristic"), never worse than the DP over the order alone, and the
MILP's start: on UNETR at K = 8 it came within 1.4% of the MILP's optimum (memory) where the
order's split was 15% off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nowdl.partitioner.costs.problem import Problem

__all__ = ["Lattice", "enumerate_ideals", "beam_ideals", "near_ideals", "IDEAL_CAP", "BEAM_CAP"]

IDEAL_CAP = 3000  # more ideals than this: the ideal DP is not used (~32 * cap^2 bytes of matrices)
BEAM_CAP = 1500  # ideals a beam keeps at most (about)


@dataclass(frozen=True)
class Lattice:
    """The ideals of a DAG, sorted by size (0: empty, last: all nodes)."""

    members: np.ndarray  # (I, n) bool
    proper: np.ndarray  # (I, I) bool: ideal i is a proper subset of ideal j
    frontier: list[list[int]]  # nodes of ideal i with a consumer outside it
    consumers: list[list[int]]
    chain: list[int]  # ideals of the prefixes of one topological order (0 .. I-1)
    complete: bool = True  # every ideal of the DAG (else a beam: the DP is a heuristic)

    @property
    def size(self) -> int:
        return int(self.members.shape[0])


def _graph(problem: Problem) -> tuple[list[int], list[int], list[list[int]], list[list[int]]]:
    n = problem.n
    preds = [0] * n
    succ_mask = [0] * n
    succs: list[list[int]] = [[] for _ in range(n)]
    pred_list: list[list[int]] = [[] for _ in range(n)]
    for u, v in sorted(set(problem.edges)):
        preds[v] |= 1 << u
        succ_mask[u] |= 1 << v
        succs[u].append(v)
        pred_list[v].append(u)
    return preds, succ_mask, succs, pred_list


_Info = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # addable, frontier, top


def _expansions(level: dict[int, _Info], graph: tuple[list[int], list[int], list[list[int]], list[list[int]]]
                ) -> dict[int, _Info]:
    """Every ideal one node larger than an ideal of ``level``, with its addable nodes,
    frontier and maximal nodes (updated from the parent's)."""
    preds, succ_mask, succs, pred_list = graph
    nxt: dict[int, _Info] = {}
    for d, (add, front, top) in level.items():
        for v in add:
            e = d | (1 << v)
            if e in nxt:
                continue
            new_add = [w for w in add if w != v]
            new_add += [w for w in succs[v] if not preds[w] & ~e]
            gone = {u for u in pred_list[v] if not succ_mask[u] & ~e}
            new_front = [u for u in front if u not in gone] + ([v] if succs[v] else [])
            pv = set(pred_list[v])
            new_top = [u for u in top if u not in pv] + [v]
            nxt[e] = (tuple(sorted(new_add)), tuple(sorted(new_front)), tuple(sorted(new_top)))
    return nxt


def _lattice(n: int, ideals: list[int], info: list[_Info], succs: list[list[int]],
             complete: bool, chain_sets: Sequence[int] | None = None) -> Lattice:
    nbytes = (n + 7) // 8
    members = np.zeros((len(ideals), n), dtype=bool)
    for i, e in enumerate(ideals):
        bits = np.unpackbits(np.frombuffer(e.to_bytes(nbytes, "little"), dtype=np.uint8),
                             bitorder="little")
        members[i] = bits[:n].astype(bool)
    count = len(ideals)
    proper = np.zeros((count, count), dtype=bool)
    for i, (_, _, top) in enumerate(info):
        proper[i] = members[:, list(top)].all(axis=1) if top else True
        proper[i, i] = False
    index = {e: i for i, e in enumerate(ideals)}
    if chain_sets is not None:
        chain = [index[d] for d in chain_sets]
    else:
        chain, d = [0], 0
        while info[chain[-1]][0]:  # add the smallest addable node, one at a time
            d |= 1 << info[chain[-1]][0][0]
            chain.append(index[d])
    return Lattice(members=members, proper=proper, frontier=[list(f) for _, f, _ in info],
                   consumers=succs, chain=chain, complete=complete)


def enumerate_ideals(problem: Problem, cap: int = IDEAL_CAP) -> Lattice | None:
    """All ideals of the problem's DAG, or None when there are more than ``cap``.

    Breadth first by size; each ideal keeps its addable nodes (all producers inside), its
    frontier and its maximal nodes, updated when one node is added. Deterministic.
    """
    graph = _graph(problem)
    preds = graph[0]
    start: _Info = (tuple(v for v in range(problem.n) if not preds[v]), (), ())
    level: dict[int, _Info] = {0: start}
    ideals = [0]
    info: list[_Info] = [start]
    while level:
        nxt = _expansions(level, graph)
        if len(ideals) + len(nxt) > cap:
            return None
        ideals.extend(nxt)
        info.extend(nxt.values())
        level = nxt
    return _lattice(problem.n, ideals, info, graph[2], complete=True)


def beam_ideals(problem: Problem, cap: int = BEAM_CAP) -> Lattice:
    """Some of the DAG's ideals, for graphs with too many (see [Note: ideal beam]).

    Breadth first by size like ``enumerate_ideals``, but each size keeps only its
    ``cap // n - 1`` (at least 2) ideals with the fewest bytes crossing their frontier, plus the
    prefix of one topological order; when that is still more than ``cap``, only every
    ``stride``-th size is kept as a place to cut (all sizes are still expanded). Deterministic.
    """
    graph = _graph(problem)
    preds, succs = graph[0], graph[2]
    n = problem.n
    width = max(2, cap // max(n, 1) - 1)  # per size, besides the order's prefix
    stride = max(1, math.ceil((width + 1) * n / max(cap, 1)))
    out = np.zeros(n)
    for vec in problem.variants.values():  # the largest size a tensor has in any kind of stage
        out = np.maximum(out, np.asarray(vec.out, dtype=np.float64))
    start: _Info = (tuple(v for v in range(n) if not preds[v]), (), ())
    level: dict[int, _Info] = {0: start}
    ideals = [0]
    info: list[_Info] = [start]
    chain_d, chain = 0, [0]
    size = 0
    while level:
        nxt = _expansions(level, graph)
        if not nxt:
            break
        size += 1
        chain_d |= 1 << min(level[chain_d][0])  # the chain's next ideal (smallest addable node)
        ranked = sorted(nxt, key=lambda e: (float(out[list(nxt[e][1])].sum()), e))
        keep = ranked[:width]
        if chain_d not in keep:
            keep.append(chain_d)
        level = {e: nxt[e] for e in keep}
        if size % stride == 0 or size == n:
            ideals.extend(level)
            info.extend(level.values())
            chain.append(chain_d)
    return _lattice(n, ideals, info, succs, complete=False, chain_sets=chain)


def _info(graph: tuple[list[int], list[int], list[list[int]], list[list[int]]], d: int, n: int) -> _Info:
    """(addable, frontier, maximal nodes) of the ideal ``d`` (a bit mask), from scratch."""
    preds, succ_mask, succs, _ = graph
    inside = [v for v in range(n) if d >> v & 1]
    add = tuple(v for v in range(n) if not d >> v & 1 and not preds[v] & ~d)
    front = tuple(u for u in inside if succ_mask[u] & ~d)
    top = tuple(u for u in inside if not succ_mask[u] & d)
    return add, front, top


def _reversed(graph: tuple[list[int], list[int], list[list[int]], list[list[int]]]
              ) -> tuple[list[int], list[int], list[list[int]], list[list[int]]]:
    preds, succ_mask, succs, pred_list = graph
    return succ_mask, preds, pred_list, succs


def _ball(graph: tuple[list[int], list[int], list[list[int]], list[list[int]]], d: int, n: int,
          cap: int, out: np.ndarray) -> list[int]:
    """Ideals reached from ``d`` by adding nodes one at a time, breadth first, about ``cap``;
    a level that would pass the cap keeps its ideals with the fewest frontier bytes."""
    level = {d: _info(graph, d, n)}
    found: list[int] = []
    while level and len(found) < cap:
        nxt = _expansions(level, graph)
        keep = sorted(nxt, key=lambda e: (float(out[list(nxt[e][1])].sum()), e))[: cap - len(found)]
        found.extend(keep)
        level = {e: nxt[e] for e in keep}
    return found


def near_ideals(problem: Problem, cut: int, per_side: int) -> list[int]:
    """The ideals a few nodes larger and a few nodes smaller than ``cut`` (a bit mask), about
    ``per_side`` each way, breadth first, ``cut`` first (see [Note: local ideals] in
    :mod:`nowdl.partitioner.exact.local_search`). Deterministic."""
    n = problem.n
    graph = _graph(problem)
    full = (1 << n) - 1
    out = np.zeros(n)
    for vec in problem.variants.values():  # the largest size a tensor has in any kind of stage
        out = np.maximum(out, np.asarray(vec.out, dtype=np.float64))
    found = [cut] + _ball(graph, cut, n, per_side, out)
    return found + [full & ~e for e in _ball(_reversed(graph), full & ~cut, n, per_side, out)]
