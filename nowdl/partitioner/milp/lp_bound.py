"""A lower bound on the primary bottleneck from an LP that drops the DAG's edges.

[Note: assignment LP bound] Every node costs at least ``c[v,s]`` in the stage s it sits in
(memory: static + inflight_s x activations, the per-node part of ``evaluate()``; time: its
compute), and a rank's load is the sum over its stages. Letting each node spread fractionally
over the stages it may use (``structure.stage_ranges``), with no precedence, cut or workspace
term, gives the LP

    min T  s.t.  sum_s x[v,s] = 1 (every v),  sum_{s in rank r} sum_v c[v,s] x[v,s] <= T (every r),

whose optimum bounds every split from below. Under 1F1B the first stage holds K micro-batches
and the last one, so for memory this is much stronger than ``simple_lower_bound``'s average at
the cheapest factor (about total activations / H_K, H_K = 1 + 1/2 + ... + 1/K, against
total / K); for time it adds little. The MILP's own relaxation contains it, so it matters when
the MILP stops before reporting a bound (a large graph, little time left): the plan's gap is
then measured against it. Solved by HiGHS (highspy) in milliseconds for a few thousand nodes.
"""

from __future__ import annotations

import logging

import numpy as np

from nowdl.partitioner.costs.problem import Problem
from nowdl.partitioner.costs.structure import node_stage_costs, simple_lower_bound, stage_mult

__all__ = ["assignment_lower_bound", "memory_floor"]

log = logging.getLogger(__name__)


def assignment_lower_bound(problem: Problem) -> float:
    """max(``simple_lower_bound``, the LP of [Note: assignment LP bound]); the simple bound
    alone when HiGHS is missing or the LP does not solve."""
    cost = node_stage_costs(problem)
    simple = simple_lower_bound(problem, cost)
    try:
        import highspy
    except ImportError:  # pragma: no cover - highspy is a dependency
        return simple
    n, k = cost.shape
    scale = float(np.max(cost[np.isfinite(cost)], initial=0.0))
    if n == 0 or scale <= 0:
        return simple
    ranks = problem.rank_stages()
    vs, ss = np.nonzero(np.isfinite(cost))  # one column per (node, stage it may use), then T
    m = vs.size
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    inf = highspy.kHighsInf
    h.addVars(m + 1, np.zeros(m + 1), np.array([1.0] * m + [inf]))
    h.changeColsCost(1, np.array([m], dtype=np.int32), np.array([1.0]))
    order = np.argsort(vs, kind="stable")
    bounds = np.searchsorted(vs[order], np.arange(n + 1))
    for v in range(n):  # every node placed once
        cols = order[bounds[v]:bounds[v + 1]].astype(np.int32)
        h.addRow(1.0, 1.0, cols.size, cols, np.ones(cols.size))
    for r in ranks:  # each rank's load <= T
        mult = np.array([r.count(int(s)) for s in range(k)], dtype=np.float64)[ss]
        sel = np.flatnonzero(mult > 0)
        idx = np.append(sel, m).astype(np.int32)
        val = np.append(mult[sel] * cost[vs[sel], ss[sel]] / scale, -1.0)
        h.addRow(-inf, 0.0, idx.size, idx, val)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        log.debug("assignment LP bound: %s", h.modelStatusToString(h.getModelStatus()))
        return simple
    lp = float(h.getInfo().objective_function_value) * scale * (1 - 1e-7)  # solver tolerance
    return max(simple, lp)


def memory_floor(problem: Problem, limit: float, simple: float) -> float:
    """A lower bound on ``problem``'s bottleneck that exceeds ``limit`` whenever the assignment
    LP's does: ``simple`` (its ``simple_lower_bound``) when that already exceeds ``limit`` or the
    LP cannot, else the LP's. Placing each node wholly at its cheapest stage is an LP point, so
    the LP is at most simple x R x max(mult) / min(mult) (R ranks, mult_s ranks holding stage
    s): below ``limit`` there, the LP is not solved."""
    mult = stage_mult(problem)
    if simple > limit or min(mult) <= 0 or simple * len(problem.rank_stages()) * max(mult) / min(mult) <= limit:
        return simple
    return max(simple, assignment_lower_bound(problem))
