"""Refine a split's cuts on the fine graph, one cut at a time, scored with the long-skip waits.

[Note: window refinement] A split is a chain of ideals {} = D_0 < D_1 < ... < D_K = V ([Note:
ideal DP]). Holding every cut but D_s fixed, D_s may be any ideal ``D`` with D_{s-1} < D <
D_{s+1}: D_{s-1} plus an ideal of the sub-DAG ``W = D_{s+1} - D_{s-1}``. Where ``W`` has at
most ``WINDOW_CAP`` ideals they are all tried; where it has more, ``W`` is merged greedily
(``coarsen(..., max_nodes=m)``, the largest ``m`` whose ideals fit the cap) and its coarse
ideals are tried, and so are those of a narrow window of ``SPAN`` nodes each side of the cut
(finely). The window holds two stages rather than the whole graph, so the same cap buys a much
finer grain than the coarse DP over all of it ([Note: coarse ideal DP]): on AmoebaNet-D the
early stages hold 9 to 30 nodes and are searched exhaustively. Every candidate is scored by
``evaluate_many``, ``evaluate()`` for many assignments at once, so the long-skip gradient waits
([Note: long-skip gradient waits]) are charged exactly (only the stages from s - 1 on are
evaluated: the others do not change). The move taken is the best by *leximax* (the stages'
primary values sorted from the largest, compared in that order): a move that lowers one of
several stages tied at the top is taken, so a plateau can be lowered cut by cut. Sweeps over
s = 1 .. K - 1 repeat until a round of K - 1 cuts moves nothing or the time is up; no move idles
a stage the start kept busy, and the split returned is the best seen by the objective's own
levels (never worse than the start). A heuristic: the caller reports its gap against a bound.

``evaluate_many``: per stage ``t`` (with ``S[i, v]``, node v's stage in assignment i) a tensor
``u`` reaches ``t`` when some consumer of u is in ``t`` and u is in an earlier stage (an OR over
u's out-edges, ``np.logical_or.reduceat`` over the edges sorted by producer); it is sent once
when any consumer is in a later stage than u; sums, the largest workspace, the received, sent
and waiting bytes then follow ``evaluate``'s formula term by term.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np

from nowdl.partitioner.chain.chain_dp import spread_ok
from nowdl.partitioner.costs.no_idle import stage_work
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.structure import (
    make_partition,
    objective_values,
    one_to_one,
    topological_order,
)
from nowdl.partitioner.exact.coarsen import coarsen
from nowdl.partitioner.exact.downsets import _expansions, _graph, _Info
from nowdl.partitioner.exact.local_search import _Graph, _masks, _members

__all__ = ["refine_cuts", "evaluate_many", "window_loads", "WINDOW_CAP", "SPAN"]

log = logging.getLogger(__name__)

WINDOW_CAP = 400  # ideals of one window's sub-DAG (or its greedy coarsening) at most
SPAN = 20  # nodes on each side of a cut in its narrow window


def evaluate_many(problem: Problem, stage_of: np.ndarray, first: int = 0,
                  last: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Memory and time of stages ``first`` to ``last`` (default: every stage) for each row of
    ``stage_of`` (an (I, n) integer array of convex assignments): two (I, K) arrays equal to
    ``evaluate``'s, to float rounding (zero outside those stages)."""
    k = problem.k
    s = np.asarray(stage_of, dtype=np.int64)
    rows = s.shape[0]
    edges = np.array(sorted(set(problem.edges)), dtype=np.int64).reshape(-1, 2)
    static = np.asarray(problem.static, dtype=np.float64)
    mem = np.zeros((rows, k))
    tim = np.zeros((rows, k))
    if edges.size:
        eu, ev = edges[:, 0], edges[:, 1]
        starts = np.flatnonzero(np.r_[True, eu[1:] != eu[:-1]])
        prod = eu[starts]  # each producer once, in edge order
        src = s[:, prod]  # (I, U): the producer's stage
        later = np.logical_or.reduceat(s[:, ev] > s[:, eu], starts, axis=1)  # sent at all
    for t, spec in enumerate(problem.stages):
        if t < first or (last is not None and t > last):
            continue
        vec = problem.variants[spec.variant]
        here = s == t
        hf = here.astype(np.float64)
        act, time_ = hf @ np.asarray(vec.act, dtype=np.float64), hf @ np.asarray(vec.time, dtype=np.float64)
        ws = np.where(here, np.asarray(vec.workspace, dtype=np.float64)[None, :], 0.0).max(axis=1)
        recv = sent = wait = np.zeros(rows)
        if edges.size:
            out = np.asarray(vec.out, dtype=np.float64)[prod]
            reach = np.logical_or.reduceat(here[:, ev], starts, axis=1) & (src < t)
            recv = reach @ out
            waits = np.array([spec.wait_from(i) for i in range(k)], dtype=np.float64)[src]
            wait = (reach * waits) @ out
            sent = (later & (src == t)) @ out
        mem[:, t] = (hf @ static + spec.inflight * act + spec.recv_factor * recv + spec.send_factor * sent
                     + ws + wait)
        tim[:, t] = time_ + spec.link_s_per_byte * (recv + sent)
    return mem, tim


