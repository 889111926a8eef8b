"""What norms on sequential tiles cost: the statistics passes' counts per node, and the plan's
time terms (each on its own field, adding up to the stage's time) ([Note: norm passes cost])."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers.norm_nets import NormNet

import nowdl
from nowdl.cli.levers import format_levers
from nowdl.errors import NowdlError
from nowdl.partitioner.costs.costmodel import Costs
from nowdl.partitioner.costs.problem import NodeVectors
from nowdl.partitioner.costs.seqnorms.schedule import layer_wise, refuse_layerwise
from nowdl.partitioner.costs.sequential_tiles import (
    norm_passes,
    schedule_of,
    sequential_vectors,
    time_terms,
    window_inflation,
)
from nowdl.partitioner.spatial.tileable import spatial_rules
from nowdl.plan.plan import Plan
from nowdl.profiler.devices import BUILTIN_SPECS


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


def _host(costs: Costs, memory: float | None, bw: float | None = 1e12, schedule: str = "auto") -> Costs:
    return dataclasses.replace(costs, host_memory=memory, host_link_bw=bw, norm_schedule=schedule)


def test_layerwise_keeps_each_pass_boundary_until_its_last_reader() -> None:
    """NormNet's layer-wise forward ([Note: layer-wise norms cost]) keeps c1 (read by n1 in pass 2),
    c2 and the skip relu (read in pass 3) and c3 (read by n3 in the last pass), each read back once;
    its backward ([Note: layer-wise backward]) starts each segment from the norms' outputs and the
    skip relu, and runs the forward once more over the segments that end at a norm."""
    costs = _costs("gn")
    lw = layer_wise(costs, norm_passes(costs).norms)
    names = [n.name for n in costs.profile.nodes]
    assert {names[i]: lw.reads[i] for i in range(len(names)) if lw.kept[i]} == {"c1": 1, "relu": 1, "c2": 1, "c3": 1}
    assert [sorted(names[i] for i in k) for k in lw.keep] == [["c1"], ["c2", "relu"], ["c3"]]
    # copies of a boundary value: out, back per lower segment and per sums run; its gradient: out
    # per segment, back as a seed and for its norm's sums
    assert {names[i]: c for i, c in enumerate(lw.bwd_copies) if lw.boundary[i]} == {"n1": 6, "relu": 5, "n2": 6,
                                                                                      "n3": 5}
    assert sorted(names[i] for i in range(len(names)) if lw.sums[i]) == sorted(SUMS)


SUMS = ("c1", "n1", "c2", "n2", "relu", "c3", "cat", "n3", "relu_1", "up")  # the segments that end at a norm


def test_layerwise_costs_are_the_host_copies_instead_of_the_passes() -> None:
    """One GPU, 4 tiles, a 1 TB/s host link: the host peak is the backward's boundary (the norms'
    outputs and the skip relu over the windows) for the micro-batch in flight and the gradients
    held while segment 1 runs,
    the host time every copy out and back, the norms' time one more forward of the segments that
    end at a norm; the vectors add up to the terms."""
    costs = _host(_costs("gn"), 1e9)
    nodes, n = costs.profile.nodes, len(costs.profile.nodes)
    w = window_inflation(costs, (2, 2), mean=True)
    out = {x.name: float(x.out_bytes) for x in nodes}
    sched = schedule_of(costs, 1, (2, 2))
    assert (sched.mode, sched.norm) == ("layerwise", "n2")
    bound = out["n1"] + out["relu"] + out["n2"] + out["n3"]  # kept for the backward
    grads = out["relu"] + out["n2"] + out["n3"]  # while segment 1 runs (read from 1 or 0, lying in 1 or 2)
    assert sched.host_bytes == pytest.approx((bound + grads) * w, rel=1e-12)
    copies = (2 * (out["c1"] + out["relu"] + out["c2"] + out["c3"]) + 6 * out["n1"] + 5 * out["relu"]
              + 6 * out["n2"] + 5 * out["n3"])
    assert sched.host_s == pytest.approx(copies * w / 1e12, rel=1e-12)
    plain = time_terms(_host(costs, None), range(n), 1, (2, 2))
    terms = time_terms(costs, range(n), 1, (2, 2))
    assert terms["norm_passes_s"] == pytest.approx(sum(x.fwd_s * w for x in nodes if x.name in SUMS), rel=1e-12)
    assert sched.saved_s == pytest.approx(plain["norm_passes_s"] - terms["norm_passes_s"], rel=1e-12)
    assert terms["norm_host_s"] == pytest.approx(sched.host_s, rel=1e-12) and "norm_host_s" not in plain
    base = NodeVectors(act=[0.0] * n, time=[x.time_s for x in nodes], workspace=[0.0] * n, out=[0.0] * n)
    vec = sequential_vectors(costs, base, 1, 4, (2, 2), 1)
    work = sum(x.fwd_s + x.bwd_s for x in nodes)
    assert sum(vec.time) == pytest.approx(work + sum(terms.values()), rel=1e-12)
    two = schedule_of(costs, 1, (2, 2), inflight=2)  # one more micro-batch's boundary held
    assert two.host_bytes - sched.host_bytes == pytest.approx(bound * w, rel=1e-12)
    ic = _host(_costs("gn", inference=True), 1e9)  # the forward alone: nothing kept for a backward
    wi, oi = window_inflation(ic, (2, 2), mean=True), {x.name: float(x.out_bytes) for x in ic.profile.nodes}
    infer = schedule_of(ic, 1, (2, 2))
    assert infer.host_bytes == pytest.approx((oi["c2"] + oi["relu"]) * wi, rel=1e-12)
    assert infer.host_s == pytest.approx(2 * (oi["c1"] + oi["relu"] + oi["c2"] + oi["c3"]) * wi / 1e12, rel=1e-12)


def test_norm_schedule_takes_the_cheaper_that_fits() -> None:
    """Layer-wise only where the host share holds its peak and its copies cost less than the passes'
    forwards; pinned, it is taken regardless of time, and refused where it does not fit."""
    costs = _costs("gn")
    peak = schedule_of(_host(costs, 1e9), 1, (2, 2)).host_bytes
    assert schedule_of(_host(costs, peak), 1, (2, 2)).mode == "layerwise"
    assert schedule_of(_host(costs, peak * 0.99), 1, (2, 2)).mode == "passes"  # does not fit
    assert schedule_of(_host(costs, None, None), 1, (2, 2)).mode == "passes"  # no host memory
    slow = schedule_of(_host(costs, 1e9, 1e3), 1, (2, 2))  # 1 kB/s: the copies cost more than the passes
    assert slow.mode == "passes" and slow.host_s > slow.saved_s
    assert schedule_of(_host(costs, 1e9, 1e3, "layerwise"), 1, (2, 2)).mode == "layerwise"
    assert schedule_of(_host(costs, 1e9, schedule="passes"), 1, (2, 2)).mode == "passes"
    tight = _host(costs, peak * 0.99, schedule="layerwise")
    with pytest.raises(NowdlError, match=r"^node 'n2': stage 0's norms run layer-wise keep 550.0 KiB per GPU in "
                                         r"host memory .* but there is the 544.5 KiB per GPU the device spec leaves"):
        refuse_layerwise(tight, schedule_of(tight, 1, (2, 2)), 0)


def test_plan_records_the_norm_schedule(tmp_path: Path) -> None:
    """A plan on a spec with host memory runs its norms layer-wise, says so per stage and in the
    levers' lines; a plan without the field (written before it) reads as the passes; a spec whose
    host memory cannot hold the pinned layer-wise schedule is refused, naming the norm and the bytes."""
    spec = tmp_path / "spec.json"
    d = BUILTIN_SPECS["h100"].to_dict()
    spec.write_text(json.dumps({**d, "name": "host", "host_memory": 2**30, "host_link_bw": 1e12}))
    opts = nowdl.PlannerOptions(norm_schedule="layerwise")
    cm = nowdl.compile(NormNet("gn"), gpus=1, mode="estimate", progress=False, cache=False, tiles_per_gpu=4,
                       device_spec=str(spec), planner=opts)
    plan = cm.plan(torch.empty(1, 1, 64, 64, device="meta"))
    st = plan.stages[0]
    assert st.norm_schedule == "layerwise" and st.predicted["norm_host_bytes"] > 0 and st.predicted["comm_s"] == 0.0
    assert "norms layer-wise: +" in format_levers(plan) and "per GPU in host memory" in format_levers(plan)
    old = json.loads(plan.to_json())
    del old["stages"][0]["norm_schedule"]
    assert Plan.from_dict(old).stages[0].norm_schedule == ""
    spec.write_text(json.dumps({**d, "name": "host", "host_memory": 4096, "host_link_bw": 1e12}))
    cm = nowdl.compile(NormNet("gn"), gpus=1, mode="estimate", progress=False, cache=False, tiles_per_gpu=4,
                       device_spec=str(spec), planner=opts)
    with pytest.raises(NowdlError, match=r"^node 'n2': stage 0's norms run layer-wise keep .* per GPU in host "
                                         r"memory .* 3.2 KiB per GPU the device spec leaves"):
        cm.plan(torch.empty(1, 1, 64, 64, device="meta"))
