"""Cheap bounds per candidate configuration, so the search solves only the ones that can win.

[Note: candidate bounds] For any split of a candidate's problem, a rank's load is at least
what its nodes cost wherever they may sit: node v costs at least ``min_s t_s(v)`` seconds
(t_s: the time vector of stage s's kind, so a tileable node may count at 1/P of its time)
and ``min_s static(v) + inflight_s * act_s(v)`` bytes, over the stages s its pins and
tileability allow; boundary tensors and workspace only add. The ranks' loads add up to
sum_s mult_s * load_s (mult_s: how many ranks hold stage s, 2 with MASTER), so

    max rank load >= max( min_s(mult_s) * sum_v cheapest(v) / R,  max_v cheapest(v) ).

With the step model of ``costmodel.predict_step`` (step = (m + K - 1) x slowest rank, at least
m x slowest rank for zero bubble, +
gradient sync, sync >= its value with the parameters spread evenly) the time bound gives an
upper bound on throughput; the memory bound proves a candidate over the cap. Both are
O(n K) numpy per candidate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nowdl.partitioner.config.candidate import Candidate
from nowdl.partitioner.costs.costmodel import Costs, pipeline_slots
from nowdl.partitioner.costs.problem import Problem
from nowdl.partitioner.costs.structure import node_stage_costs, stage_mult, stage_ranges

__all__ = ["Bounds", "candidate_bounds"]


@dataclass(frozen=True)
class Bounds:
    """Lower bounds on a candidate's bottlenecks and the throughput they allow."""

    time_lb: float  # seconds per micro-batch on the slowest rank
    mem_lb: float  # bytes on the fullest rank
    throughput_ub: float  # samples per second


def candidate_bounds(costs: Costs, cand: Candidate, problem: Problem, batch: int) -> Bounds:
    """Bounds of [Note: candidate bounds] for one candidate and its problem.

    Raises:
        InfeasibleError: pins and tileability allow no split (``structure.stage_ranges``).
    """
    mult = stage_mult(problem)
    share = min(mult) / len(problem.rank_stages())
    _, _, allowed = stage_ranges(problem)
    t_min = node_stage_costs(problem, "compute", allowed).min(axis=1)
    m_min = node_stage_costs(problem, "memory", allowed).min(axis=1)
    time_lb = max(share * float(t_min.sum()), float(t_min.max(initial=0.0)))
    mem_lb = max(share * float(m_min.sum()), float(m_min.max(initial=0.0)))
    params = np.asarray([n.param_bytes for n in costs.profile.nodes], dtype=np.float64)
    sync = 0.0
    if cand.dp > 1:
        per_rank = max(share * float(params.sum()), float(params.max(initial=0.0)))
        ar = costs.topology.allreduce if costs.topology is not None else None  # a measured all-reduce
        sync += 2 * (cand.dp - 1) / cand.dp * per_rank / max(costs.link_bw, ar.bw if ar is not None else 0.0)
    if cand.replicas == 2:
        sync += max(float(params.sum()) / cand.stages, float(params.max(initial=0.0))) / costs.link_bw
    step = pipeline_slots(cand, 0.0) * time_lb + sync  # zero bubble: m, its floor
    samples = batch * cand.micro_batches * cand.replicas * cand.dp
    return Bounds(time_lb=time_lb, mem_lb=mem_lb,
                  throughput_ub=samples / step if step > 0 else float("inf"))
