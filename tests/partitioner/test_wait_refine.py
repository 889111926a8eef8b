"""The searches that charge the long-skip waits ([Note: wait refinement], [Note: window
refinement]): the batched evaluate equals ``evaluate``, the refined splits are valid and never
worse than their start with the waits charged, and on some problem they improve it."""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers.problems import check_valid, random_problem, with_skip_waits

from nowdl.partitioner.costs.problem import Problem, evaluate
from nowdl.partitioner.costs.structure import make_partition, objective_values, topological_order
from nowdl.partitioner.exact.order_dp import solve_dp
from nowdl.partitioner.exact.wait_refine import refine_waits, refine_winner, waits_matter
from nowdl.partitioner.exact.window_dp import evaluate_many, refine_cuts, window_loads
from nowdl.partitioner.solver import with_lower_bound


def _problem(seed: int, waits: bool = True) -> Problem:
    rng = random.Random(seed)
    problem = random_problem(rng, rng.randint(24, 40), rng.randint(3, 5), skips=0.6, objective="memory")
    return with_skip_waits(problem) if waits else problem


def _random_split(problem: Problem, rng: random.Random) -> list[int]:
    """A convex split: a topological order cut at K - 1 random places."""
    order = topological_order(problem)
    cuts = sorted(rng.sample(range(1, problem.n), problem.k - 1))
    stage_of = [0] * problem.n
    for i, v in enumerate(order):
        stage_of[v] = sum(1 for c in cuts if i >= c)
    return stage_of


@pytest.mark.parametrize("seed", range(6))
def test_evaluate_many_equals_evaluate(seed: int) -> None:
    problem = _problem(seed)
    rng = random.Random(seed)
    rows = [_random_split(problem, rng) for _ in range(5)]
    mem, tim = evaluate_many(problem, np.asarray(rows))
    for i, row in enumerate(rows):
        m, t = evaluate(problem, row)
        assert mem[i] == pytest.approx(m)
        assert tim[i] == pytest.approx(t)
    first = problem.k - 2
    mem2, _ = evaluate_many(problem, np.asarray(rows), first=first)
    assert mem2[:, first:] == pytest.approx(mem[:, first:])


@pytest.mark.parametrize("seed", range(10))
def test_window_loads_equal_evaluate(seed: int) -> None:
    """One cut moved: stages s - 1 and s evaluated, the later ones' waits updated, = evaluate."""
    problem = _problem(seed)
    rng = random.Random(seed)
    stage_of = _random_split(problem, rng)
    best = make_partition(problem, stage_of)
    s = rng.randint(1, problem.k - 1)
    window = [v for v in topological_order(problem) if stage_of[v] in (s - 1, s)]
    rows = []
    for _ in range(6):  # the window's topological prefixes go to stage s - 1
        cut = rng.randint(0, len(window))
        row = list(stage_of)
        for i, v in enumerate(window):
            row[v] = s - 1 if i < cut else s
        rows.append(row)
    mem, tim = window_loads(problem, best, np.asarray(rows), np.asarray(window), s)
    for i, row in enumerate(rows):
        m, t = evaluate(problem, row)
        assert mem[i] == pytest.approx(m)
        assert tim[i] == pytest.approx(t)


@pytest.mark.parametrize("seed", range(8))
def test_refined_splits_are_valid_and_never_worse(seed: int) -> None:
    problem = _problem(seed)
    start = make_partition(problem, _random_split(problem, random.Random(seed)))
    for got in (refine_cuts(problem, start, budget_s=5.0), refine_waits(problem, start, budget_s=5.0)):
        check_valid(problem, got)
        assert objective_values(problem, got) <= objective_values(problem, start)


def test_without_waits_refine_waits_keeps_the_split() -> None:
    problem = _problem(2, waits=False)
    start = solve_dp(problem, explain=False)
    assert not waits_matter(problem, start)
    assert refine_waits(problem, start, budget_s=5.0) is start


def test_refinement_improves_some_seed() -> None:
    """Not a no-op: from the DP over one order (blind to the waits) some seed gets a better split."""
    for seed in range(30):
        problem = _problem(seed)
        start = solve_dp(problem, explain=False)
        if not waits_matter(problem, start):
            continue
        got = refine_waits(problem, start, budget_s=5.0)
        if objective_values(problem, got) < objective_values(problem, start):
            return
    pytest.fail("no seed improved")


def test_refine_winner_improves_with_the_bound_kept() -> None:
    """The anytime winner's refinement ([Note: winner refinement]): a valid split strictly
    better than its start where it returns one, its gap measured against the start's bound,
    and None where the waits do not raise the start or no time is given."""
    improved = 0
    for seed in range(30):
        problem = _problem(seed)
        start = with_lower_bound(problem, solve_dp(problem, explain=False))  # the assignment LP's bound
        got = refine_winner(problem, start, budget_s=5.0)
        if got is None:
            continue
        improved += 1
        check_valid(problem, got)
        old, new = objective_values(problem, start)[0], objective_values(problem, got)[0]
        assert new < old
        assert got.status == "feasible"
        assert got.gap == pytest.approx(1 - old * (1 - start.gap) / new)
        assert refine_winner(problem, start, budget_s=0.0) is None
    assert improved, "no seed improved"
    plain = _problem(2, waits=False)
    assert refine_winner(plain, solve_dp(plain, explain=False), budget_s=5.0) is None
