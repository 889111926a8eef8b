"""Baseline partitioners: torchgpipe's block partition, and balancing by parameters or counts.

``solve_blockpartition`` is a faithful port of torchgpipe's
``torchgpipe/balance/blockpartition.py`` (kakaobrain/torchgpipe, BSD-3-Clause), which
implements "Block Partitions of Sequences" by Imre Bárány and Victor S. Grinberg
(https://arxiv.org/pdf/1308.2452.pdf). It is not a min-max optimum: the paper's guarantee,
on the sequence normalised to [0, 1] by its minimum and range, is that the largest block
exceeds the smallest by at most 1 (one normalised element). The baselines below split a
topological order contiguously and are evaluated with ``evaluate()``, so they can be
compared with the ILP on the same cost model.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence

import numpy as np

from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.structure import check_problem, checked_order, make_partition
from nowdl.partitioner.exact.order_dp import minmax_dp

__all__ = [
    "solve_blockpartition",
    "split_to_partition",
    "balance_by_weights",
    "balance_by_time",
    "balance_by_params",
    "balance_by_count",
    "minmax_split",
]

log = logging.getLogger(__name__)


def solve_blockpartition(sequence: list[float], partitions: int = 1) -> list[list[float]]:
    """Split a sequence into contiguous blocks of similar sums (Bárány & Grinberg).

    Ported from torchgpipe's ``blockpartition.solve``; the result might not be optimal.

    Example:
        >>> solve_blockpartition([1, 2, 3, 4, 5, 6], partitions=2)
        [[1, 2, 3, 4], [5, 6]]

    Args:
        sequence: non-negative weights, in order.
        partitions: number of blocks (every block gets at least one element).

    Returns:
        The blocks (lists of the original values), in order.

    Raises:
        ValueError: if ``partitions`` < 1 or the sequence is shorter than ``partitions``.
    """
    if partitions < 1:
        raise ValueError(f"partitions must be a positive integer ({partitions} < 1)")

    n = len(sequence)
    if n < partitions:
        raise ValueError(f"sequence is shorter than intended partitions ({n} < {partitions})")

    # Normalize the sequence in [0, 1].
    minimum = min(sequence)
    maximum = max(sequence) - minimum

    normal_sequence: list[float]
    if maximum == 0:
        normal_sequence = [0 for _ in sequence]
    else:
        normal_sequence = [(x - minimum) / maximum for x in sequence]

    splits = [n // partitions * (x + 1) for x in range(partitions - 1)] + [n]

    def block_size(i: int) -> float:
        start = splits[i - 1] if i > 0 else 0
        stop = splits[i]
        return sum(normal_sequence[start:stop])

    def leaderboard() -> Iterator[tuple[float, int]]:
        return ((block_size(i), i) for i in range(partitions))

    while True:
        # (1) Fix p in [k] with M(P) = bp. So Bp is a maximal block of P.
        max_size, p = max(leaderboard())

        while True:
            # (2) If M(P) <= m(P) + 1, then stop.
            # the minimal block closest to p, as the paper says (the lowest index instead can pick
            # a q whose neighbour towards p is empty when the sequence has zeros)
            sizes = list(leaderboard())
            min_size = min(sizes)[0]
            q = min((abs(i - p), i) for b, i in sizes if b == min_size)[1]

            if max_size <= min_size + 1:
                return [sequence[i:j] for i, j in zip([0] + splits[:-1], splits, strict=True)]

            # (3) If M(P) > m(P) + 1, then let m(P) = bq for the q in [k] which is closest
            # to p (ties broken arbitrarily). Thus Bq is a minimal block of P. Let Bh be the
            # block next to Bq between Bp and Bq. (Bh is non-empty: if it were empty then
            # m(P) = 0 and Bh would have been chosen instead of Bq.)
            if p < q:
                # So either p < q and then h = q-1 and we define P* by moving the last
                # element from Bh = Bq-1 to Bq,
                h = q - 1
                splits[h] -= 1
            else:
                # or q < p, and then h = q+1 and P* is obtained by moving the first element
                # of Bh = Bq+1 to Bq.
                h = q + 1
                splits[q] += 1

            # Set P = P*. If p = h, then go to (1), else go to (2).
            if p == h:
                break


def _order(problem: Problem, order: Sequence[int] | None) -> list[int]:
    check_problem(problem)
    return checked_order(problem, order)


def split_to_partition(
    problem: Problem,
    order: Sequence[int],
    sizes: Sequence[int],
    *,
    solver: str,
    seconds: float = 0.0,
) -> Partition:
    """Turn block sizes over a topological order into an evaluated Partition.

    Args:
        problem: the problem.
        order: a topological order.
        sizes: number of nodes of each of the K stages, in order (sum n).
        solver: name to record in the Partition.
        seconds: time to record.

    Returns:
        The Partition; status "heuristic", or "heuristic (violates ...)" when the split
        breaks a pin, tileability or the memory cap (baselines do not look at those).

    Raises:
        ValueError: if there are not K sizes summing to n.
    """
    if len(sizes) != problem.k or sum(sizes) != problem.n or min(sizes) < 0:
        raise ValueError(
            f"sizes must be {problem.k} non-negative counts summing to {problem.n} (got {list(sizes)})"
        )
    stage_of = [0] * problem.n
    i = 0
    for s, size in enumerate(sizes):
        for v in order[i : i + size]:
            stage_of[v] = s
        i += size
    part = make_partition(problem, stage_of, solver=solver, status="heuristic", seconds=seconds)
    broken = []
    if any(stage_of[v] != s for v, s in problem.pinned.items()):
        broken.append("pins")
    if problem.tileable and any(
        problem.stages[stage_of[v]].spatial and not problem.tileable[v] for v in range(problem.n)
    ):
        broken.append("tileability")
    if problem.mem_cap is not None and part.bottleneck_mem > problem.mem_cap:
        broken.append("mem_cap")
    if broken:
        part = _with_status(part, f"heuristic (violates {', '.join(broken)})")
    return part


def _with_status(part: Partition, status: str) -> Partition:
    return dataclasses.replace(part, status=status)


def balance_by_weights(
    problem: Problem, weights: Sequence[float], order: Sequence[int] | None = None
) -> Partition:
    """torchgpipe's balancing: block-partition per-node weights along a topological order.

    Args:
        problem: the problem (K = number of stages; needs n >= K).
        weights: one non-negative weight per node (indexed by node, not by position).
        order: a topological order (default ``topological_order(problem)``).

    Returns:
        The evaluated Partition (solver "blockpartition").

    Raises:
        ValueError: on a malformed problem, order or weights, or n < K.
    """
    t0 = time.perf_counter()
    order = _order(problem, order)
    if len(weights) != problem.n:
        raise ValueError(f"weights has {len(weights)} entries, expected {problem.n}")
    seq = [float(weights[v]) for v in order]
    blocks = solve_blockpartition(seq, problem.k)
    return split_to_partition(problem, order, [len(b) for b in blocks], solver="blockpartition",
                              seconds=time.perf_counter() - t0)


def balance_by_time(problem: Problem, order: Sequence[int] | None = None) -> Partition:
    """torchgpipe's ``balance_by_time``: block partition of each node's time.

    Uses the time vector of stage 0's variant.

    Args:
        problem: the problem.
        order: a topological order (default ``topological_order(problem)``).

    Returns:
        The evaluated Partition (solver "blockpartition").
    """
    vec = problem.variants[problem.stages[0].variant]
    return balance_by_weights(problem, list(vec.time), order)


def minmax_split(weights: Sequence[float], parts: int) -> list[int]:
    """Sizes of the contiguous split of ``weights`` into ``parts`` blocks with the smallest
    largest sum (exact; blocks may be empty).

    Args:
        weights: non-negative weights in order.
        parts: number of blocks (>= 1).

    Returns:
        The block sizes.

    Raises:
        ValueError: if ``parts`` < 1.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1 (got {parts})")
    n = len(weights)
    pre = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=float))])
    cost = pre[None, :] - pre[:, None]
    cost[np.tril_indices(n + 1, k=-1)] = np.inf
    _, cuts = minmax_dp([cost] * parts, [0] * parts, [n] * parts, nonempty=False)
    return [cuts[s + 1] - cuts[s] for s in range(parts)]


