"""A memory cap equal to a split's own memory: the exact DPs keep that split.

Their stage loads are differences of per-ideal (or per-prefix) sums, which round differently
from ``evaluate``'s sums: (0.1 + 0.1 + 0.1) - 0.1 is 0.20000000000000004, not 0.2. Compared
with the cap without a tolerance, the only split that balances the work was dropped, and the
DP reported its next best "optimal" (or refused the problem as infeasible)."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.problems import brute_force

from nowdl.partitioner.costs.problem import NodeVectors, Problem, StageSpec
from nowdl.partitioner.costs.structure import make_partition, objective_values
from nowdl.partitioner.exact.ideal_dp import enumerate_ideals, solve_ideals
from nowdl.partitioner.exact.order_dp import solve_dp
from nowdl.partitioner.solver import solve


def _chain(act: list[float], time: list[float], k: int = 2) -> Problem:
    n = len(act)
    zero = [0.0] * n
    return Problem(names=[f"n{i}" for i in range(n)], edges=[(i, i + 1) for i in range(n - 1)],
                   static=list(zero), variants={"plain": NodeVectors(act=act, time=time, workspace=zero, out=zero)},
                   stages=[StageSpec(inflight=1)] * k, objective="compute")


def _capped_at(problem: Problem, stage_of: list[int]) -> Problem:
    """``problem`` with its memory cap set to this split's memory (evaluate's sums)."""
    return dataclasses.replace(problem, mem_cap=make_partition(problem, stage_of).bottleneck_mem)


def _shrunk_hypothesis_example() -> Problem:
    """The case the property test of test_partition_properties.py found (13 nodes, 2 stages,
    compute, the cap at the block partition's memory): the solver said 2.0 "optimal" where
    the block partition has 1.0."""
    n = 13
    act = [0.0] * n
    act[0], act[6], act[7], act[12] = 1.0, 0.6351902661347398, 7.0, 0.2602404145026096
    time = [0.0] * n
    time[6] = time[7] = 1.0
    edges = sorted({(i, i + 1) for i in range(n - 1)} | {(0, v) for v in range(2, n) if v != 4})
    stages = [StageSpec(inflight=1), StageSpec(inflight=1, recv_held=2.0, send_held=1.0)]
    zero = [0.0] * n
    return Problem(names=[f"node{i}" for i in range(n)], edges=edges, static=[0.0] * 12 + [2.0],
                   variants={"plain": NodeVectors(act=act, time=time, workspace=zero, out=zero)},
                   stages=stages, objective="compute", mem_cap=9.26024041450261)


CASES = {
    # stage 1 = {n1, n2}: evaluate says 0.2, the difference of prefix sums 0.20000000000000004
    "three-node chain": (_capped_at(_chain([0.1, 0.1, 0.1], [1.0, 1.0, 0.0]), [0, 1, 1]), [0, 1, 1]),
    "shrunk hypothesis example": (_shrunk_hypothesis_example(), [0] * 7 + [1] * 6),
}


@pytest.mark.parametrize("coarsen", [True, False])
@pytest.mark.parametrize("name", sorted(CASES))
def test_solve_keeps_the_split_that_meets_the_cap_exactly(name: str, coarsen: bool) -> None:
    problem, want = CASES[name]
    ref = brute_force(problem)
    assert ref is not None and ref[1] == tuple(want), ref  # the split at the cap is the optimum
    part = solve(problem, time_limit=5, coarsen=coarsen)
    assert part.status == "optimal" and objective_values(problem, part) == ref[0], (part.stage_of, part.status)
    assert part.bottleneck_mem <= problem.mem_cap * (1 + 1e-9)  # type: ignore[operator]


@pytest.mark.parametrize("name", sorted(CASES))
def test_ideal_and_order_dps_keep_the_split_at_the_cap(name: str) -> None:
    problem, want = CASES[name]
    lat = enumerate_ideals(problem)
    assert lat is not None
    by_ideals = solve_ideals(problem, lat)
    assert by_ideals is not None and list(by_ideals.stage_of) == want and by_ideals.status == "optimal"
    assert list(solve_dp(problem).stage_of) == want  # the order 0..n-1 holds the split


def test_the_only_split_at_the_cap_is_not_refused() -> None:
    # 2 nodes, 2 stages: one split, its stage 1 needs 0.2 ((0.1 + 0.2) - 0.1 in the DP)
    problem = _capped_at(_chain([0.1, 0.2], [1.0, 1.0]), [0, 1])
    assert list(solve(problem, time_limit=5).stage_of) == [0, 1]
    assert list(solve_dp(problem).stage_of) == [0, 1]
