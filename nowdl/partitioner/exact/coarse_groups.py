"""Groups of original nodes after coarsening, and a coarse split mapped back onto them.

``coarsen`` ([Note: exact merges] in coarsen.py) returns groups; these helpers compose two
coarsenings and expand a coarse partition to the original nodes (re-evaluated there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.structure import make_partition

__all__ = ["compose_groups", "expand"]


def compose_groups(outer: Sequence[Sequence[int]], inner: Sequence[Sequence[int]]) -> list[list[int]]:
    """Groups of original nodes after coarsening twice.

    Args:
        outer: groups of the first coarsening (original indices).
        inner: groups of the second one (indices into ``outer``).

    Returns:
        For each node of the twice-coarsened problem, its original nodes, sorted.
    """
    return [sorted(v for i in grp for v in outer[i]) for grp in inner]


def expand(
    partition: Partition, groups: Sequence[Sequence[int]], problem: Problem, *, exact: bool = True
) -> Partition:
    """Map a partition of the coarse problem back onto the original nodes.

    Args:
        partition: a partition of the coarse problem.
        groups: the groups ``coarsen`` returned.
        problem: the original problem.
        exact: False if the coarsening used greedy merges: an "optimal" status then
            becomes "coarse-optimal" and the gap NaN (optimal for the coarse graph only).

    Returns:
        The partition of ``problem``, re-evaluated with ``evaluate()``.

    Raises:
        ValueError: if the groups do not cover the original nodes exactly once.
    """
    stage_of = [-1] * problem.n
    if len(groups) != len(partition.stage_of):
        raise ValueError(
            f"{len(groups)} groups but the partition has {len(partition.stage_of)} nodes"
        )
    for g, grp in enumerate(groups):
        for v in grp:
            if not 0 <= v < problem.n or stage_of[v] != -1:
                raise ValueError(f"group {g} holds node {v} twice or out of range")
            stage_of[v] = partition.stage_of[g]
    if -1 in stage_of:
        raise ValueError(f"node {problem.names[stage_of.index(-1)]} is in no group")
    status, gap = partition.status, partition.gap
    if not exact:
        gap = math.nan
        if status == "optimal":
            status = "coarse-optimal"
    return make_partition(problem, stage_of, solver=partition.solver, status=status, gap=gap,
                          seconds=partition.seconds)