def _ideal_masks(problem: Problem, cap: int) -> list[int] | None:
    """Every ideal of ``problem``'s DAG as a bit mask, or None when there are more than ``cap``."""
    graph = _graph(problem)
    preds = graph[0]
    level: dict[int, _Info] = {0: (tuple(v for v in range(problem.n) if not preds[v]), (), ())}
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


def window_loads(problem: Problem, best: Partition, rows: np.ndarray, window: np.ndarray, s: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Every stage's memory and time for each row (``best`` with the ``window`` nodes moved
    between stages s - 1 and s): stages s - 1 and s evaluated, the earlier ones as in ``best``,
    the later ones as in ``best`` but for the waits of the tensors the window sends them (their
    producer's stage is all that changes for them)."""
    mem, tim = evaluate_many(problem, rows, first=s - 1, last=s)
    mem[:, :s - 1] = np.asarray(best.stage_mem[:s - 1])[None, :]
    tim[:, :s - 1] = np.asarray(best.stage_time[:s - 1])[None, :]
    mem[:, s + 1:] = np.asarray(best.stage_mem[s + 1:])[None, :]
    tim[:, s + 1:] = np.asarray(best.stage_time[s + 1:])[None, :]
    base = np.asarray(best.stage_of, dtype=np.int64)
    inside = np.zeros(problem.n, dtype=bool)
    inside[window] = True
    users: dict[int, set[int]] = {}  # window producer -> later stages that consume it
    for u, v in problem.edges:
        if inside[u] and base[v] > s:
            users.setdefault(int(u), set()).add(int(base[v]))
    for t in range(s + 1, problem.k):
        us = np.array(sorted(u for u, ts in users.items() if t in ts), dtype=np.int64)
        if not us.size:
            continue
        spec = problem.stages[t]
        waits = np.array([spec.wait_from(i) for i in range(problem.k)], dtype=np.float64)
        out = np.asarray(problem.variants[spec.variant].out, dtype=np.float64)[us]
        mem[:, t] += (waits[rows[:, us]] - waits[base[us]][None, :]) @ out
    return mem, tim


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
    mem, tim = window_loads(problem, best, rows, window, s)
    if problem.mem_cap is not None:
        over = mem.max(axis=1) > problem.mem_cap * (1 + 1e-9)
        mem[over], tim[over] = np.inf, np.inf
    prim = mem if problem.objective == "memory" else tim
    # leximax: the stages' primary values sorted from the largest, compared in that order, so a
    # move that lowers one of several stages tied at the top is taken (the next can lower the rest)
    ranked = -np.sort(-prim, axis=1)
    cur = -np.sort(-np.asarray(best.stage_mem if problem.objective == "memory" else best.stage_time))
    tol = 1e-9 * max(float(np.max(np.abs(cur))), 1e-300)
    for i in np.lexsort(ranked.T[::-1])[:8]:  # the best few: exact re-check
        diff = ranked[i] - cur
        big = np.flatnonzero(np.abs(diff) > tol)
        if not big.size or diff[big[0]] > 0:
            break
        stage_of = [int(x) for x in rows[i]]
        if idle_ok and not spread_ok(stage_work(problem, stage_of)):
            continue
        return make_partition(problem, stage_of, solver=best.solver.split("+")[0] + "+window",
                              status="heuristic", gap=math.nan)
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
    kept, kept_val = part, objective_values(problem, part)  # the best by the objective's own levels
    idle_ok = spread_ok(stage_work(problem, part.stage_of))
    stale = 0  # cuts tried in a row without a move: a full round of them ends the search
    s = 1
    while stale < problem.k - 1 and time.perf_counter() - t0 < budget_s:
        got = _move(problem, g, best, s, cap, span, pos, idle_ok)
        if got is None:
            stale += 1
        else:
            best, moves, stale = got, moves + 1, 0
            val = objective_values(problem, got)
            if val < kept_val:
                kept, kept_val = got, val
        s = s % (problem.k - 1) + 1
        sweeps += s == 1
    log.info("window refinement: %s -> %s in %d move(s), %d sweep(s), %.2f s", objective_values(problem, part)[0],
             kept_val[0], moves, sweeps, time.perf_counter() - t0)
    return kept
