"""The ideal DP over a greedily coarsened graph ([Note: coarse ideal DP]): a valid split, never
better than the exact optimum, and None where it does not apply."""

from __future__ import annotations

import dataclasses
import random

import pytest
from helpers.problems import check_valid, random_problem

from nowdl.partitioner.costs.problem import NodeVectors, Problem
from nowdl.partitioner.costs.structure import objective_values
from nowdl.partitioner.exact.coarse_dp import coarse_split
from nowdl.partitioner.exact.downsets import enumerate_ideals
from nowdl.partitioner.exact.ideal_dp import solve_ideals


def _problem(seed: int) -> Problem:
    rng = random.Random(seed)
    return random_problem(rng, rng.randint(24, 32), rng.randint(2, 3), skips=0.5,
                          objective=rng.choice(["memory", "compute"]))


def _small_lattice_seeds(count: int) -> list[int]:
    """Seeds whose problem has 200 to 1,500 ideals (the exact DP stays quick)."""
    out, seed = [], 0
    while len(out) < count:
        lat = enumerate_ideals(_problem(seed), cap=1500)
        if lat is not None and lat.size >= 200:
            out.append(seed)
        seed += 1
    return out


@pytest.mark.parametrize("seed", _small_lattice_seeds(25))
def test_coarse_split_is_valid_and_not_below_the_optimum(seed: int) -> None:
    problem = _problem(seed)
    lat = enumerate_ideals(problem, cap=1500)
    assert lat is not None
    exact = solve_ideals(problem, lat)
    assert exact is not None
    got = coarse_split(problem, cap=max(problem.k + 1, lat.size // 2))
    assert got is not None  # these chains with skips coarsen to a few dozen groups
    check_valid(problem, got)
    assert got.solver == "coarse" and got.status == "heuristic"
    assert objective_values(problem, got)[0] >= objective_values(problem, exact)[0] * (1 - 1e-9)


def test_coarse_split_finds_a_split_on_parallel_branches() -> None:
    """Cells of four parallel chains (too many ideals for the exact DP) get a split."""
    rng = random.Random(7)
    base = random_problem(rng, 2, 4, skips=0.0)
    edges: list[tuple[int, int]] = []
    n = 0
    prev = 0
    for _ in range(6):  # a cell: four chains of four nodes from prev, joined by one node
        ends = []
        for _ in range(4):
            last = prev
            for _ in range(4):
                n += 1
                edges.append((last, n))
                last = n
            ends.append(last)
        n += 1
        edges += [(e, n) for e in ends]
        prev = n
    n += 1
    edges.append((prev, n))
    n += 1

    def vec() -> list[float]:
        return [rng.uniform(1, 10) for _ in range(n)]

    variants = {"plain": NodeVectors(act=vec(), time=vec(), workspace=vec(), out=vec())}
    problem = Problem(names=[f"v{i}" for i in range(n)], edges=edges, static=vec(),
                         variants=variants, stages=base.stages, objective="memory")
    assert enumerate_ideals(problem, cap=3000) is None
    got = coarse_split(problem, cap=500)
    assert got is not None
    check_valid(problem, got)


def test_master_gets_none() -> None:
    problem = random_problem(random.Random(3), 14, 4, master=True)
    assert coarse_split(problem) is None


def test_pair_matrices_are_kept_least_recently_used_within_a_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ideal DP's pair matrices are shared between solves of one graph: every kind of stage
    keeps its own while they fit ``_BASES_BYTES``, the least recently used goes first."""
    from nowdl.partitioner.exact import ideal_dp as ideals
    problem = random_problem(random.Random(5), 8, 3, spatial=True)  # kinds "plain" and "tile2"
    lat = enumerate_ideals(problem)
    assert lat is not None
    bases: dict[tuple[object, ...], object] = {}
    costs = ideals.IdealCosts(problem, lat, bases=bases)
    plain, tile = costs.base("plain"), costs.base("tile2")
    assert len(bases) == 2 and costs.base("plain") is plain  # kept, not rebuilt
    assert list(bases.values()) == [tile, plain]  # plain used last
    one = plain.nbytes
    assert one > 0 and tile.nbytes == one
    monkeypatch.setattr(ideals, "_BASES_BYTES", one * 3 // 2)  # room for one only
    other = ideals.IdealCosts(dataclasses.replace(problem, static=[x + 1.0 for x in problem.static]), lat,
                              bases=bases)
    third = other.base("plain")  # new numbers: a third set, which evicts both older ones
    assert list(bases.values()) == [third]
    assert costs.base("tile2") is not tile  # rebuilt
