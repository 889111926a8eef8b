"""A coarse DP's split solved once more with the long-skip waits folded into its stages.

[Note: wait reweighting] The DP over ideals ([Note: ideal DP]) prices a stage by its two cuts
only, so it leaves out the long-skip gradient waits ([Note: long-skip gradient waits]): a stage
holds ``skip_wait[i]`` more copies of each tensor it receives from stage ``i``, which depends on
where the tensor was produced, not on the stage's cuts. On AmoebaNet-D (K = 8, memory: a cell
reads the cell two back) the coarse DP's wait-free optimum was 7.9% above the proven optimum once
the waits were charged. The waits of the DP's own split say how many extra copies stage ``s``
holds per byte it receives, ``w_s = wait_s / recv_s``; the same DP over the same ideals, with
each stage's received bytes held ``recv_factor + w_s`` times, then balances the loads the split
would really have. The better of the two splits (judged with the waits, by ``evaluate``) is
kept: never worse than the first. On AmoebaNet-D: 1.079x -> 1.031x of the optimum (151 groups),
1.063x -> 1.042x (133 groups), unchanged at 1.018x (168 groups), for one more DP (0.3-0.5 s of
CPU). A heuristic: the received tensors of the second split may come from other stages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from nowdl.partitioner.costs.problem import Partition, Problem, boundary_bytes
from nowdl.partitioner.costs.skip_waits import has_waits
from nowdl.partitioner.costs.structure import make_partition, objective_values
from nowdl.partitioner.exact.coarse_groups import expand
from nowdl.partitioner.exact.downsets import Lattice
from nowdl.partitioner.exact.ideal_dp import solve_ideals

__all__ = ["with_waits_folded"]


def with_waits_folded(problem: Problem, small: Problem, groups: Sequence[Sequence[int]], lat: Lattice,
                      part: Partition) -> list[int]:
    """The stages of ``problem``'s nodes from ``part`` (a DP split of the coarse ``small``, whose
    ``groups`` and ideals ``lat`` it came from), or from the DP re-run with the waits folded in
    ([Note: wait reweighting]) when that split is better with the waits charged."""
    first = expand(part, groups, problem, exact=False).stage_of
    if not has_waits(problem):
        return first
    recv, _, wait = boundary_bytes(problem, first)
    stages = [dataclasses.replace(st, recv_held=st.recv_factor + (w / r if r > 0 else 0.0))
              for st, w, r in zip(small.stages, wait, recv, strict=True)]
    again = solve_ideals(dataclasses.replace(small, stages=stages), lat)
    if again is None:
        return first
    second = expand(again, groups, problem, exact=False).stage_of
    better = (objective_values(problem, make_partition(problem, second))
              < objective_values(problem, make_partition(problem, first)))
    return second if better else first
