"""The partitioning MILP against brute force, the cost model, and its contract."""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time

import pulp
import pytest
from helpers.problems import (
    SOLVERS,
    all_splits,
    brute_force,
    check_levels,
    check_valid,
    close,
    lex_reference,
    random_problem,
    resnet_like,
)

from nowdl.errors import InfeasibleError
from nowdl.partitioner.costs.problem import NodeVectors, Problem, StageSpec
from nowdl.partitioner.costs.structure import make_partition, objective_values, simple_lower_bound
from nowdl.partitioner.exact.order_dp import solve_dp
from nowdl.partitioner.milp.lp_bound import assignment_lower_bound
from nowdl.partitioner.milp.solve import build_ilp, solve_ilp

log = logging.getLogger(__name__)


def _case(seed: int) -> Problem:
    rng = random.Random(seed)
    n = rng.randint(2, 7)
    k = rng.choice([2, 3]) if n > 3 else rng.choice([2, 3])
    p = random_problem(
        rng, n, k, skips=rng.choice([0.0, 0.4]), spatial=seed % 3 == 0, master=seed % 4 == 1,
        objective="memory" if seed % 2 == 0 else "compute",
    )
    if seed % 5 in (2, 3):  # a memory cap around the smallest achievable memory
        relaxed = brute_force(dataclasses.replace(p, objective="memory"))
        if relaxed is not None:  # None: structurally infeasible (tested as such below)
            p = dataclasses.replace(p, mem_cap=relaxed[0][0] * rng.uniform(1.0, 1.25))
    if seed % 7 == 0:
        p = dataclasses.replace(p, pinned={0: 0})
    return p


@pytest.mark.parametrize("seed", range(36))
def test_ilp_matches_brute_force(seed: int) -> None:
    problem = _case(seed)
    best = brute_force(problem)
    solvers = SOLVERS if seed % 2 == 0 else SOLVERS[:1]  # CBC on half (it is slower)
    for solver in solvers:
        if best is None:  # e.g. a pin on a spatial stage for a non-tileable node
            with pytest.raises(InfeasibleError):
                solve_ilp(problem, solver=solver)
            continue
        part = solve_ilp(problem, solver=solver, time_limit=20)
        check_valid(problem, part)
        assert part.status == "optimal", (solver, part.status)
        ref = lex_reference(problem, all_splits(problem))
        assert ref is not None and close(ref.primary, best[0][0])
        check_levels(problem, part, ref)


@pytest.mark.parametrize("solver", SOLVERS)
def test_both_solvers_available_and_named(solver: str) -> None:
    p = _case(4)
    part = solve_ilp(p, solver=solver)
    assert part.solver == solver


@pytest.mark.parametrize("seed", range(6))
def test_valid_on_larger_random_problems(seed: int) -> None:
    rng = random.Random(100 + seed)
    p = random_problem(rng, 50, rng.choice([3, 4, 6]), spatial=seed % 2 == 0,
                       master=seed % 3 == 2, objective=rng.choice(["memory", "compute"]))
    p = dataclasses.replace(p, pinned={p.n - 1: p.k - 1})
    free = solve_ilp(p, time_limit=1)  # random costs make hard instances: may stop early
    check_valid(p, free)
    assert free.status in ("optimal", "feasible")
    capped = dataclasses.replace(p, mem_cap=free.bottleneck_mem * 1.1)
    part = solve_ilp(capped, time_limit=1)
    check_valid(capped, part)
    try:
        dp = solve_dp(capped)
    except InfeasibleError:  # no contiguous split of the order fits the cap: the ILP found one
        return
    assert objective_values(capped, part)[0] <= objective_values(capped, dp)[0] * (1 + 1e-9)


@pytest.mark.parametrize("seed", [1, 2, 4, 5, 6, 8, 10, 11])  # feasible cases (3, 9 are not)
def test_solver_objective_equals_evaluate(seed: int) -> None:
    p = _case(seed)
    model = build_ilp(p)
    model.prob.solve(pulp.HiGHS(msg=False, gapRel=0, threads=1) if "highs" in SOLVERS
                     else pulp.PULP_CBC_CMD(msg=False, gapRel=0))
    part = make_partition(p, model.assignment())
    if p.objective == "memory":
        assert close(model.t_mem.varValue * model.mem_scale, part.bottleneck_mem, 1e-6)
    else:
        assert close(model.t_time.varValue * model.time_scale, part.bottleneck_time, 1e-6)
    # every rank expression, at the variables the assignment implies, is evaluate()'s load
    model.set_values(p, part.stage_of)
    for r, expr in enumerate(model.rank_mem):
        assert close(pulp.value(expr) * model.mem_scale, part.rank_mem[r], 1e-9)
    for r, expr in enumerate(model.rank_time):
        assert close(pulp.value(expr) * model.time_scale, part.rank_time[r], 1e-9)


