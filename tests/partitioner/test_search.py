"""The configuration search (bounds, pruning) and the exact solvers behind it (ideal DP, MASTER)."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from helpers.problems import (
    all_splits,
    check_levels,
    check_valid,
    close,
    feasible,
    lex_reference,
    random_problem,
    resnet_like,
)

from nowdl.errors import InfeasibleError
from nowdl.models import resnet
from nowdl.partitioner.config.candidate import Candidate, PlanRequest, enumerate_candidates
from nowdl.partitioner.costs.costmodel import Costs, predict_step
from nowdl.partitioner.costs.no_idle import idle_stages
from nowdl.partitioner.costs.problem import NodeVectors, Problem, StageSpec
from nowdl.partitioner.costs.structure import make_partition, objective_values
from nowdl.partitioner.costs.tied import tied_nodes
from nowdl.partitioner.exact.ideal_dp import IdealCosts, beam_ideals, enumerate_ideals, solve_ideals
from nowdl.partitioner.master.exact import lagrangian_bound
from nowdl.partitioner.master.pairing import master_split
from nowdl.partitioner.milp.lp_bound import assignment_lower_bound
from nowdl.partitioner.milp.solve import solve_ilp
from nowdl.partitioner.search.batch_split import CostsByBatch
from nowdl.partitioner.search.best_plan import (
    _as_memory,
    _batch,
    _max_stages,
    _tileable_ends,
    search,
)
from nowdl.partitioner.search.bounds import candidate_bounds
from nowdl.partitioner.search.candidate_problem import candidate_problem
from nowdl.partitioner.search.model_space import image_of
from nowdl.partitioner.solver import SolveCache, proven, solve
from nowdl.partitioner.spatial.tileable import spatial_rules
from nowdl.profiler import get_device_spec, profile
from nowdl.trace.tracer import trace


def _costs(depth: int = 8, side: int = 64) -> Costs:
    model = resnet(depth=depth, version=1)
    x = torch.empty(1, 3, side, side, device="meta")
    t = trace(model, (x,))
    prof = profile(t.gm, (x,), mode="estimate", device_spec="h100", cache=False, progress=False)
    spec = get_device_spec("h100")
    return Costs(profile=prof, rules=spatial_rules(t.gm), link_bw=float(spec.link_bw),
                 mem_cap=float(spec.memory_bytes))


@pytest.fixture(scope="module")
def costs() -> Costs:
    return _costs()


def _problems(costs: Costs, req: PlanRequest, balance: str) -> Iterator[tuple[Candidate, Costs, Problem]]:
    """Every candidate the search enumerates, with its costs and problem as the search builds them."""
    front, back = _tileable_ends(costs)
    by_batch = CostsByBatch(costs, _batch(costs))
    for cand in enumerate_candidates(req, tileable_front=front, tileable_back=back, max_stages=_max_stages(costs, req),
                                     micro_batch=_batch(costs), image=image_of(costs)):
        cc, problem = candidate_problem(by_batch, cand, balance)
        yield cand, cc, problem


def _key(costs: Costs, cand: object, problem: Problem, batch: int) -> tuple[bool, float, float]:
    part = solve(problem)
    pred = predict_step(costs, cand, part, batch)  # type: ignore[arg-type]
    return (bool(idle_stages(problem, part.stage_of)), -pred["throughput"], part.bottleneck_mem)


@pytest.mark.parametrize("balance", ["compute", "memory"])
@pytest.mark.parametrize("stages", [None, 4])
def test_pruning_finds_the_same_optimum_as_solving_every_candidate(
    costs: Costs, balance: str, stages: int | None
) -> None:
    req = PlanRequest(gpus=4, balance=balance, stages=stages)
    got = search(costs, req)
    keys: dict[bool, list[tuple[bool, float, float]]] = {False: [], True: []}
    for cand, cc, problem in _problems(costs, req, balance):
        try:
            keys[cand.tiles_per_gpu > 1].append(_key(cc, cand, problem, cand.micro_batch_size))
        except InfeasibleError:
            continue
    best = min(keys[False] or keys[True])  # [Note: sequential tiles last]: everything fits without them here
    assert close(got.predicted["throughput"], -best[1], 1e-9), (got.candidate, best)
    assert bool(got.warnings) == best[0]
    assert got.stats["evaluated"] + got.stats["pruned_by_bound"] <= got.stats["enumerated"]


def test_bounds_hold_for_every_candidate(costs: Costs) -> None:
    req = PlanRequest(gpus=4, balance="compute", global_batch=4)
    for balance in ("compute", "memory"):
        for cand, cc, problem in _problems(costs, req, balance):
            b = candidate_bounds(cc, cand, problem, cand.micro_batch_size)
            part = solve(problem)
            assert b.time_lb <= part.bottleneck_time * (1 + 1e-9), cand
            assert b.mem_lb <= part.bottleneck_mem * (1 + 1e-9), cand
            pred = predict_step(cc, cand, part, cand.micro_batch_size)
            assert b.throughput_ub >= pred["throughput"] * (1 - 1e-9), cand


def test_assignment_bound_holds_for_every_candidate(costs: Costs) -> None:
    """The search drops a candidate whose assignment LP bound on memory exceeds the cap: that
    bound must lie below the candidate's least memory (MASTER, dp and both balances), and it
    is never weaker than the candidate's own memory bound."""
    req = PlanRequest(gpus=4, balance="compute")
    stronger = 0
    for balance in ("compute", "memory"):
        for cand, cc, problem in _problems(costs, req, balance):
            lp = assignment_lower_bound(_as_memory(problem))
            least = solve(dataclasses.replace(_as_memory(problem), mem_cap=None)).bottleneck_mem
            assert lp <= least * (1 + 1e-9), cand
            mem_lb = candidate_bounds(cc, cand, problem, cand.micro_batch_size).mem_lb
            assert lp >= mem_lb * (1 - 1e-9), cand
            stronger += lp > mem_lb * 1.01
    assert stronger > 0


