"""The anytime split's last step where long-skip gradient waits raise its bottleneck.

[Note: wait refinement] The heuristics of [Note: anytime split] (the beam, the contracted and
coarse ideal DPs, the local walks) price a stage by its two cuts, so they optimise the problem
without its long-skip gradient waits ([Note: long-skip gradient waits]) and are judged with
them. Where the waits raise the best split's primary value (by more than ``WAIT_MATTERS``),
two searches that charge them follow, within ``budget_s``:

1. the search over chains of ideals with the waits ([Note: wait search]) on the greedily
   coarsened graph ([Note: coarse ideal DP]) with at most ``WAIT_CAP`` ideals, from the DP
   over one topological order of it: the optimum *with the waits* over the splits that keep
   every group whole (level 1 within ``WAIT_GAP`` of its bound);
2. the window refinement of the better split ([Note: window refinement]): each cut moved
   anywhere between its neighbours, every candidate scored with the waits by a batched
   ``evaluate()``.

Each split is judged on the whole problem and kept only when better, so the result is never
worse than the split it started from. On AmoebaNet-D (1024², K = 8, memory) the anytime split
goes from 1.031x to 1.014x of the proven optimum for about 5 s more CPU (docs/benchmarks.md).
A heuristic: the caller reports its gap against the assignment LP's bound.
"""

from __future__ import annotations

import logging
import math
import time

from nowdl.errors import InfeasibleError
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.skip_waits import has_waits, without_waits
from nowdl.partitioner.costs.structure import make_partition, objective_values, one_to_one
from nowdl.partitioner.exact.coarse_dp import coarse_lattice
from nowdl.partitioner.exact.coarse_groups import expand
from nowdl.partitioner.exact.order_dp import solve_dp
from nowdl.partitioner.exact.wait_search import solve_waits
from nowdl.partitioner.exact.window_dp import refine_cuts

__all__ = ["refine_waits", "waits_matter", "WAIT_CAP", "WAIT_GAP", "WAIT_MATTERS"]

log = logging.getLogger(__name__)

WAIT_CAP = 2200  # ideals of the coarse graph searched with its waits (AmoebaNet-D: 168 groups, ~2 s)
WAIT_GAP = 0.002  # level 1 of that search stops within this of its bound
WAIT_MATTERS = 1e-3  # the waits must raise the split's primary value by more than this share


def waits_matter(problem: Problem, part: Partition) -> bool:
    """Whether the long-skip waits raise ``part``'s primary value by more than ``WAIT_MATTERS``."""
    if not has_waits(problem):
        return False
    plain = without_waits(problem)
    lower = objective_values(plain, make_partition(plain, part.stage_of))[0]
    return objective_values(problem, part)[0] > lower * (1 + WAIT_MATTERS)


def _key(problem: Problem, part: Partition) -> tuple[bool, tuple[float, ...]]:
    cap = problem.mem_cap
    return (cap is not None and part.bottleneck_mem > cap * (1 + 1e-9), objective_values(problem, part))


def _coarse_waits(problem: Problem, time_limit: float) -> Partition | None:
    """Step 1 of [Note: wait refinement]: the coarse graph's optimum with its waits, mapped
    back (solver "coarse+waits"); None when no coarsening has few enough ideals, nothing fits,
    or the search ran out of ``time_limit``."""
    found = coarse_lattice(problem, WAIT_CAP)
    if found is None:
        return None
    small, groups, lat = found
    try:
        start = solve_dp(small, explain=False)
    except InfeasibleError:
        return None
    got = solve_waits(small, lat, start, gap=WAIT_GAP, time_limit=time_limit, exact_first=False)
    if got is None:
        return None
    stage_of = expand(got, groups, problem, exact=False).stage_of
    return make_partition(problem, stage_of, solver="coarse+waits", status="heuristic", gap=math.nan)


def refine_waits(problem: Problem, part: Partition, *, budget_s: float) -> Partition:
    """``part`` improved by the searches of [Note: wait refinement] that charge the long-skip
    waits, for about ``budget_s`` seconds; ``part`` itself when the waits do not raise its
    primary value, nothing improves, or the ranks hold two stages each (MASTER)."""
    if not one_to_one(problem) or problem.k < 3 or budget_s <= 0 or not waits_matter(problem, part):
        return part
    t0 = time.perf_counter()
    best = part
    coarse = _coarse_waits(problem, budget_s)
    if coarse is not None and _key(problem, coarse) < _key(problem, best):
        best = coarse
    left = budget_s - (time.perf_counter() - t0)
    if left > 0:
        best = refine_cuts(problem, best, budget_s=left)
    log.info("wait refinement: %.6g -> %.6g (coarse with waits %s) in %.2f s", objective_values(problem, part)[0],
             objective_values(problem, best)[0],
             "none" if coarse is None else f"{objective_values(problem, coarse)[0]:.6g}", time.perf_counter() - t0)
    return best if _key(problem, best) < _key(problem, part) else part
