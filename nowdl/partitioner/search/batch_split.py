"""The micro-batch size: the costs of b samples from a profile of b0, and why a global batch was chosen.

[Note: micro-batch size] With a global batch G the search splits it as micro-batches m x
replicas x dp x b (``config.batch_splits``). With m pinned, b = G / (m x replicas x dp). With m
free, b stays the example's size b0 (m = G / (b0 x replicas x dp)): a micro-batch of more samples
is never predicted faster or leaner under this linear cost model (1F1B and GPipe take
(m + K - 1) x b x t1 with m x b fixed, and hold b samples' activations per micro-batch in flight;
only the per-message latency of fewer micro-batches would favour it, less than the bubble costs).
A candidate of b samples per micro-batch is costed
from the profile of the example's b0 samples scaled by b / b0: each node's forward and backward
time, FLOPs, output, saved activations and workspace (and the batch dim of its output shape);
weights, gradients and optimizer state do not scale. Estimate mode's roofline times are linear in
the batch but for their fixed per-op latency, which this counts b / b0 times (an overestimate for
b > b0); measured times are as linear as the kernels are. The plan is built from the scaled
costs, so its tensors and recorded input carry b samples.
"""

from __future__ import annotations

import dataclasses

from nowdl.partitioner.config.candidate import MICRO_BATCH_CHOICES, Candidate, PlanRequest
from nowdl.partitioner.costs.costmodel import Costs
from nowdl.profiler.cost import NodeCost

__all__ = ["scaled_costs", "CostsByBatch", "batch_choice"]


def _scale_node(n: NodeCost, b0: int, b: int) -> NodeCost:
    f = b / b0
    shape = n.out_shape
    if shape is not None and len(shape) >= 1 and shape[0] == b0:
        shape = (b, *shape[1:])
    return dataclasses.replace(
        n, fwd_s=n.fwd_s * f, bwd_s=n.bwd_s * f, flops=round(n.flops * f), out_bytes=round(n.out_bytes * f),
        out_shape=shape, saved_bytes=round(n.saved_bytes * f), act_bytes=round(n.act_bytes * f),
        workspace_bytes=round(n.workspace_bytes * f))


def scaled_costs(costs: Costs, b0: int, b: int) -> Costs:
    """``costs`` for micro-batches of ``b`` samples, from a profile of ``b0`` ([Note: micro-batch size])."""
    if b == b0:
        return costs
    prof = costs.profile
    shapes = [list(s) for s in prof.input_shapes]
    for s in shapes:
        if s and s[0] == b0:
            s[0] = b
    scaled = dataclasses.replace(prof, nodes=[_scale_node(n, b0, b) for n in prof.nodes], input_shapes=shapes)
    return dataclasses.replace(costs, profile=scaled)


class CostsByBatch:
    """Scaled costs per micro-batch size, made once per search."""

    def __init__(self, costs: Costs, b0: int) -> None:
        self.base, self.b0 = costs, b0
        self._made: dict[int, Costs] = {b0: costs}

    def __call__(self, b: int) -> Costs:
        if b not in self._made:
            self._made[b] = scaled_costs(self.base, self.b0, b)
        return self._made[b]


def batch_choice(req: PlanRequest, cand: Candidate) -> str:
    """One sentence: the global batch of ``cand`` and why ([Note: micro-batch size])."""
    split = (f"{cand.micro_batches} micro-batch{'es' if cand.micro_batches != 1 else ''} of "
             f"{cand.micro_batch_size} sample{'s' if cand.micro_batch_size != 1 else ''}"
             + (" x 2 replicas" if cand.replicas == 2 else "") + (f" x dp {cand.dp}" if cand.dp > 1 else ""))
    g = cand.global_batch()
    if req.global_batch is not None:
        how = ("the samples per micro-batch as pinned" if req.micro_batch_size is not None
               else "the split with the highest predicted throughput that fits")
        return f"global batch {g} as given, split into {split}: {how}"
    tried = (f"{req.micro_batches} micro-batch{'es' if req.micro_batches != 1 else ''} (pinned)" if req.micro_batches
             else "micro-batches " + ", ".join(str(m) for m in MICRO_BATCH_CHOICES))
    return (f"global batch {g} chosen by the planner ({split}): no batch size was given, so it tried {tried} "
            f"of the example's {cand.micro_batch_size} sample{'s' if cand.micro_batch_size != 1 else ''} with every "
            "replica and dp count and kept the highest predicted throughput that fits; give the batch with "
            "--batch-size N (compile(global_batch=N)) to fix it")
