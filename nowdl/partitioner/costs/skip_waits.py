"""Long-skip gradient waits in a partitioning Problem: whether it charges any, and the Problem without them.

The counts themselves come from the schedule's orders ([Note: long-skip gradient waits] in
schedule/orders.py).
"""

from __future__ import annotations

import dataclasses

from nowdl.partitioner.costs.problem import Problem

__all__ = ["has_waits", "without_waits"]


def has_waits(problem: Problem) -> bool:
    """Whether any stage of ``problem`` charges long-skip gradient waits."""
    return any(any(x > 0 for x in spec.skip_wait) for spec in problem.stages)


def without_waits(problem: Problem) -> Problem:
    """``problem`` with no long-skip gradient waits: what the DPs over cuts optimise (a stage's
    cost there depends on its own two cuts, not on where its received tensors were made), and
    a lower bound of ``problem`` for every split (the waits only add)."""
    return dataclasses.replace(problem, stages=[dataclasses.replace(s, skip_wait=()) for s in problem.stages])