def test_infeasible_cap_message_has_cap_and_minimum() -> None:
    p = _case(2)
    best = brute_force(dataclasses.replace(p, objective="memory"))
    assert best is not None
    need = best[0][0]
    cap = need * 0.8
    with pytest.raises(InfeasibleError) as err:
        solve_ilp(dataclasses.replace(p, mem_cap=cap))
    msg = str(err.value)
    assert f"{cap:.6g}" in msg
    assert f"{need:.6g}" in msg
    assert "at least" in msg and "GPUs" in msg


def test_structurally_infeasible_placement() -> None:
    rng = random.Random(3)
    p = random_problem(rng, 5, 2, spatial=True)
    # a non-tileable node pinned to the spatial stage 0
    p = dataclasses.replace(p, tileable=[False] + [True] * 4, pinned={0: 0})
    with pytest.raises(InfeasibleError, match="node0"):
        solve_ilp(p)
    # the output must come before its input
    q = dataclasses.replace(random_problem(rng, 4, 3), edges=[(0, 1), (1, 2), (2, 3)],
                            pinned={0: 2, 3: 1})
    with pytest.raises(InfeasibleError, match="pinned"):
        solve_ilp(q)


def test_deterministic() -> None:
    rng = random.Random(7)
    p = random_problem(rng, 60, 4, objective="compute")
    a = solve_ilp(p)
    b = solve_ilp(p)
    assert a.stage_of == b.stage_of
    assert a.rank_mem == b.rank_mem


@pytest.mark.parametrize("seed", range(10))
def test_ilp_never_worse_than_dp(seed: int) -> None:
    rng = random.Random(200 + seed)
    p = random_problem(rng, rng.randint(8, 30), rng.randint(2, 5), skips=0.5,
                       objective=rng.choice(["memory", "compute"]))
    ilp = solve_ilp(p)
    dp = solve_dp(p)
    assert objective_values(p, ilp)[0] <= objective_values(p, dp)[0] * (1 + 1e-9)


def test_time_limited_run_reports_feasible() -> None:
    p = resnet_like(blocks=40, k=8)
    part = solve_ilp(p, time_limit=0.01)
    check_valid(p, part)
    assert part.status == "feasible"
    assert isinstance(part.gap, float)


def test_lp_names_are_readable(tmp_path: object) -> None:
    p = dataclasses.replace(_case(2), mem_cap=1e9)
    model = build_ilp(p)
    path = f"{tmp_path}/model.lp"
    model.prob.writeLP(path)
    text = open(path).read()
    assert "mem_cap_r0" in text and "prec_node" in text and "T_mem" in text


def test_bad_arguments() -> None:
    p = _case(1)
    with pytest.raises(ValueError):
        solve_ilp(p, time_limit=0)
    with pytest.raises(ValueError):
        solve_ilp(p, solver="gurobi")
    with pytest.raises(ValueError):
        solve_ilp(dataclasses.replace(p, objective="speed"))


def test_performance_smoke_resnet_500() -> None:
    """Not a timed assertion: a 500-node ResNet-like graph with K=8 solves (time logged)."""
    p = resnet_like(blocks=71, k=8)
    assert 495 <= p.n <= 505
    t0 = time.perf_counter()
    part = solve_ilp(p, time_limit=60)
    log.info("resnet-like n=%d K=8: %s in %.2f s", p.n, part.status, time.perf_counter() - t0)
    check_valid(p, part)
    assert part.status in ("optimal", "feasible")
    assert math.isfinite(part.bottleneck_mem)


def test_no_better_split_in_time_keeps_the_start_with_the_solvers_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """When the MILP, narrowed by the start's value, finds nothing in its time, the start split
    comes back with the gap to the solver's lower bound (not an unknown gap)."""
    import nowdl.partitioner.milp.solve as ilp_mod
    from nowdl.partitioner.milp.run import Run

    p = resnet_like(blocks=6, k=3, seed=1)
    start = solve_dp(p)
    value = objective_values(p, start)[0]
    seen: dict[str, float] = {}

    def no_solution(name: str, model: object, left: float, threads: int, gap: float, warm: bool) -> Run:
        scale = model.mem_scale if p.objective == "memory" else model.time_scale  # type: ignore[attr-defined]
        seen["scale"] = scale
        return Run("none", math.nan, 0.01, "Time limit reached", bound=0.9 * value / scale)

    monkeypatch.setattr(ilp_mod, "run_model", no_solution)
    part = solve_ilp(p, time_limit=5, start=start)
    assert seen and part.stage_of == start.stage_of
    assert part.status == "feasible" and part.gap == pytest.approx(0.1)
    assert "fallback" in part.solver

    def no_bound(*args: object) -> Run:
        return Run("none", math.nan, 0.01, "Time limit reached")

    monkeypatch.setattr(ilp_mod, "run_model", no_bound)
    part = solve_ilp(p, time_limit=5, start=start)
    # no bound from the solver: the assignment LP bounds the optimum (never an unknown gap)
    lower = assignment_lower_bound(p)
    assert 0 < lower <= value
    assert part.status == "feasible" and part.gap == pytest.approx(1 - lower / value)


