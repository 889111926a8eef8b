"""Narrowing every node's stage range from a bound on the stages' loads (the MILP's windows)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

from nowdl.partitioner.costs.problem import Problem
from nowdl.partitioner.costs.structure import topological_order

__all__ = ["load_windows"]

log = logging.getLogger(__name__)


def _closure(problem: Problem, order: Sequence[int]) -> np.ndarray:
    """Boolean matrix A[v, a] = a is v or an ancestor of v."""
    n = problem.n
    preds: list[list[int]] = [[] for _ in range(n)]
    for u, v in problem.edges:
        preds[v].append(u)
    anc = np.zeros((n, n), dtype=bool)
    for v in order:
        for u in preds[v]:
            anc[v] |= anc[u]
        anc[v, v] = True
    return anc


def load_windows(
    problem: Problem,
    lo: Sequence[int],
    hi: Sequence[int],
    allowed: Sequence[Sequence[bool]],
    *,
    mem_ub: float | None = None,
    time_ub: float | None = None,
) -> tuple[list[int], list[int]]:
    """Narrow every node's stage range using upper bounds on any stage's memory/time.

    If v sits in stage j, v and all its ancestors sit in stages 0..j, whose loads add up to
    at most (j+1) * bound, and each of those nodes costs at least its cheapest load among
    the stages it may use there (boundary tensors and workspace only add). So j is at least
    the first stage where the ancestors' cheapest total fits; descendants bound j from
    above the same way. Every assignment whose stage loads stay within the bounds (every
    optimum, when a bound is the value of a known solution) lies inside the new ranges.

    Args:
        problem: the problem.
        lo: earliest stages (``dp.stage_ranges``).
        hi: latest stages.
        allowed: allowed[v][s] (pins and tileability).
        mem_ub: bound on any stage's memory (a cap or a known solution's bottleneck).
        time_ub: bound on any stage's time.

    Returns:
        (lo, hi) narrowed; unchanged when no bound is given or the bounds contradict.
    """
    n, k = problem.n, problem.k
    lo2, hi2 = list(lo), list(hi)
    bounds: list[tuple[float, np.ndarray]] = []
    for ub, kind in ((mem_ub, "mem"), (time_ub, "time")):
        if ub is None or not math.isfinite(ub):
            continue
        cost = np.full((k, n), np.inf)
        for s, spec in enumerate(problem.stages):
            vec = problem.variants[spec.variant]
            if kind == "mem":
                cost[s] = np.asarray(problem.static, float) + spec.inflight * np.asarray(
                    vec.act, float
                )
            else:
                cost[s] = np.asarray(vec.time, float)
        ok = np.array(allowed, dtype=bool).T  # k x n
        cost = np.where(ok, cost, np.inf)
        bounds.append((ub * (1 + 1e-9) + 1e-300, cost))
    if not bounds:
        return lo2, hi2
    order = topological_order(problem)
    anc = _closure(problem, order).astype(np.float64)
    desc = anc.T
    for ub, cost in bounds:
        pre = np.minimum.accumulate(cost, axis=0)  # cheapest over stages 0..j
        suf = np.minimum.accumulate(cost[::-1], axis=0)[::-1]  # over stages j..K-1
        pre = np.where(np.isfinite(pre), pre, 0.0)
        suf = np.where(np.isfinite(suf), suf, 0.0)
        anc_mass = pre @ anc.T  # [j, v] = sum over ancestors of v
        desc_mass = suf @ desc.T
        for v in range(n):
            fits_lo = [j for j in range(k) if anc_mass[j, v] <= (j + 1) * ub]
            fits_hi = [j for j in range(k) if desc_mass[j, v] <= (k - j) * ub]
            if fits_lo:
                lo2[v] = max(lo2[v], fits_lo[0])
            if fits_hi:
                hi2[v] = min(hi2[v], fits_hi[-1])
    # keep the ranges consistent with precedence and allowed stages
    for _ in range(2 * n * k + 1):  # a fixpoint: every pass that changes moves a bound
        changed = False
        for u, w in problem.edges:
            if lo2[w] < lo2[u]:
                lo2[w] = lo2[u]
                changed = True
            if hi2[u] > hi2[w]:
                hi2[u] = hi2[w]
                changed = True
        for v in range(n):
            while lo2[v] < k and not allowed[v][lo2[v]]:
                lo2[v] += 1
                changed = True
            while hi2[v] >= 0 and not allowed[v][hi2[v]]:
                hi2[v] -= 1
                changed = True
        for grp in problem.tied:  # one weight's users share a stage, so their windows too
            a, b = max(lo2[v] for v in grp), min(hi2[v] for v in grp)
            for v in grp:
                if (lo2[v], hi2[v]) != (a, b):
                    lo2[v], hi2[v] = a, b
                    changed = True
        if not changed:
            break
    if any(a > b for a, b in zip(lo2, hi2, strict=True)):
        log.debug("ilp: load windows contradict (bound below the optimum?); not narrowing")
        return list(lo), list(hi)
    return lo2, hi2