def test_unpinned_search_is_proven_and_prunes(costs: Costs) -> None:
    got = search(costs, PlanRequest(gpus=8, balance="compute"))
    assert got.stats["choice"] == "proven" and proven(got.partition)
    assert got.stats["pruned_by_bound"] > 0


def _diamond() -> Problem:
    vec = NodeVectors(act=[1.0] * 4, time=[1.0] * 4, workspace=[0.0] * 4, out=[1.0] * 4)
    return Problem(names=list("abcd"), edges=[(0, 1), (0, 2), (1, 3), (2, 3)],
                   static=[0.0] * 4, variants={"plain": vec}, stages=[StageSpec()] * 2)


def test_enumerate_ideals_counts_and_cap() -> None:
    lat = enumerate_ideals(_diamond())
    assert lat is not None and lat.size == 6  # {}, a, ab, ac, abc, abcd
    sets = {tuple(np.flatnonzero(row)) for row in lat.members}
    assert sets == {(), (0,), (0, 1), (0, 2), (0, 1, 2), (0, 1, 2, 3)}
    assert lat.proper[0, 5] and not lat.proper[2, 3] and not lat.proper[3, 3]
    assert lat.chain[0] == 0 and lat.chain[-1] == lat.size - 1 and len(lat.chain) == 5
    assert enumerate_ideals(_diamond(), cap=3) is None


def _case(seed: int, master: bool) -> Problem:
    rng = random.Random(seed)
    n = rng.randint(3, 7)
    k = rng.choice([2, 3, 4]) if master else rng.choice([2, 3])
    p = random_problem(rng, max(n, k), k, skips=rng.choice([0.0, 0.4]), spatial=seed % 3 == 0,
                       master=master, objective=rng.choice(["memory", "compute"]))
    if seed % 5 == 2:
        ref = lex_reference(dataclasses.replace(p, objective="memory"), all_splits(p))
        if ref is not None:
            p = dataclasses.replace(p, mem_cap=ref.primary * rng.uniform(1.0, 1.25))
    return p


@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("seed", range(30))
def test_ideal_dp_matches_brute_force(seed: int, master: bool) -> None:
    p = _case(700 + seed, master)
    lat = enumerate_ideals(p)
    assert lat is not None
    ref = lex_reference(p, all_splits(p))
    part = solve_ideals(p, lat)
    if ref is None:
        assert part is None
        return
    assert part is not None and part.status == "optimal"  # MASTER: exact for few ideals
    check_valid(p, part)
    check_levels(p, part, ref)


