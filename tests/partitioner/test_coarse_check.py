"""Exact coarsening and stages of zero-cost nodes ([Note: empty stages] in coarse_check.py).

The regression: a 3-node chain whose zero-cost input, alone in stage 0, is the only good split
of 2 stages. Coarsening merges it into its consumer, and the DP on the 2 coarse nodes reported
its one split (3x the memory) as "optimal" (the case test_partition_properties.py found)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest
from helpers.problems import brute_force, random_problem

from nowdl.partitioner.chain.chain_dp import minmax_path
from nowdl.partitioner.costs.problem import NodeVectors, Problem, StageSpec
from nowdl.partitioner.costs.structure import objective_values
from nowdl.partitioner.exact.coarse_check import coarse_optimum_holds
from nowdl.partitioner.exact.coarsen import coarsen
from nowdl.partitioner.exact.ideal_dp import enumerate_ideals, solve_ideals
from nowdl.partitioner.solver import solve


def _input_alone(mem_cap: float | None = None) -> Problem:
    """input (no cost) -> conv (time 1, sends 1 byte) -> head (1 byte of activations); stage 1
    holds 2 copies of what it receives."""
    return Problem(names=["input", "conv", "head"], edges=[(0, 1), (1, 2)], static=[0.0] * 3,
                   variants={"plain": NodeVectors(act=[0.0, 0.0, 1.0], time=[0.0, 1.0, 0.0],
                                                  workspace=[0.0] * 3, out=[0.0, 1.0, 0.0])},
                   stages=[StageSpec(inflight=1), StageSpec(inflight=1, recv_held=2.0, send_held=1.0)],
                   objective="memory", mem_cap=mem_cap)


def test_the_input_alone_in_stage_0_is_found() -> None:
    problem = _input_alone()
    small, groups = coarsen(problem)
    assert groups == [[0, 1], [2]]  # the input merged into its consumer
    lat = enumerate_ideals(small)
    assert lat is not None
    coarse = solve_ideals(small, lat)
    assert coarse is not None and coarse.bottleneck_mem == 3.0  # the coarse graph's one split
    assert not coarse_optimum_holds(small, lat, coarse)
    part = solve(problem, time_limit=5)
    assert list(part.stage_of) == [0, 1, 1] and part.bottleneck_mem == 1.0 and part.status == "optimal"


def test_a_cap_only_the_unmerged_split_meets_is_not_refused() -> None:
    # the coarse graph has no split within 1 byte: that is no proof that the graph has none
    part = solve(_input_alone(mem_cap=1.0), time_limit=5)
    assert list(part.stage_of) == [0, 1, 1]


def test_a_long_chain_keeps_its_coarse_optimum() -> None:
    """conv, view, conv, view, ...: the views merge, and with 12 convs in 3 stages no stage of
    views alone can help, which the bound proves."""
    n = 24
    cost = [float(1 + i % 5) if i % 2 == 0 else 0.0 for i in range(n)]
    out = [float(1 + i % 3) if i % 2 == 0 else float(1 + (i - 1) % 3) for i in range(n)]
    problem = Problem(names=[f"n{i}" for i in range(n)], edges=[(i, i + 1) for i in range(n - 1)],
                      static=list(cost), variants={"plain": NodeVectors(act=list(cost), time=list(cost),
                                                                        workspace=[0.0] * n, out=out)},
                      stages=[StageSpec(inflight=3 - s) for s in range(3)], objective="memory")
    small, _ = coarsen(problem)
    lat = enumerate_ideals(small)
    assert lat is not None
    coarse = solve_ideals(small, lat)
    assert small.n < problem.n and coarse is not None and coarse_optimum_holds(small, lat, coarse)


@pytest.mark.parametrize("seed", range(6))
def test_empty_stage_relaxation_is_the_minmax_over_weak_chains(seed: int) -> None:
    """``minmax_path(..., empty=True)``: the min-max over paths that may stay at a state."""
    rng = random.Random(seed)
    n, k = 5, 3
    cost = np.array([[rng.uniform(1, 9) if j > i else np.inf for j in range(n)] for i in range(n)])
    ref = min((max([cost[a, b] for a, b in itertools.pairwise(path) if a != b], default=0.0), path)
              for mid in itertools.combinations_with_replacement(range(n), k - 1)
              for path in [(0, *mid, n - 1)] if list(path) == sorted(path))[0]
    got, path = minmax_path(lambda s, a, lo, hi: cost[a, lo:hi], k, [None] * (k - 1), 0, n - 1, n, empty=True)
    assert got == ref and path[0] == 0 and path[-1] == n - 1 and path == sorted(path)
    strict, _ = minmax_path(lambda s, a, lo, hi: cost[a, lo:hi], k, [None] * (k - 1), 0, n - 1, n)
    assert got <= strict


@pytest.mark.parametrize(("seed", "master"), [(538, False), (673, False), (691, False),
                                              (48, True), (117, True), (146, True)])
def test_an_optimal_split_is_brute_forces_on_few_nodes_per_stage(seed: int, master: bool) -> None:
    """Small DAGs (about one node per stage, half the costs zero) on which the split of the
    merged graph was reported "optimal" up to 1.9x above brute force's optimum (MASTER ranks:
    seeds 48, 117, 146)."""
    rng = random.Random(seed)
    k = rng.choice([3, 4] if master else [2, 3, 4])
    n = rng.randint(k, k + 4)
    objective = rng.choice(["memory", "compute"])
    problem = random_problem(rng, n, k, skips=0.5, zeros=0.5, master=master, objective=objective)
    assert coarsen(problem)[0].n < n  # something merged
    ref = brute_force(problem)
    assert ref is not None
    part = solve(problem, time_limit=5)
    assert part.status == "optimal"
    assert objective_values(problem, part)[0] == pytest.approx(ref[0][0], rel=1e-9, abs=1e-12)


def test_a_cap_on_the_problem_reaches_the_relaxed_dp() -> None:
    problem = dataclasses.replace(_input_alone(), mem_cap=0.5)  # nothing fits, merged or not
    small, _ = coarsen(problem)
    lat = enumerate_ideals(small)
    assert lat is not None and solve_ideals(small, lat) is None
    assert coarse_optimum_holds(small, lat, None)
