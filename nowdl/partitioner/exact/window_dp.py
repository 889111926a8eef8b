"""Refine a split's cuts on the fine graph: the exact DP over a window of two stages.

[Note: window refinement] A split is a chain of ideals {} = D_0 < D_1 < ... < D_K = V ([Note:
ideal DP]). Holding every cut but D_s fixed, the best D_s is the best ideal ``D`` with
D_{s-1} < D < D_{s+1}: stages s - 1 and s are then the only loads that change, and every such
``D`` is D_{s-1} plus an ideal of the sub-DAG ``W = D_{s+1} - D_{s-1}``. Where ``W`` has at
most ``WINDOW_CAP`` ideals they are all tried (exact for that cut); where it has more, ``W``
is merged greedily (``coarsen(..., max_nodes=m)``, the largest ``m`` whose ideals fit the cap)
and its coarse ideals are tried. The window holds two stages of the split rather than the
whole graph, so the same cap buys a much finer grain than the coarse DP over all of it
([Note: coarse ideal DP]): on AmoebaNet-D the early stages hold 9 to 30 nodes and are searched
exhaustively. Each candidate's loads come from ``local_search``'s matrices (one row or column
per candidate), the choice by the lexicographic levels 1 and 2 of [Note: lexicographic levels]
over the whole split. Sweeps over s = 1 .. K - 1 repeat until a sweep improves nothing or the
time is up; a move is kept only when it lowers the split's objective values (and never idles
a stage the start kept busy). Unlike the walk of [Note: local ideals], which reaches the
ideals a few nodes from a cut, a window moves a cut anywhere between its neighbours, through
cuts with wide frontiers. A heuristic: the caller reports its gap against a lower bound.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np

from nowdl.partitioner.costs.no_idle import stage_work
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.structure import make_partition, objective_values, one_to_one, topological_order
from nowdl.partitioner.exact.chain_dp import spread_ok
from nowdl.partitioner.exact.coarsen import coarsen
from nowdl.partitioner.exact.downsets import _expansions, _graph
from nowdl.partitioner.exact.batch_eval import evaluate_many
from nowdl.partitioner.exact.local_search import _Graph, _masks, _members

__all__ = ["refine_cuts", "WINDOW_CAP", "SPAN"]

log = logging.getLogger(__name__)

WINDOW_CAP = 1500  # ideals of one window's sub-DAG (or its greedy coarsening) at most
SPAN = 40  # nodes on each side of a cut in its narrow window  # (stages per window, ideals of its sub-DAG or coarsening at most)


def _ideal_masks(problem: Problem, cap: int) -> list[int] | None:
    """Every ideal of ``problem``'s DAG as a bit mask, or None when there are more than ``cap``."""
    graph = _graph(problem)
    preds = graph[0]
    level = {0: (tuple(v for v in range(problem.n) if not preds[v]), (), ())}
    found = [0]
    while level:
        level = _expansions(level, graph)
        if len(found) + len(level) > cap:
            return None
        found.extend(level)
    return found


def _window(problem: Problem, nodes: list[int], a: int, b: int) -> Problem:
    """The sub-problem of ``nodes`` (stages a .. b - 1 of a split): their costs and edges."""
    index = {v: i for i, v in enumerate(nodes)}
    variants = {key: type(vec)(act=[vec.act[v] for v in nodes], time=[vec.time[v] for v in nodes],
                               workspace=[vec.workspace[v] for v in nodes], out=[vec.out[v] for v in nodes])
                for key, vec in problem.variants.items()}
    return Problem(names=[problem.names[v] for v in nodes],
                   edges=sorted({(index[u], index[v]) for u, v in problem.edges if u in index and v in index}),
                   static=[problem.static[v] for v in nodes], variants=variants,
                   stages=[dataclasses.replace(problem.stages[t], skip_wait=()) for t in range(a, b)],
                   tileable=[problem.tileable[v] for v in nodes] if problem.tileable else (),
                   objective=problem.objective)


def _candidates(problem: Problem, lo: int, hi: int, a: int, b: int, cap: int) -> list[int]:
    """Masks D with lo <= D <= hi, ``D - lo`` an ideal of the window (of its coarsening when
    the window has more than ``cap`` ideals)."""
    nodes = [v for v in range(problem.n) if (hi & ~lo) >> v & 1]
    if len(nodes) < 2:
        return []
    sub = _window(problem, nodes, a, b)

    def lift(masks: list[int], groups: list[list[int]]) -> list[int]:
        out = []
        for m in masks:
            d = lo
            for g, grp in enumerate(groups):
                if m >> g & 1:
                    for i in grp:
                        d |= 1 << nodes[i]
            out.append(d)
        return out

    direct = _ideal_masks(sub, cap)
    if direct is not None:
        return lift(direct, [[i] for i in range(len(nodes))])
    best: list[int] = []
    lo_n, hi_n = 2, len(nodes) - 1
    for _ in range(8):  # binary search on the group count (about 2^8 precision is plenty)
        if lo_n > hi_n:
            break
        mid = (lo_n + hi_n) // 2
        small, groups = coarsen(sub, max_nodes=mid, warn=False)
        masks = _ideal_masks(small, cap)
        if masks is None:
            hi_n = mid - 1
        else:
            best = lift(masks, groups)
            lo_n = max(mid, small.n) + 1
    return best


