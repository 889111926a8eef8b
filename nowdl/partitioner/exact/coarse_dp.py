"""A heuristic split for wide graphs: the exact ideal DP on a greedily coarsened copy.

[Note: coarse ideal DP] A graph of parallel branches has too many ideals for the exact DP
([Note: ideal DP]), but merging it greedily (``coarsen(..., max_nodes=m)``: a node into its
single consumer, lightest pairs first) leaves far fewer: AmoebaNet-D (1,095 nodes) has 512
ideals at 100 groups, 1,493 at 150, 3,772 at 200. The DP over every ideal of the coarse graph
is the optimum over the splits that keep each group whole, and those include cuts the beam
([Note: ideal beam]) and the local search ([Note: local ideals]) do not reach: several
branches of a cell cut at once, at places whose frontier is not the thinnest of their size.
On AmoebaNet-D at K = 8 (memory) it gave 7.17 GiB where the beam gave 7.57 and the beam
walked downhill 7.34; walked downhill itself, 7.10 (HiGHS's optimum: 6.92). The node count
is the largest (binary search) whose coarse graph has at most ``COARSE_CAP`` ideals. A
heuristic: the MILP's start, never a bound.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.structure import make_partition, one_to_one
from nowdl.partitioner.exact.coarsen import coarsen
from nowdl.partitioner.exact.downsets import Lattice, enumerate_ideals
from nowdl.partitioner.exact.ideal_dp import solve_ideals
from nowdl.partitioner.exact.wait_weights import with_waits_folded

__all__ = ["coarse_split", "split_contracted", "densest_lattice", "COARSE_CAP"]

log = logging.getLogger(__name__)

COARSE_CAP = 1500  # ideals of the coarse graph at most (its DP: about 1 s on AmoebaNet-D)
_MIN_GROUPS = 8  # fewer groups than this (or than 2 K) cannot give a useful split


def _coarse_lattice(problem: Problem, cap: int) -> tuple[Problem, list[list[int]], Lattice] | None:
    """The greedy coarsening of ``problem`` with the most groups and at most ``cap`` ideals
    (binary search between the coarsest one the greedy merges reach and ``problem.n - 1``)."""
    small, groups = coarsen(problem, max_nodes=max(_MIN_GROUPS, 2 * problem.k), warn=False)
    lat = enumerate_ideals(small, cap) if small.n < problem.n else None
    if lat is None:
        return None
    return densest_lattice(lambda m: coarsen(problem, max_nodes=m, warn=False), small.n + 1, problem.n - 1, cap,
                           (small, groups, lat))


def densest_lattice(make: Callable[[int], tuple[Problem, list[list[int]]]], lo: int, hi: int, cap: int,
                    best: tuple[Problem, list[list[int]], Lattice] | None = None
                    ) -> tuple[Problem, list[list[int]], Lattice] | None:
    """The coarsening ``make(m)`` (at most ``m`` groups) with the most groups whose ideals number
    at most ``cap``, by binary search of ``m`` in [lo, hi]; ``best`` where none in it does."""
    while lo <= hi:
        mid = (lo + hi) // 2
        small, groups = make(mid)
        lat = enumerate_ideals(small, cap)
        if lat is None:
            hi = mid - 1
        else:
            best = (small, groups, lat)
            lo = max(mid, small.n) + 1
    return best


def split_contracted(problem: Problem, found: tuple[Problem, list[list[int]], Lattice] | None, solver: str,
                     t0: float) -> Partition | None:
    """The DP over the ideals of a contracted ``problem`` (``found``: the small problem, its
    groups and its lattice), mapped back with its waits folded ([Note: wait reweighting]):
    solver ``solver``, status "heuristic". None when ``found`` is, or nothing fits the cap."""
    if found is None:
        return None
    small, groups, lat = found
    part = solve_ideals(small, lat)
    if part is None:
        return None
    stage_of = with_waits_folded(problem, small, groups, lat, part)
    out = make_partition(problem, stage_of, solver=solver, status="heuristic", gap=float("nan"))
    log.info("%s split: %d nodes -> %d groups, %d ideals: %.6g / %.6g in %.2f s", solver, problem.n, small.n,
             lat.size, out.bottleneck_mem, out.bottleneck_time, time.perf_counter() - t0)
    return out


def coarse_split(problem: Problem, cap: int = COARSE_CAP) -> Partition | None:
    """The DP over the ideals of a greedily coarsened ``problem`` (see [Note: coarse ideal
    DP]), mapped back: solver "coarse", status "heuristic". None when the ranks hold two
    stages each (MASTER), when no coarsening has few enough ideals, or nothing fits the cap."""
    if not one_to_one(problem) or problem.k < 2:
        return None
    t0 = time.perf_counter()
    return split_contracted(problem, _coarse_lattice(problem, cap), "coarse", t0)
