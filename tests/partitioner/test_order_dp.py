"""The DP over a topological order against brute force over cut points."""

from __future__ import annotations

import dataclasses
import itertools
import random
import re

import pytest
from helpers.problems import (
    brute_force,
    check_levels,
    check_valid,
    close,
    feasible,
    lex_reference,
    random_problem,
)

from nowdl.errors import InfeasibleError
from nowdl.partitioner.costs.problem import NodeVectors, Problem, StageSpec
from nowdl.partitioner.costs.structure import make_partition, objective_values, topological_order
from nowdl.partitioner.exact.order_dp import solve_dp


def order_splits(problem: Problem, order: list[int]) -> list[tuple[int, ...]]:
    """All feasible contiguous splits of ``order`` into K stages."""
    n, k = problem.n, problem.k
    out = []
    for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1):
        bounds = [0, *cuts, n]
        stage_of = [0] * n
        for s in range(k):
            for i in range(bounds[s], bounds[s + 1]):
                stage_of[order[i]] = s
        if feasible(problem, stage_of):
            out.append(tuple(stage_of))
    return out


def brute_cuts(problem: Problem, order: list[int]) -> tuple[float, float] | None:
    """Lexicographic (primary, secondary) optimum over contiguous splits of ``order``."""
    keys = [objective_values(problem, make_partition(problem, a)) for a in order_splits(problem, order)]
    return min(keys) if keys else None


def random_order(problem: Problem, rng: random.Random) -> list[int]:
    """A random topological order."""
    preds = {v: {u for u, w in problem.edges if w == v} for v in range(problem.n)}
    done: list[int] = []
    left = set(range(problem.n))
    while left:
        ready = sorted(v for v in left if preds[v] <= set(done))
        v = rng.choice(ready)
        done.append(v)
        left.remove(v)
    return done


@pytest.mark.parametrize("seed", range(30))
def test_dp_optimal_over_fixed_order(seed: int) -> None:
    rng = random.Random(seed)
    p = random_problem(rng, rng.randint(3, 10), rng.randint(2, 4), skips=0.4,
                       spatial=seed % 3 == 0, objective=rng.choice(["memory", "compute"]))
    if seed % 4 == 1:
        p = dataclasses.replace(p, pinned={p.n - 1: p.k - 1})
    order = random_order(p, rng) if seed % 2 else topological_order(p)
    if seed % 5 == 2:
        relaxed = brute_cuts(dataclasses.replace(p, objective="memory"), order)
        if relaxed is not None:
            p = dataclasses.replace(p, mem_cap=relaxed[0] * rng.uniform(1.0, 1.3))
    best = brute_cuts(p, order)
    if best is None:
        with pytest.raises(InfeasibleError):
            solve_dp(p, order)
        return
    part = solve_dp(p, order)
    check_valid(p, part)
    assert part.status == "optimal" and part.solver == "dp"
    ref = lex_reference(p, order_splits(p, order))
    assert ref is not None and close(ref.primary, best[0], 1e-9)
    check_levels(p, part, ref, 1e-9)
    # the stages are contiguous segments of the order
    pos = [part.stage_of[v] for v in order]
    assert pos == sorted(pos)


@pytest.mark.parametrize("seed", range(6))
def test_dp_master_pairing_is_a_valid_heuristic(seed: int) -> None:
    rng = random.Random(50 + seed)
    p = random_problem(rng, 7, 4, master=True)
    part = solve_dp(p)
    check_valid(p, part)
    assert part.status == "heuristic"
    assert part.rank_mem == [part.stage_mem[r] + part.stage_mem[3 - r] for r in range(2)]
    best = brute_force(p)
    assert best is not None
    assert objective_values(p, part)[0] >= best[0][0] * (1 - 1e-9)


def test_dp_rejects_bad_orders_and_reports_cap() -> None:
    rng = random.Random(1)
    p = random_problem(rng, 6, 2, skips=0.0)
    with pytest.raises(ValueError, match="not topological"):
        solve_dp(p, list(reversed(range(p.n))))
    with pytest.raises(ValueError, match="permutation"):
        solve_dp(p, [0, 1, 2])
    need = solve_dp(p).bottleneck_mem
    with pytest.raises(InfeasibleError, match=f"{need:.6g}"):
        solve_dp(dataclasses.replace(p, mem_cap=need * 0.5, objective="compute"))


def test_dp_cap_advice_keeps_tied_weights() -> None:
    """The "raise the cap" advice solves the problem as given, tied groups included: the cap it
    names fits."""
    n = 4
    zeros = [0.0] * n
    p = Problem(
        names=[f"n{v}" for v in range(n)],
        edges=[(v, v + 1) for v in range(n - 1)],
        static=[10.0] * n,
        variants={"plain": NodeVectors(act=zeros, time=[1.0] * n, workspace=zeros, out=zeros)},
        stages=[StageSpec(), StageSpec()],
        mem_cap=15.0,
        tied=[[0, 1, 2]],  # one weight used by nodes 0-2: they share a stage (untied, 20 would fit)
    )
    with pytest.raises(InfeasibleError, match="raise the cap") as err:
        solve_dp(p)
    advice = re.search(r"raise the cap to at least (\S+) bytes", str(err.value))
    assert advice is not None, str(err.value)
    advised = float(advice.group(1))
    assert advised == 30.0
    part = solve_dp(dataclasses.replace(p, mem_cap=advised))
    assert part.bottleneck_mem <= advised and part.stage_of[:3] == [0, 0, 0]


def test_dp_large_chain_is_fast_enough() -> None:
    rng = random.Random(2)
    p = random_problem(rng, 800, 8, skips=0.05)
    part = solve_dp(p)
    check_valid(p, part)
