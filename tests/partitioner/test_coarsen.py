"""Coarsening: exact merges keep the optimum; greedy merges are flagged."""

from __future__ import annotations

import dataclasses
import random

import pytest
from helpers.problems import check_valid, close, resnet_like

from nowdl.partitioner.costs.problem import NodeVectors, Partition, Problem, StageSpec, evaluate
from nowdl.partitioner.costs.structure import objective_values, topological_order
from nowdl.partitioner.exact.coarsen import coarsen, compose_groups, expand
from nowdl.partitioner.milp.solve import solve_ilp
from nowdl.partitioner.solver import solve


def chain_heavy(rng: random.Random, n: int, k: int, *, objective: str = "memory") -> Problem:
    """Chains of costly ops with free view-like nodes, sources, sinks and a few skips."""
    edges: set[tuple[int, int]] = set()
    static: list[float] = []
    act: list[float] = []
    tim: list[float] = []
    ws: list[float] = []
    out: list[float] = []
    for v in range(n):
        free = v > 0 and rng.random() < 0.35
        if free:  # a view/reshape/getitem: no cost, output no larger than its input
            static.append(0.0)
            act.append(0.0)
            tim.append(0.0)
            ws.append(0.0)
            out.append(out[v - 1] * rng.choice([1.0, 0.5]))
        else:
            static.append(rng.uniform(0, 10))
            act.append(rng.uniform(0, 10))
            tim.append(rng.uniform(0, 10))
            ws.append(rng.choice([0.0, rng.uniform(0, 5)]))
            out.append(rng.uniform(1, 10))
        if v > 0:
            edges.add((v - 1, v) if rng.random() < 0.9 else (rng.randrange(v), v))
        if v > 2 and rng.random() < 0.1:
            edges.add((rng.randrange(v - 1), v))
    return Problem(
        names=[f"op{i}" for i in range(n)],
        edges=sorted(edges),
        static=static,
        variants={"plain": NodeVectors(act=act, time=tim, workspace=ws, out=out)},
        stages=[StageSpec(inflight=rng.randint(1, 3), link_s_per_byte=rng.choice([0.0, 0.05]),
                          recv_held=None if s % 2 == 0 else 2.0, send_held=None if s % 2 == 0 else 1.0)
                for s in range(k)],
        objective=objective,
    )


def _random_assignment(p: Problem, rng: random.Random) -> list[int]:
    stage_of = [0] * p.n
    for v in topological_order(p):
        lo = max((stage_of[u] for u, w in p.edges if w == v), default=0)
        stage_of[v] = rng.randint(lo, p.k - 1)
    return stage_of


@pytest.mark.parametrize("seed", range(12))
def test_coarse_evaluation_equals_original(seed: int) -> None:
    rng = random.Random(seed)
    p = chain_heavy(rng, 40, 4)
    small, groups = coarsen(p)
    assert small.n < p.n
    assert sorted(v for g in groups for v in g) == list(range(p.n))
    for _ in range(5):
        a = _random_assignment(small, rng)
        mem, tim = evaluate(small, a)
        part = expand(Partition(a, mem, tim, [], [], status="optimal"), groups, p)
        assert part.stage_mem == pytest.approx(mem)
        assert part.stage_time == pytest.approx(tim)
        assert part.status == "optimal"


@pytest.mark.parametrize("seed", range(10))
def test_coarsened_optimum_equals_raw_optimum(seed: int) -> None:
    rng = random.Random(100 + seed)
    p = chain_heavy(rng, rng.randint(12, 24), rng.randint(2, 4),
                    objective=rng.choice(["memory", "compute"]))
    assert coarsen(p)[0].n < p.n
    raw = solve_ilp(p)
    via = solve(p)
    assert raw.status == "optimal" and via.status == "optimal"
    check_valid(p, via)
    rp, rs = objective_values(p, raw)
    vp, vs = objective_values(p, via)
    assert close(rp, vp) and close(rs, vs)


def test_merges_respect_tileability_and_pins() -> None:
    rng = random.Random(5)
    p = chain_heavy(rng, 30, 3)
    p = dataclasses.replace(p, tileable=[v % 2 == 0 for v in range(p.n)],
                            pinned={0: 0, p.n - 1: 2})
    small, groups = coarsen(p)
    for i, grp in enumerate(groups):
        assert len({p.tileable[v] for v in grp}) == 1 or not small.tileable[i]
        pins = {p.pinned[v] for v in grp if v in p.pinned}
        assert len(pins) <= 1
        if pins:
            assert small.pinned[i] == pins.pop()
    for i, grp in enumerate(groups):
        if small.tileable[i]:
            assert all(p.tileable[v] for v in grp)


def test_greedy_cap_is_flagged() -> None:
    p = resnet_like(blocks=20, k=4)
    small, groups = coarsen(p, max_nodes=40)
    assert small.n <= 40
    part = expand(solve_ilp(small), groups, p, exact=False)
    check_valid(p, part)
    assert part.status in ("coarse-optimal", "feasible")
    via = solve(p, max_nodes=40)
    assert via.status in ("coarse-optimal", "feasible")
    check_valid(p, via)


def test_compose_groups() -> None:
    assert compose_groups([[0, 1], [2], [3, 4]], [[0, 2], [1]]) == [[0, 1, 3, 4], [2]]


def test_unet_like_long_skips_solve() -> None:
    rng = random.Random(9)
    p = chain_heavy(rng, 30, 4)
    edges = list(p.edges) + [(2, 27), (5, 22), (9, 18)]  # long skips, like a UNet
    p = dataclasses.replace(p, edges=sorted(set(edges)))
    raw = solve_ilp(p)
    via = solve(p)
    assert close(objective_values(p, raw)[0], objective_values(p, via)[0])


def test_input_independent_nodes_float_to_their_consumer() -> None:
    """A random mask drawn in forward (rand -> add -> floor -> mul(x, .)) joins its consumer;
    without pinned inputs nothing floats (see [Note: floating nodes])."""
    rng = random.Random(3)
    base = chain_heavy(rng, 12, 3)
    n = base.n
    extra = 3  # rand, add, floor: a chain hanging into node 8
    edges = list(base.edges) + [(n, n + 1), (n + 1, n + 2), (n + 2, 8)]
    vec = base.variants["plain"]
    tiny = [1e-9] * extra
    p = Problem(
        names=[*base.names, "rand", "add", "floor"], edges=edges, static=[*base.static, 0.0, 0.0, 0.0],
        variants={"plain": NodeVectors(act=[*vec.act, *tiny], time=[*vec.time, *tiny],
                                       workspace=[*vec.workspace, 0.0, 0.0, 0.0], out=[*vec.out, 4.0, 4.0, 4.0])},
        stages=base.stages, objective=base.objective)
    free, groups = coarsen(p)
    assert not any({n, n + 1, n + 2} <= set(g) for g in groups)  # no pinned input: nothing floats
    pinned = dataclasses.replace(p, pinned={0: 0})
    small, groups = coarsen(pinned)
    holder = next(g for g in groups if n in g)
    assert {n, n + 1, n + 2, 8} <= set(holder)
    part = solve(pinned)
    check_valid(pinned, part)
    assert len({part.stage_of[v] for v in (n, n + 1, n + 2, 8)}) == 1
    assert free.n > small.n