def balance_by_params(problem: Problem, order: Sequence[int] | None = None) -> Partition:
    """Equal parameter bytes per stage (DeepSpeed/PiPPy "parameters" balancing).

    Splits a topological order contiguously so that the largest per-stage sum of
    ``static`` bytes is smallest.

    Args:
        problem: the problem.
        order: a topological order (default ``topological_order(problem)``).

    Returns:
        The evaluated Partition (solver "params").
    """
    t0 = time.perf_counter()
    order = _order(problem, order)
    sizes = minmax_split([problem.static[v] for v in order], problem.k)
    return split_to_partition(problem, order, sizes, solver="params",
                              seconds=time.perf_counter() - t0)


def balance_by_count(problem: Problem, order: Sequence[int] | None = None) -> Partition:
    """Equal node counts per stage (MPI4DL's default when no ``--balance`` is given).

    The first ``n % K`` stages get one node more (``numpy.array_split``).

    Args:
        problem: the problem.
        order: a topological order (default ``topological_order(problem)``).

    Returns:
        The evaluated Partition (solver "count").
    """
    t0 = time.perf_counter()
    order = _order(problem, order)
    n, k = problem.n, problem.k
    sizes = [n // k + (1 if s < n % k else 0) for s in range(k)]
    return split_to_partition(problem, order, sizes, solver="count",
                              seconds=time.perf_counter() - t0)