def _lex_le(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """a <= b lexicographically, up to float rounding."""
    tol = 1e-9 * max(abs(a[0]), abs(b[0]), 1e-300)
    if abs(a[0] - b[0]) > tol:
        return a[0] < b[0]
    return a[1] <= b[1] * (1 + 1e-9) + 1e-300


@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_beam_of_ideals_is_a_valid_heuristic(seed: int, master: bool) -> None:
    """A beam keeps some ideals (each a real ideal, the order's prefixes among them); its DP
    gives a valid split, marked heuristic, between the exact optimum and the order's DP."""
    p = _case(800 + seed, master)
    full = enumerate_ideals(p)
    assert full is not None
    beam = beam_ideals(p, cap=4 * p.n)  # 3 a size: every size kept
    assert not beam.complete and full.complete
    every = {row.tobytes() for row in full.members}
    assert all(row.tobytes() in every for row in beam.members)
    assert beam.members[0].sum() == 0 and beam.members[-1].all()
    assert all(beam.proper[a, b] for a, b in itertools.pairwise(beam.chain))
    got = solve_ideals(p, beam)
    exact = solve_ideals(p, full)
    if exact is None:
        return
    assert got is not None and got.solver == "beam" and got.status == "heuristic"
    check_valid(p, got)
    assert _lex_le(objective_values(p, exact), objective_values(p, got))
    via = solve(dataclasses.replace(p), ilp=False, coarsen=False)
    assert _lex_le(objective_values(p, via), objective_values(p, got))
    thin = beam_ideals(p, cap=p.n)  # 2 a size, every second size kept
    assert thin.size <= p.n + 2 and all(row.tobytes() in every for row in thin.members)
    sparse = solve_ideals(p, thin)  # may find nothing under the cap; valid when it does
    if sparse is not None:
        check_valid(p, sparse)
        assert _lex_le(objective_values(p, exact), objective_values(p, sparse))


def test_wide_graph_gets_the_beam_before_the_milp() -> None:
    """Too many ideals for the exact DP: ``solve`` starts from the better of the beam and the
    order's DP, and the MILP never returns anything worse."""
    rng = random.Random(4)
    n, width = 30, 5  # five parallel chains of 6 between a source and a sink: 7^5 ideals
    edges = []
    for c in range(width):
        prev = 0
        for i in range(n // width):
            v = 1 + c * (n // width) + i
            edges.append((prev, v))
            prev = v
        edges.append((prev, n + 1))
    m = n + 2
    vec = lambda: [rng.uniform(1, 10) for _ in range(m)]  # noqa: E731
    p = Problem(names=[f"v{i}" for i in range(m)], edges=edges, static=vec(),
                variants={"plain": NodeVectors(act=vec(), time=vec(), workspace=[0.0] * m, out=vec())},
                stages=[StageSpec(inflight=2, link_s_per_byte=0.01) for _ in range(3)], pinned={0: 0})
    assert enumerate_ideals(p) is None
    cache = SolveCache()
    heur = solve(p, ilp=False, cache=cache)
    assert heur.solver in ("beam", "dp")
    order = solve(p, ilp=False, coarsen=False, cache=SolveCache())
    assert _lex_le(objective_values(p, heur), objective_values(p, order))
    full = solve(p, time_limit=20)
    check_valid(p, full)
    assert _lex_le(objective_values(p, full), objective_values(p, heur))


def _long_master(seed: int) -> Problem:
    objective = "memory" if seed % 2 else "compute"
    p = resnet_like(blocks=12, k=4, seed=seed, objective=objective)
    return dataclasses.replace(p, ranks=[[r, 3 - r] for r in range(4)])


@pytest.mark.parametrize("seed", range(3))
def test_master_descent_is_bounded_by_the_lagrangian(seed: int) -> None:
    """Beyond the exact pair DP's size: the descent's split against its lower bound."""
    p = _long_master(900 + seed)
    lat = enumerate_ideals(p)
    assert lat is not None and lat.size > 72
    got = master_split(IdealCosts(p, lat), mem_is_prim=p.objective == "memory", cap=None)
    assert got is not None
    part = make_partition(p, IdealCosts(p, lat).assignment(got[0]))
    check_valid(p, part)
    value = objective_values(p, part)[0]
    lower = lagrangian_bound(IdealCosts(p, lat), value)
    assert 0 < lower <= value * (1 + 1e-9)
    assert solve(p).gap == pytest.approx(1 - lower / value)  # what the plan reports
    # the MILP never beats the lower bound either
    ilp = solve_ilp(p, time_limit=10, start=part)
    assert objective_values(p, ilp)[0] >= lower * (1 - 1e-9)


def test_master_exact_pair_dp_beats_or_ties_the_descent() -> None:
    for seed in range(10):
        p = _case(800 + seed, True)
        lat = enumerate_ideals(p)
        assert lat is not None
        exact = master_split(IdealCosts(p, lat), mem_is_prim=p.objective == "memory",
                             cap=p.mem_cap, exact=True)
        heur = master_split(IdealCosts(p, lat), mem_is_prim=p.objective == "memory",
                            cap=p.mem_cap)
        if exact is None:
            continue
        cost = IdealCosts(p, lat)
        e = objective_values(p, make_partition(p, cost.assignment(exact[0])))[0]
        assert close(exact[1], e)  # the exact split's value is its own lower bound
        if heur is not None:
            h = make_partition(p, cost.assignment(heur[0]))
            assert feasible(p, h.stage_of, cap_rel=1e-9)
            assert objective_values(p, h)[0] >= e * (1 - 1e-9)


def test_solve_cache_shares_lattices() -> None:
    p = resnet_like(blocks=5, k=4)
    cache = SolveCache()
    a = solve(p, cache=cache)
    b = solve(dataclasses.replace(p, objective="compute"), cache=cache)
    assert len(cache.lattices) == 1 and a.solver == b.solver == "ideals"
    assert list(itertools.islice(cache.lattices.values(), 1))[0] is not None


@pytest.mark.parametrize("seed", range(12))
def test_tied_nodes_share_a_stage_in_every_solver(seed: int) -> None:
    rng = random.Random(1100 + seed)
    p = random_problem(rng, rng.randint(4, 7), rng.choice([2, 3]), skips=0.3,
                       master=seed % 3 == 2, objective=rng.choice(["memory", "compute"]))
    a, b = sorted(rng.sample(range(p.n), 2))
    p = dataclasses.replace(p, tied=[[a, b]])
    ref = lex_reference(p, all_splits(p))
    if ref is None:
        with pytest.raises(InfeasibleError):
            solve(p)
        return
    for part in (solve(p), solve_ilp(p), solve(p, coarsen=False)):
        check_valid(p, part)  # feasible() checks the tie
        assert part.stage_of[a] == part.stage_of[b]
        assert close(objective_values(p, part)[0], ref.primary), part.solver


def test_tied_nodes_found_in_the_graph() -> None:
    class Shared(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 2, 3, padding=1)
            self.other = torch.nn.Conv2d(2, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            y = self.other(y)
            return self.conv(y) + torch.nn.functional.conv2d(y, self.other.weight)

    gm = trace(Shared(), (torch.randn(1, 2, 8, 8),)).gm
    groups = {frozenset(g) for g in tied_nodes(gm)}
    names = [n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "conv"]
    assert frozenset(names) in groups and len(names) == 2
    other = [g for g in groups if "other" in g]
    assert other and len(other[0]) == 2  # the module and the conv2d reading its weight


def test_equal_problems_are_solved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Candidates whose problems differ only where the solvers do not look (the first stage's
    receive factor: it receives nothing) share one solve; a real difference solves again."""
    import sys

    solve_mod = sys.modules[solve.__module__]
    calls: list[int] = []
    inner = solve_mod._solve

    def counting(problem: Problem, **kw: object) -> object:
        calls.append(problem.k)
        return inner(problem, **kw)

    monkeypatch.setattr(solve_mod, "_solve", counting)
    p = random_problem(random.Random(3), 7, 3, skips=0.4)
    first = dataclasses.replace(p.stages[0], recv_held=7.0)
    last = dataclasses.replace(p.stages[-1], send_held=9.0)
    same = dataclasses.replace(p, stages=[first, *p.stages[1:-1], last])
    other = dataclasses.replace(p, stages=[p.stages[0], dataclasses.replace(p.stages[1], recv_held=11.0),
                                          *p.stages[2:]])
    cache = SolveCache()
    a = solve(p, cache=cache)
    b = solve(same, cache=cache)
    assert len(calls) == 1 and b.stage_of == a.stage_of
    assert objective_values(same, b) == objective_values(same, solve(same))  # the shared split is its optimum too
    solve(other, cache=cache)
    assert len(calls) == 3  # `other` once with the cache, and `same` once without it above


@pytest.mark.parametrize("seed", range(6))
def test_mip_gap_stops_within_it_and_says_so(seed: int) -> None:
    """With mip_gap the MILP may stop early: its split is within that gap of the brute-force
    optimum, and the gap it reports is at most mip_gap."""
    rng = random.Random(100 + seed)
    p = random_problem(rng, 7, 3, skips=0.4, objective="memory" if seed % 2 else "compute")
    best = lex_reference(p, all_splits(p))
    assert best is not None
    part = solve_ilp(p, mip_gap=0.05, time_limit=20)
    check_valid(p, part)
    assert part.status == "optimal" and part.gap <= 0.05 + 1e-9
    assert objective_values(p, part)[0] <= best.primary * (1 + 0.05) + 1e-9


def test_mip_gap_out_of_range_is_refused() -> None:
    from nowdl.errors import NowdlError

    with pytest.raises(NowdlError, match="mip_gap must be a relative gap"):
        PlanRequest(gpus=4, mip_gap=1.5)


def test_memo_does_not_skip_the_master_bound() -> None:
    """A MASTER split screened without the MILP (``ilp=False``: the ideal DP's descent, status
    "heuristic") still gets its Lagrangian bound when solved again with ``ilp=True``."""
    p = resnet_like(12, 4)
    p = dataclasses.replace(p, ranks=[[0, 3], [1, 2]])
    cache = SolveCache()
    screened = solve(p, ilp=False, cache=cache)
    assert (screened.solver, screened.status) == ("ideals", "heuristic")  # the case under test
    again = solve(p, cache=cache, start=screened)
    assert again.status in ("optimal", "feasible") and again.status != "heuristic"


def test_finalists_run_best_first_each_keeping_a_reserve_for_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The most promising finalist may use all the time left but FINALIST_RESERVE_S for each
    one after it; what a finalist does not use passes on to the next."""
    import time
    from types import SimpleNamespace

    import nowdl.partitioner.search.best_plan as search_mod

    given: list[tuple[int, float]] = []
    spent = {0: 3.0, 1: 0.0, 2: 0.0}  # seconds each finalist's MILP "runs"
    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def fake_finish(ev, time_limit, cache, mip_gap=1e-6):  # noqa: ANN001, ANN202
        given.append((ev.cand, time_limit))
        clock[0] += spent[ev.cand]
        return dataclasses.replace(ev, final=True, exact=True)

    monkeypatch.setattr(search_mod, "_finish", fake_finish)

    def ev(i: int) -> search_mod._Eval:
        return search_mod._Eval(cand=i, costs=None, problem=None, bounds=SimpleNamespace(throughput_ub=1e9),  # type: ignore[arg-type]
                                part=SimpleNamespace(bottleneck_mem=float(i), solver="beam"),  # type: ignore[arg-type]
                                pred={"throughput": 10.0 - i}, exact=False, final=False, fits=True, idle=False)

    req = PlanRequest(gpus=4, balance="memory")
    out = search_mod._finalists(req, [ev(0), ev(1), ev(2)], None, deadline=120.0)  # type: ignore[arg-type]
    reserve = search_mod.FINALIST_RESERVE_S
    assert [c for c, _ in given] == [0, 1, 2]  # best heuristic key first
    assert given[0][1] == pytest.approx(20.0 - 2 * reserve)
    assert given[1][1] == pytest.approx(20.0 - 3.0 - reserve)  # the first used 3 s: the rest passes on
    assert given[2][1] == pytest.approx(17.0)
    assert all(e.final for e in out) and len(out) == 3

    # a finalist left less than the reserve gets no MILP ([Note: HiGHS overrun]): its screened split stays
    given.clear()
    spent.update({0: 15.0, 1: 3.5})
    clock[0] = 100.0
    out = search_mod._finalists(req, [ev(0), ev(1), ev(2)], None, deadline=120.0)  # type: ignore[arg-type]
    assert [c for c, _ in given] == [0, 1]
    assert given[1][1] == pytest.approx(20.0 - 15.0 - reserve)
    assert len(out) == 3 and [e.final for e in sorted(out, key=lambda e: e.cand)] == [True, True, False]

    # ... unless its screened split breaks the cap (here none fits): the MILP is its only chance
    given.clear()
    clock[0] = 100.0
    evs = [dataclasses.replace(ev(i), fits=False) for i in range(3)]
    out = search_mod._finalists(req, evs, None, deadline=120.0)  # type: ignore[arg-type]
    assert [c for c, _ in given] == [0, 1, 2]
    assert given[2][1] == pytest.approx(1.5)
