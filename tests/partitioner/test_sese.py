"""Single-exit region contraction ([Note: SESE contraction]) and the anytime split ([Note:
anytime split]): the regions have one exit and are convex, the contracted problem prices every
split that keeps them whole as the original does, its DP is the optimum over those splits
(brute force), and the anytime split reports a true lower bound."""

from __future__ import annotations

import random

import pytest
from helpers.problems import all_splits, check_valid, close, random_problem

from nowdl.options import ANYTIME_S, EXACT_S, PlannerOptions
from nowdl.partitioner.costs.problem import Problem
from nowdl.partitioner.costs.structure import make_partition, objective_values
from nowdl.partitioner.exact.downsets import enumerate_ideals
from nowdl.partitioner.exact.ideal_dp import solve_ideals
from nowdl.partitioner.exact.sese import contract_regions, sese_regions, sese_split
from nowdl.partitioner.solver import SolveCache, solve


def _problem(seed: int, n: int, k: int) -> Problem:
    rng = random.Random(seed)
    return random_problem(rng, n, k, skips=0.6, objective=rng.choice(["memory", "compute"]))


def _reach(problem: Problem) -> list[set[int]]:
    succ: list[set[int]] = [set() for _ in range(problem.n)]
    for u, v in problem.edges:
        succ[u].add(v)
    out: list[set[int]] = [set() for _ in range(problem.n)]
    for v in reversed(range(problem.n)):  # random_problem numbers nodes topologically
        for w in succ[v]:
            out[v] |= {w} | out[w]
    return out


@pytest.mark.parametrize("seed", range(30))
def test_regions_have_one_exit_and_are_convex(seed: int) -> None:
    problem = _problem(seed, 30, 3)
    reach = _reach(problem)
    for x, members in sese_regions(problem):
        inside = set(members)
        assert x in inside and len(inside) == len(members)
        for u, v in problem.edges:  # only the exit's tensor leaves
            if u in inside and v not in inside:
                assert u == x, (x, members, (u, v))
        for a in inside:  # convex: a node between two members is a member
            for c in reach[a]:
                if c not in inside:
                    assert not (reach[c] & inside), (x, a, c)


@pytest.mark.parametrize("seed", range(40))
def test_contraction_covers_each_node_once_and_prices_splits_as_the_original(seed: int) -> None:
    problem = _problem(seed, 9, 2 + seed % 2)
    weight = [0.2, 0.5, 1.0][seed % 3]
    small, groups = contract_regions(problem, sese_regions(problem), weight)
    assert sorted(v for g in groups for v in g) == list(range(problem.n))
    where = {v: i for i, g in enumerate(groups) for v in g}
    whole = [a for a in all_splits(problem) if all(len({a[v] for v in g}) == 1 for g in groups)]
    for a in whole:  # the coarse evaluate() equals the original's on every split keeping groups whole
        coarse = make_partition(small, [a[g[0]] for g in groups])
        fine = make_partition(problem, list(a))
        assert coarse.stage_mem == pytest.approx(fine.stage_mem)
        assert coarse.stage_time == pytest.approx(fine.stage_time)
    lat = enumerate_ideals(small)
    assert lat is not None
    part = solve_ideals(small, lat)
    if not whole:  # one region holds every node: no split keeps it whole
        assert part is None
        return
    assert part is not None
    # the DP over the coarse ideals is exact over the splits that keep every region whole
    best = min(objective_values(problem, make_partition(problem, list(a)))[0] for a in whole)
    stage_of = [part.stage_of[where[v]] for v in range(problem.n)]
    fine_part = make_partition(problem, stage_of)
    check_valid(problem, fine_part)
    assert close(objective_values(problem, fine_part)[0], best)


@pytest.mark.parametrize("seed", range(12))
def test_sese_split_is_valid_and_not_below_the_exact_optimum(seed: int) -> None:
    problem = _problem(seed, 28, 3 + seed % 3)
    lat = enumerate_ideals(problem, cap=20000)
    assert lat is not None
    exact = solve_ideals(problem, lat)
    got = sese_split(problem, cap=200)
    assert exact is not None
    if got is None:
        return
    check_valid(problem, got)
    assert got.solver == "sese" and got.status == "heuristic"
    assert objective_values(problem, got)[0] >= objective_values(problem, exact)[0] * (1 - 1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_anytime_split_reports_a_true_lower_bound(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the full lattice hidden (a graph too wide for the exact DP), screening returns the
    anytime split: status feasible (or optimal at a zero gap), the gap measured against a lower
    bound that the exact optimum respects."""
    problem = _problem(100 + seed, 30, 3 + seed % 2)
    lat = enumerate_ideals(problem, cap=20000)
    assert lat is not None
    exact = solve_ideals(problem, lat)
    assert exact is not None
    monkeypatch.setattr(SolveCache, "lattice", lambda self, p, cap=0: None)
    part = solve(problem, ilp=False, time_limit=2.0)
    check_valid(problem, part)
    assert part.status in ("feasible", "optimal")
    value = objective_values(problem, part)[0]
    opt = objective_values(problem, exact)[0]
    assert value >= opt * (1 - 1e-9)
    assert value * (1 - part.gap) <= opt * (1 + 1e-6)  # the bound holds
    if part.status == "optimal":
        assert close(value, opt)


def test_planner_budget() -> None:
    assert PlannerOptions().budget == (ANYTIME_S, False)
    assert PlannerOptions(time_limit=7).budget == (7, True)
    assert PlannerOptions(exact=True).budget == (EXACT_S, True)
    assert PlannerOptions(exact=True, time_limit=20).budget == (20, True)
