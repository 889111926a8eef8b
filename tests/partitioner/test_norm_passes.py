"""What norms on sequential tiles cost: the statistics passes' counts per node, and the plan's
time terms (each on its own field, adding up to the stage's time) ([Note: norm passes cost])."""

from __future__ import annotations

import pytest
import torch
from helpers.norm_nets import NormNet

import nowdl
from nowdl.cli.levers import format_levers
from nowdl.partitioner.costs.costmodel import Costs
from nowdl.partitioner.costs.problem import NodeVectors
from nowdl.partitioner.costs.sequential_tiles import norm_passes, sequential_vectors, time_terms
from nowdl.partitioner.spatial.tileable import spatial_rules


def _costs(kind: str, side: int = 64, inference: bool = False) -> Costs:
    cm = nowdl.compile(NormNet(kind), gpus=1, mode="estimate", progress=False, cache=False)
    x = torch.empty(1, 1, side, side, device="meta")
    prof = cm.profile(x)
    return Costs(profile=prof, rules=spatial_rules(cm.trace(x).gm, prof.out_ranks()), link_bw=1e9, mem_cap=None,
                 inference=inference)


def test_norm_pass_counts_per_node() -> None:
    """NormNet: norms n1 -> n2 -> n3 (n1 also straight to n3): forward levels 1, 2, 3, backward 3, 2, 1."""
    costs = _costs("bn")
    p = norm_passes(costs)
    assert (p.forward_passes, p.backward_passes) == (3, 3)
    fwd = {n.name: f for n, f in zip(costs.profile.nodes, p.fwd, strict=True)}
    bwd = {n.name: b for n, b in zip(costs.profile.nodes, p.bwd, strict=True)}
    # forwards: the levels whose norms a node feeds, plus one recomputation per backward pass
    assert (fwd["c1"], fwd["n1"], fwd["c2"], fwd["n2"], fwd["c3"], fwd["n3"], fwd["head"]) == (6, 6, 5, 5, 4, 4, 3)
    # backwards: the backward levels with a norm before the node
    assert (bwd["c1"], bwd["n1"], bwd["c2"], bwd["n2"], bwd["c3"], bwd["n3"], bwd["head"]) == (0, 0, 1, 1, 2, 2, 3)
    infer = norm_passes(_costs("bn", inference=True))
    assert infer.forward_passes == 0 and not any(infer.fwd)  # BatchNorm in eval: its running statistics
    gn = norm_passes(_costs("gn", inference=True))
    assert (gn.forward_passes, gn.backward_passes) == (3, 0) and max(gn.fwd) == 3


@pytest.mark.parametrize("inference", [False, True])
def test_sequential_time_is_the_work_plus_its_terms(inference: bool) -> None:
    """One GPU, 4 tiles: every node's time in the sequential vectors is its work plus exactly the
    terms the plan reports apart (forward recomputed, margins, statistics passes), to rounding."""
    costs = _costs("gn", inference=inference)
    n = len(costs.profile.nodes)
    base = NodeVectors(act=[0.0] * n, time=[x.time_s if not inference else x.fwd_s for x in costs.profile.nodes],
                       workspace=[0.0] * n, out=[0.0] * n)
    vec = sequential_vectors(costs, base, 1, 4, (2, 2), 1)
    terms = time_terms(costs, range(n), 1, (2, 2))
    work = sum((x.fwd_s if inference else x.fwd_s + x.bwd_s) for x in costs.profile.nodes)
    assert sum(vec.time) == pytest.approx(work + sum(terms.values()), rel=1e-12)
    assert terms["norm_passes_s"] > (0.5 if inference else 2.0) * work  # several passes, each a large share
    if not inference:
        assert terms["seq_recompute_s"] >= sum(x.fwd_s for x in costs.profile.nodes if x.out_shape
                                               and len(x.out_shape) == 4)


def test_plan_reports_sequential_terms_apart_from_comm() -> None:
    """A plan on one GPU sends nothing: its stage's comm_s is 0 and its time is the work, the
    forward recomputed, the margins and the statistics passes, each on its own field."""
    cm = nowdl.compile(NormNet("in"), gpus=1, mode="estimate", progress=False, cache=False, tiles_per_gpu=4)
    plan = cm.plan(torch.empty(1, 1, 64, 64, device="meta"))
    q = plan.stages[0].predicted
    assert plan.stages[0].tiles_per_gpu == 4 and q["comm_s"] == 0.0
    parts = q["fwd_s"] + q["bwd_s"] + q["seq_recompute_s"] + q["seq_margin_s"] + q["norm_passes_s"]
    assert q["time_s"] == pytest.approx(parts + q.get("recompute_s", 0.0) + q.get("offload_s", 0.0), rel=1e-6)
    assert q["norm_passes_s"] > q["seq_recompute_s"] > 0.0 and q["seq_margin_s"] > 0.0
    line = format_levers(plan).splitlines()[-1]
    assert line.startswith("stage 0: 4 tiles per GPU in turn (+") and "forward recomputed in the backward" in line
    assert "on the tiles' margins" in line and "statistics passes for its norms" in line