def _narrow(cuts: list[int], s: int, span: int, pos: list[int]) -> tuple[int, int]:
    """Ideals lo <= D_s <= hi: D_s less its ``span`` nodes latest in the order ``pos``, and
    D_s plus the ``span`` earliest nodes of stage s (a topological prefix meets an ideal in an
    ideal, and two ideals' union is one)."""
    inside = sorted((v for v in range(len(pos)) if (cuts[s] & ~cuts[s - 1]) >> v & 1), key=pos.__getitem__)
    after = sorted((v for v in range(len(pos)) if (cuts[s + 1] & ~cuts[s]) >> v & 1), key=pos.__getitem__)
    cut_pos = pos[inside[-span]] if len(inside) >= span else -1
    lo = cuts[s - 1] | sum(1 << v for v in inside if pos[v] < cut_pos)
    hi = cuts[s] | sum(1 << v for v in after[:span])
    return lo, hi


def _move(problem: Problem, g: _Graph, best: Partition, s: int, cap: int, span: int, pos: list[int],
          idle_ok: bool) -> Partition | None:
    """The best split with cut D_s moved within its window (``None``: no better one)."""
    cuts = _masks(best.stage_of, problem.k)
    family = _candidates(problem, cuts[s - 1], cuts[s + 1], s - 1, s + 1, cap)
    if span:  # and finely around the cut itself
        lo, hi = _narrow(cuts, s, span, pos)
        family += _candidates(problem, lo, hi, s - 1, s + 1, cap)
    family = [c for c in dict.fromkeys(family) if c not in (cuts[s], cuts[s - 1], cuts[s + 1])]
    if not family:
        return None
    members = _members(family, problem.n)
    members = members[g.admissible(members, s)]
    if not members.shape[0]:
        return None
    window = np.flatnonzero(_members([cuts[s + 1] & ~cuts[s - 1]], problem.n)[0])
    rows = np.tile(np.asarray(best.stage_of, dtype=np.int64), (members.shape[0], 1))
    rows[:, window] = np.where(members[:, window], s - 1, s)
    mem, tim = evaluate_many(problem, rows)
    if problem.mem_cap is not None:
        over = mem.max(axis=1) > problem.mem_cap * (1 + 1e-9)
        mem[over], tim[over] = np.inf, np.inf
    prim, sec = (mem, tim) if problem.objective == "memory" else (tim, mem)
    first, second = prim.max(axis=1), sec.max(axis=1)
    best_val = objective_values(problem, best)
    for i in np.lexsort((second, first))[:8]:  # the best few by the two levels: exact re-check
        if (first[i], second[i]) >= best_val:
            break
        stage_of = [int(x) for x in rows[i]]
        cand = make_partition(problem, stage_of, solver=best.solver.split("+")[0] + "+window",
                              status="heuristic", gap=math.nan)
        if objective_values(problem, cand) < best_val and (not idle_ok or spread_ok(stage_work(problem, stage_of))):
            return cand
    return None


def refine_cuts(problem: Problem, part: Partition, *, budget_s: float, cap: int = WINDOW_CAP,
                span: int = SPAN) -> Partition:
    """``part`` with each inner cut moved to the best place between its neighbours ([Note:
    window refinement]), sweep after sweep, for at most about ``budget_s`` seconds; ``part``
    itself when nothing improves or the ranks hold two stages each (MASTER).

    Args:
        cap: ideals of one window (or of its coarsening) at most.
        span: nodes on each side of a cut in its narrow window (0: none).

    Returns:
        A split with solver ``part.solver + "+window"`` and status "heuristic" when improved.
    """
    if not one_to_one(problem) or problem.k < 2 or budget_s <= 0:
        return part
    t0 = time.perf_counter()
    g = _Graph(problem)
    pos = [0] * problem.n
    for i, v in enumerate(topological_order(problem)):
        pos[v] = i
    best, moves, sweeps = part, 0, 0
    idle_ok = spread_ok(stage_work(problem, part.stage_of))
    stale = 0  # cuts tried in a row without a move: a full round of them ends the search
    s = 1
    while stale < problem.k - 1 and time.perf_counter() - t0 < budget_s:
        got = _move(problem, g, best, s, cap, span, pos, idle_ok)
        if got is None:
            stale += 1
        else:
            best, moves, stale = got, moves + 1, 0
        s = s % (problem.k - 1) + 1
        sweeps += s == 1
    log.info("window refinement: %s -> %s in %d move(s), %d sweep(s), %.2f s", objective_values(problem, part)[0],
             objective_values(problem, best)[0], moves, sweeps, time.perf_counter() - t0)
    return best
