"""The configuration space a model allows: whether its ends can run on tiles, how many stages
a search may try, and the micro-batch size it was profiled at."""

from __future__ import annotations

import dataclasses

from nowdl.partitioner.config.candidate import PlanRequest
from nowdl.partitioner.costs.costmodel import Costs
from nowdl.partitioner.costs.problem import Problem

__all__ = ["tileable_ends", "max_stages", "batch_of", "image_of", "uncapped"]


def uncapped(p: Problem) -> Problem:
    """The problem without its memory cap."""
    return dataclasses.replace(p, mem_cap=None)


def batch_of(costs: Costs) -> int:
    """Samples per micro-batch: the profiled input's batch size."""
    shapes = costs.profile.input_shapes
    return int(shapes[0][0]) if shapes and shapes[0] else 1


def image_of(costs: Costs) -> tuple[int, ...] | None:
    """The spatial dims of the model's (first) input, or None when it has none."""
    shapes = costs.profile.input_shapes
    return tuple(int(d) for d in shapes[0][2:]) if shapes and len(shapes[0]) >= 3 else None


def tileable_ends(costs: Costs) -> tuple[bool, bool]:
    """Does the graph start with tileable ops, and does it end with them (UNet decoder)?"""
    prof = costs.profile
    rules = costs.rules
    compute = [n for n in prof.nodes if n.op not in ("placeholder", "output", "get_attr")]
    if not compute:
        return False, False
    front = rules[compute[0].name].tileable if compute[0].name in rules else False
    out_inputs = [u for u, v in prof.edges if prof[v].op == "output"]
    back = bool(out_inputs) and all(rules.get(u) is not None and rules[u].tileable for u in out_inputs)
    if back:
        # every node must be tileable for a mirrored decoder region to make sense (fully convolutional)
        back = all(rules[n.name].tileable for n in compute if n.name in rules)
    return front, back


def max_stages(costs: Costs, req: PlanRequest | None = None) -> int:
    """Stages a search may try: one per compute node; a pinned count may go up to one per node
    (the plan then warns about the idle GPUs)."""
    compute = max(1, sum(1 for n in costs.profile.nodes if n.op not in ("placeholder", "output", "get_attr")))
    if req is not None and req.stages is not None:
        return max(compute, min(req.stages, len(costs.profile.nodes)))
    return compute
