"""torchgpipe's block partition port and the baseline balancers."""

from __future__ import annotations

import itertools
import random

import pytest
from helpers.problems import check_valid, random_problem

from nowdl.partitioner.baselines import (
    balance_by_count,
    balance_by_params,
    balance_by_time,
    minmax_split,
    solve_blockpartition,
)


def brute_minmax(seq: list[float], k: int, *, nonempty: bool) -> float:
    n = len(seq)
    best = float("inf")
    points = range(1, n) if nonempty else range(n + 1)
    combos = itertools.combinations(points, k - 1) if nonempty else \
        itertools.combinations_with_replacement(points, k - 1)
    for cuts in combos:
        b = [0, *cuts, n]
        best = min(best, max(sum(seq[b[i]:b[i + 1]]) for i in range(k)))
    return best


def test_torchgpipe_cases() -> None:
    # the cases of torchgpipe's tests/test_balance.py
    assert solve_blockpartition([1, 2, 3, 4, 5, 6], partitions=2) == [[1, 2, 3, 4], [5, 6]]
    assert solve_blockpartition([0, 0], partitions=2) == [[0], [0]]
    with pytest.raises(ValueError):
        solve_blockpartition([42], partitions=0)
    with pytest.raises(ValueError):
        solve_blockpartition([], partitions=1)
    with pytest.raises(ValueError):
        solve_blockpartition([42], partitions=2)


@pytest.mark.parametrize("seed", range(40))
def test_blockpartition_against_brute_force(seed: int) -> None:
    """The port is not min-max optimal; check the paper's guarantee against the optimum.

    With a zero in the sequence, blocks differ by at most the largest element, so the
    largest block is within max(sequence) of the brute-force min-max optimum.
    """
    rng = random.Random(seed)
    n = rng.randint(2, 11)
    k = rng.randint(1, min(n, 4))
    seq = [0.0] + [round(rng.uniform(0, 10), 3) for _ in range(n - 1)]
    rng.shuffle(seq)
    blocks = solve_blockpartition(seq, k)
    assert len(blocks) == k and all(blocks)
    assert [x for b in blocks for x in b] == seq
    sums = [sum(b) for b in blocks]
    opt = brute_minmax(seq, k, nonempty=True)
    assert max(sums) - min(sums) <= max(seq) + 1e-9
    assert opt - 1e-9 <= max(sums) <= opt + max(seq) + 1e-9


@pytest.mark.parametrize("seed", range(20))
def test_minmax_split_is_optimal(seed: int) -> None:
    rng = random.Random(seed)
    seq = [rng.uniform(0, 5) for _ in range(rng.randint(1, 9))]
    k = rng.randint(1, 4)
    sizes = minmax_split(seq, k)
    assert sum(sizes) == len(seq) and len(sizes) == k
    ends = [sum(sizes[: i + 1]) for i in range(k)]
    starts = [0] + ends[:-1]
    got = max(sum(seq[a:b]) for a, b in zip(starts, ends, strict=True))
    assert got == pytest.approx(brute_minmax(seq, k, nonempty=False))


def test_baselines_give_evaluated_partitions() -> None:
    rng = random.Random(3)
    p = random_problem(rng, 30, 4)
    for fn in (balance_by_time, balance_by_params, balance_by_count):
        part = fn(p)
        check_valid(p, part)
        assert part.status.startswith("heuristic")
    counts = [balance_by_count(p).stage_of.count(s) for s in range(4)]
    assert counts == [8, 8, 7, 7]
