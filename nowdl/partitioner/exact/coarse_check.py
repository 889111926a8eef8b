"""Whether the ideal DP's optimum on an exactly coarsened graph is the original graph's.

[Note: empty stages] An exact merge ([Note: exact merges] in coarsen.py) moves a zero-cost
node to its anchor's stage, which never raises a stage's load, but it empties a stage that
held only such nodes, and a split fills all K stages. On small graphs the best splits can be
such ones: a zero-cost input alone in stage 0 of 2, while the coarse graph's one split puts
it with its consumer, whose tensor then crosses to stage 1 (3x the memory). So the coarse
optimum alone proves nothing. Every split of the original graph, its zero-cost nodes moved,
is a chain of coarse ideals in which a stage may stay empty (load 0), and no stage's load is
higher; the min-max DP over those chains (``minmax_path(..., empty=True)``) therefore bounds
every original split from below. Where the coarse optimum meets that bound on levels 1 and 2
of [Note: lexicographic levels] it is the original's optimum; otherwise ``solve`` solves the
original graph without the merges. (A stage of zero-cost nodes has no work, so level 3 never
prefers it.)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from nowdl.partitioner.chain.chain_dp import REL_TOL, minmax_path
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.skip_waits import without_waits
from nowdl.partitioner.costs.structure import make_partition, objective_values, one_to_one
from nowdl.partitioner.exact.downsets import Lattice
from nowdl.partitioner.exact.ideal_dp import IdealCosts

__all__ = ["coarse_optimum_holds", "solve_unmerged"]


def _meets(value: float, low: float) -> bool:
    """``value`` is at most ``low`` (to ``REL_TOL``, relative)."""
    return value - low <= REL_TOL * max(abs(value), abs(low))


def coarse_optimum_holds(problem: Problem, lat: Lattice, part: Partition | None, *,
                         bases: dict[tuple[object, ...], object] | None = None) -> bool:
    """Whether ``part``, the ideal DP's split of the coarse ``problem`` over all its ideals
    ``lat`` (None: no split fits the cap), is also optimal with stages allowed empty (see
    [Note: empty stages]), so optimal for the graph before the exact merges. False where no
    such bound is computed: ranks holding several stages (MASTER) or an incomplete lattice."""
    if not one_to_one(problem) or not lat.complete:
        return False
    costs = IdealCosts(problem, lat, per_stage_cap=problem.mem_cap, bases=bases)
    k, start, end, n = costs.k, costs.start, costs.end, lat.size
    if part is None:  # no coarse split fits the cap: does a relaxed one?
        low, _ = minmax_path(lambda s, a, lo, hi: costs.rows(s, a, lo, hi)[0], k, costs.allowed, start, end, n,
                             empty=True)
        return not np.isfinite(low)
    plain = without_waits(problem)  # what the DP optimises
    prim, sec = objective_values(plain, make_partition(plain, part.stage_of))
    p_lim = prim * (1 + REL_TOL)

    def window(s: int, a: np.ndarray) -> tuple[int, int]:
        return costs.window(a, p_lim)  # steps above the split's primary never help

    low, _ = minmax_path(lambda s, a, lo, hi: costs.rows(s, a, lo, hi)[0], k, costs.allowed, start, end, n,
                         window, empty=True)
    if not _meets(prim, low):
        return False

    def level2(s: int, a: np.ndarray, lo: int, hi: int) -> np.ndarray:
        p, q, _ = costs.rows(s, a, lo, hi)
        return np.where(p <= p_lim, q, np.inf)

    low2, _ = minmax_path(level2, k, costs.allowed, start, end, n, window, empty=True)
    return _meets(sec, low2)


def solve_unmerged(problem: Problem, lat: Lattice, part: Partition | None,
                   original: Callable[[], Lattice | None], *,
                   bases: dict[tuple[object, ...], object] | None = None) -> bool:
    """Whether ``solve`` should solve the graph before the exact merges instead of the coarse
    ``problem`` (ideals ``lat``, the DP's split ``part``): where ``coarse_optimum_holds`` does
    not prove the coarse split, and for MASTER ranks where the original graph's ideals
    (``original()``) are few enough for the DP."""
    if one_to_one(problem) and lat.complete:
        return not coarse_optimum_holds(problem, lat, part, bases=bases)
    return original() is not None