@pytest.mark.parametrize("seed", range(12))
def test_simple_lower_bound_is_below_every_split(seed: int) -> None:
    rng = random.Random(seed)
    p = random_problem(rng, rng.randint(3, 7), rng.randint(2, 3), master=seed % 3 == 0,
                       spatial=seed % 4 == 0, objective=rng.choice(["memory", "compute"]))
    splits = all_splits(p)
    if not splits:
        pytest.skip("no feasible split")
    best = min(objective_values(p, make_partition(p, a))[0] for a in splits)
    assert simple_lower_bound(p) <= best * (1 + 1e-12)
    assert simple_lower_bound(p) <= assignment_lower_bound(p) <= best * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(8))
def test_memory_floor_solves_the_lp_only_when_it_could_pass_the_limit(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import nowdl.partitioner.milp.lp_bound as lpb

    rng = random.Random(seed)
    p = random_problem(rng, rng.randint(4, 9), rng.randint(2, 4), master=seed % 2 == 0)
    simple, lp = simple_lower_bound(p), assignment_lower_bound(p)
    solved: list[int] = []
    real = lpb.assignment_lower_bound
    monkeypatch.setattr(lpb, "assignment_lower_bound", lambda q: solved.append(1) or real(q))
    for limit in (0.5 * simple, simple, 0.5 * (simple + lp), lp * 1.0001, 100 * lp):
        floor = lpb.memory_floor(p, limit, simple)
        assert simple <= floor <= lp * (1 + 1e-12)
        assert (floor > limit) == (lp > limit), (limit, simple, lp, floor)
    assert len(solved) < 5  # 0.5 x simple is passed already, 100 x lp past the LP's ceiling


def test_assignment_bound_is_stronger_than_the_simple_one_under_1f1b() -> None:
    """Stages holding K, K-1, ..., 1 micro-batches: the LP charges the early stages' factors
    (about total / H_K) where the simple bound takes the cheapest (total / K)."""
    k, n = 4, 8  # all_splits: 4^8 assignments
    p = Problem(names=[f"n{i}" for i in range(n)], edges=[(i, i + 1) for i in range(n - 1)],
                static=[0.0] * n, variants={"plain": NodeVectors(act=[1.0] * n, time=[1.0] * n,
                                                                  workspace=[0.0] * n, out=[0.0] * n)},
                stages=[StageSpec(inflight=k - s) for s in range(k)])
    h = sum(1 / i for i in range(1, k + 1))
    assert simple_lower_bound(p) == pytest.approx(n / k)
    assert assignment_lower_bound(p) == pytest.approx(n / h, rel=1e-6)
    best = min(objective_values(p, make_partition(p, a))[0] for a in all_splits(p))
    assert assignment_lower_bound(p) <= best * (1 + 1e-9)


def test_time_limited_gap_uses_the_better_of_the_solvers_and_the_assignment_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A run stopped with a split reports its gap against max(solver's bound, assignment LP
    bound): a solver that has not finished its root LP says ~100%, the LP says less."""
    import nowdl.partitioner.milp.solve as ilp_mod
    from nowdl.partitioner.milp.run import Run

    p = resnet_like(blocks=6, k=3, seed=1)
    start = solve_dp(p)
    value = objective_values(p, start)[0]
    lower = assignment_lower_bound(p)
    for bound_rel, want in ((0.0, 1 - lower / value), (0.99, 0.01)):
        def stopped(name: str, model: object, left: float, threads: int, gap: float, warm: bool,
                    rel: float = bound_rel) -> Run:
            scale = model.mem_scale if p.objective == "memory" else model.time_scale  # type: ignore[attr-defined]
            return Run("feasible", 0.99, 0.01, "Time limit reached", bound=rel * value / scale)

        monkeypatch.setattr(ilp_mod, "run_model", stopped)
        part = solve_ilp(p, time_limit=5, start=start)
        assert part.stage_of == start.stage_of and part.status == "feasible"
        assert part.gap == pytest.approx(want), (bound_rel, part.gap, want)
