"""Recompute and host offload in the cost model, the search and the plan (costs/levers.py, search/levers.py)."""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest
import torch

import nowdl
from nowdl.errors import InfeasibleError, NowdlError
from nowdl.partitioner.config.candidate import Candidate, PlanRequest
from nowdl.partitioner.costs.costmodel import (
    Costs,
    build_problem,
    predict_step,
    stage_sums,
)
from nowdl.partitioner.costs.levers import HOST_USABLE, host_share, offload_time_s
from nowdl.partitioner.costs.memory_breakdown import stage_memory
from nowdl.partitioner.costs.problem import Partition, boundary_bytes, evaluate
from nowdl.partitioner.costs.tied import tied_nodes
from nowdl.partitioner.spatial.tileable import spatial_rules
from nowdl.profiler.devices import BUILTIN_SPECS, DeviceSpec

PIPE = dict(gpus=2, stages=2, micro_batches=4, spatial_parts=1, replicas=1, dp=1, schedule="1f1b")


def _model() -> torch.nn.Module:
    return nowdl.models.unet(depth=2, base_width=8)


def _x() -> torch.Tensor:
    return torch.empty(1, 3, 64, 64, device="meta")


@cache
def _costs(host_link_bw: float = 55e9) -> Costs:
    cm = nowdl.compile(_model(), gpus=2, mode="estimate", progress=False, cache=False)
    t = cm.trace(_x())
    prof = cm.profile(_x())
    return Costs(profile=prof, rules=spatial_rules(t.gm, prof.out_ranks()), link_bw=450e9, mem_cap=None,
                 tied=tied_nodes(t.gm), host_memory=1e12, host_link_bw=host_link_bw)


def _half(costs: Costs) -> list[int]:
    n = len(costs.profile.nodes)
    return [0 if i < n // 2 else 1 for i in range(n)]


def test_recompute_keeps_one_micro_batch_and_adds_its_forward() -> None:
    """[Note: recompute cost]: stage 0 of 1F1B (2 in flight) drops one micro-batch's saved
    activations, holds its 2 in-flight outputs in their sends ([Note: recompute pending sends])
    and gains its forward time; stage 1 (1 in flight) is untouched."""
    costs = _costs()
    plain = Candidate(2, 4, "1f1b", 1, 1, 1, 0, 0, "square")
    rc = dataclasses.replace(plain, recompute=(0,))
    split = _half(costs)
    mem0, time0 = evaluate(build_problem(costs, plain, "memory"), split)
    mem1, time1 = evaluate(build_problem(costs, rc, "memory"), split)
    nodes = costs.profile.nodes
    stage0 = [n for n, s in zip(nodes, split, strict=True) if s == 0]
    saved = sum(n.act_bytes for n in stage0 if n.op != "placeholder")
    sent = boundary_bytes(build_problem(costs, rc, "memory"), split)[1][0]
    assert saved > 0 and sent > 0 and plain.inflight() == [2, 1]
    assert mem0[0] - mem1[0] == pytest.approx((2 - 1) * saved - 2 * sent, rel=1e-9)
    assert time1[0] - time0[0] == pytest.approx(sum(n.fwd_s for n in stage0), rel=1e-9)
    assert (mem1[1], time1[1]) == (mem0[1], time0[1])


def test_recomputed_stage_peak_holds_its_pending_sends() -> None:
    """[Note: recompute pending sends]: the solvers charge a recomputed stage ``inflight`` more sent
    tensors; the plan's peak keeps at least its recompute forward's (the bound less the workspace
    and less at most one micro-batch's outputs, already in its saved bytes) and at most the bound."""
    costs = _costs()
    split = _half(costs)
    for sched, m in (("1f1b", 4), ("gpipe", 4), ("gpipe", 2)):
        rc = Candidate(2, m, sched, 1, 1, 1, 0, 0, "square", recompute=(0,))
        plain = dataclasses.replace(rc, recompute=())
        bound = evaluate(build_problem(costs, rc, "memory"), split)[0][0]
        mem, mem_plain = stage_memory(costs, rc, split)[0], stage_memory(costs, plain, split)[0]
        inflight = plain.inflight()[0]
        assert mem["send_bytes"] > 0 and mem["send_held"] == mem_plain["send_held"] + inflight
        peak = bound - mem["freed_bytes"]
        assert bound - mem["workspace_bytes"] - mem["send_bytes"] - 1e-6 <= peak <= bound


def test_offload_moves_saved_bytes_to_host_and_charges_the_link() -> None:
    """[Note: host offload]: the stage's saved bytes leave the GPU; the copies the compute does
    not hide are added to the predicted stage time."""
    slow = 1e7  # 10 MB/s: the copies cannot hide behind the compute
    costs = _costs(host_link_bw=slow)
    off = Candidate(2, 4, "1f1b", 1, 1, 1, 0, 0, "square", offload=(0,))
    split = _half(costs)
    mem = stage_memory(costs, off, split)
    nodes = costs.profile.nodes
    inputs = sum(n.act_bytes for n, s in zip(nodes, split, strict=True) if s == 0 and n.op == "placeholder")
    assert mem[0]["saved_bytes"] == pytest.approx(inputs)
    sums = stage_sums(costs, off, split)
    a, f, b = sums[0]["act_bytes"], sums[0]["fwd_s"], sums[0]["bwd_s"]
    assert offload_time_s(off, sums, slow) == [pytest.approx(a / slow - (f + b)), 0.0]  # 2 in flight: full duplex
    one = dataclasses.replace(off, micro_batches=1)  # one in flight: out during F, back during B
    assert offload_time_s(one, stage_sums(costs, one, split), slow)[0] == pytest.approx(2 * a / slow - f - b)
    problem = build_problem(costs, off, "memory")
    _, times = evaluate(problem, split)
    part = Partition(stage_of=split, stage_mem=[0.0, 0.0], stage_time=times, rank_mem=[0.0, 0.0], rank_time=times)
    plain = predict_step(costs, dataclasses.replace(off, offload=()), part, 1)
    assert predict_step(costs, off, part, 1)["step_s"] > plain["step_s"] + 4 * (a / slow - f - b) * 0.99


def test_host_share_is_the_node_memory_over_its_gpus() -> None:
    h100 = BUILTIN_SPECS["h100"]
    assert h100.host_memory == 2 * 2**40 and h100.host_link_bw == 55e9
    assert host_share(h100, "h100") == pytest.approx(HOST_USABLE * 2 * 2**40 / 8)  # DGX H100: 8 GPUs
    assert host_share(dataclasses.replace(h100, host_memory=None), "h100") is None
    again = DeviceSpec.from_dict(h100.to_dict())
    assert again.host_memory == h100.host_memory and again.host_link_bw == h100.host_link_bw
    with pytest.raises(NowdlError, match="host_memory"):
        DeviceSpec.from_dict({**h100.to_dict(), "host_memory": -1})


def _plan(**kw: object) -> nowdl.Plan:
    return nowdl.compile(_model(), mode="estimate", progress=False, cache=False, **kw).plan(_x())  # type: ignore[arg-type]


def _bound(plan: nowdl.Plan) -> float:
    """The solvers' peak (what the cap is checked against): the plan's peak plus what it frees."""
    return max(s.predicted["peak_bytes"] + s.predicted["freed_bytes"] for s in plan.stages)


def test_unet_refused_without_recompute_plans_with_auto() -> None:
    """A cap between the leanest plain split and the leanest recomputed one: refused with
    recompute="off", planned with "auto", which recomputes where that saves (GPipe: every stage
    holds 4 micro-batches; under 1F1B the last holds one, where recomputing saves nothing, and
    the first's saving is what its in-flight outputs, pending in their sends, leave of it)."""
    pins = {**PIPE, "schedule": "gpipe"}
    plain = _plan(recompute="off", offload="off", **pins)
    forced = _plan(recompute="on", offload="off", **pins)
    assert all(s.recompute for s in forced.stages)
    p0, p1 = _bound(plain), _bound(forced)
    assert p1 < p0
    cap = (p0 + p1) / 2
    with pytest.raises(InfeasibleError):
        _plan(recompute="off", offload="off", gpu_memory=cap, **pins)
    plan = _plan(recompute="auto", offload="off", gpu_memory=cap, **pins)
    chosen = [s.index for s in plan.stages if s.recompute]
    assert chosen and not any(s.offload for s in plan.stages)
    assert _bound(plan) <= cap * (1 + 1e-9)
    q = plan.stages[chosen[-1]].predicted
    if plan.stages[chosen[-1]].recompute_segment:  # a prefix fits: its forward again ([Note: shorter recompute])
        assert 0 < q["recompute_s"] < q["fwd_s"]
        assert q["recomputed_bytes"] == pytest.approx((q["inflight"] - 1) * q["segment_bytes"])
    else:
        assert q["recompute_s"] == pytest.approx(q["fwd_s"])  # its forward again, in its stage time
        assert q["recomputed_bytes"] == pytest.approx((q["inflight"] - 1) * q["act_bytes"])
    assert q["time_s"] >= q["fwd_s"] + q["bwd_s"] + q["recompute_s"] and q["saved_held"] == 1.0
    assert plan.config["recompute"] == "auto" and plan.config["offload"] == "off"
    again = nowdl.Plan.from_json(plan.to_json())
    assert [s.index for s in again.stages if s.recompute] == chosen
    assert again.stages[chosen[-1]].predicted["recompute_s"] == q["recompute_s"]


def test_offload_respects_host_memory() -> None:
    """Forced offload: refused naming the host memory when the spec has too little, or none."""
    small = dataclasses.replace(BUILTIN_SPECS["h100"], name="h100-smallhost", host_memory=1024)
    with pytest.raises(InfeasibleError, match="host memory"):
        _plan(offload="on", device_spec=small, **PIPE)
    none = dataclasses.replace(BUILTIN_SPECS["h100"], name="h100-nohost", host_memory=None)
    with pytest.raises(NowdlError, match="needs host memory"):
        _plan(offload="on", device_spec=none, **PIPE)
    plan = _plan(offload=[0], recompute="off", **PIPE)
    assert [s.offload for s in plan.stages] == [True, False]
    assert plan.stages[0].predicted["offloaded_bytes"] > 0
    assert plan.stages[0].predicted["offloaded_bytes"] <= plan.config["host_memory"]


def test_forced_stage_list_and_the_old_alias() -> None:
    plan = _plan(gpus=2, recompute=[1], offload="off")
    assert plan.config["stages"] >= 2 and plan.stages[1].recompute
    assert [s.index for s in plan.stages if s.recompute] == [1]
    cm = nowdl.compile(_model(), gpus=2, activation_checkpointing=[0])
    assert cm.request is not None and cm.request.recompute == (0,)
    cm = nowdl.compile(_model(), gpus=2, activation_checkpointing=True)
    assert cm.request is not None and cm.request.recompute == "on"


@pytest.mark.parametrize("kw,match", [
    (dict(recompute="sometimes"), "recompute='sometimes' is not a valid recompute setting"),
    (dict(offload=1.5), "offload=1.5 is not a valid offload setting"),
    (dict(recompute=[-1]), "recompute=\\[-1\\]"),
    (dict(recompute=["a"]), "recompute=\\['a'\\]"),
    (dict(recompute=[0, 5], stages=2), "names stage\\(s\\) \\[5\\], but the plan is pinned to 2 stages"),
    (dict(offload=[3]), "names stage\\(s\\) \\[3\\], but 2 GPUs hold at most 2 stages"),
    (dict(recompute="on", offload=[1]), "both name stage\\(s\\) \\[1\\]"),
])
def test_bad_lever_settings(kw: dict[str, object], match: str) -> None:
    with pytest.raises(NowdlError, match=match):
        PlanRequest(gpus=2, **kw)  # type: ignore[arg-type]
    with pytest.raises(NowdlError, match=match):
        nowdl.compile(_model(), gpus=2, **kw)  # type: ignore[arg-type]


def test_alias_disagreeing_with_recompute() -> None:
    with pytest.raises(NowdlError, match="activation_checkpointing=True and recompute='off' disagree"):
        nowdl.compile(_model(), gpus=2, activation_checkpointing=True, recompute="off")


def test_a_plan_that_fits_without_levers_does_not_change() -> None:
    """[Note: choosing levers]: levers only buy memory; under the default 80 GiB cap nothing is
    over it, so "auto" plans exactly what "off" plans."""
    auto = _plan(gpus=4)
    off = _plan(gpus=4, recompute="off", offload="off")
    assert not any(s.recompute or s.offload for s in auto.stages)
    assert [s.nodes for s in auto.stages] == [s.nodes for s in off.stages]
    keys = ("stages", "micro_batches", "schedule", "replicas", "dp", "spatial")
    assert {k: auto.config[k] for k in keys} == {k: off.config[k] for k in keys}
    assert auto.predicted["step_s"] == off.predicted["step_s"]


@pytest.mark.slow
def test_no_plan_offloads_more_than_the_host_holds() -> None:
    """ResNet-110-v2 at 8192² on 4 H100s: the final MILP (MASTER) moved the split so that the
    offloaded stages needed 1.1 TiB of host memory per GPU, over the spec's 204.8 GiB; the
    screened split is kept (or the plan refused) instead. MASTER with 8 micro-batches on 2 stages
    pinned, so that the whole search runs within its time limit."""
    x = torch.empty(1, 3, 8192, 8192, device="meta")
    cm = nowdl.compile(nowdl.models.resnet110v2(), gpus=4, mode="estimate", device_spec="h100",
                       gpu_memory="80GiB", progress=False, cache=False, replicas=2, stages=2, micro_batches=8,
                       planner=nowdl.PlannerOptions(time_limit=60))
    try:
        plan = cm.plan(x)
    except InfeasibleError as e:
        assert str(e).startswith(("host memory: ", "nothing fits")), e  # not "time limit:"
        return
    share = plan.config["host_memory"]
    assert all(s.predicted.get("offloaded_bytes", 0.0) <= share * (1 + 1e-6) for s in plan.stages)


def _norm_unet_costs(latency_s: float) -> Costs:
    from nowdl.plan.topology import make_topology

    cm = nowdl.compile(nowdl.models.unet(depth=2, base_width=8, norm=True), gpus=2, mode="estimate",
                       progress=False, cache=False)
    t = cm.trace(_x())
    prof = cm.profile(_x())
    return Costs(profile=prof, rules=spatial_rules(t.gm, prof.out_ranks()), link_bw=450e9, mem_cap=None,
                 tied=tied_nodes(t.gm), topology=make_topology(2, link_bw=450e9, link_latency_s=latency_s))


def test_recomputed_tiles_wait_for_their_forward_halos_and_norm_reduces_again() -> None:
    """[Note: recompute cost], [Note: tile norm latency]: a recomputed spatial stage pays each
    forward halo exchange's latency and each norm's statistics all-reduce again: raising the link
    latency by d adds at least d per halo conv and per norm to the recompute's time (the compute
    hides none of a 10 ms wait), and twice d per norm to the plain tiled stage (forward and backward)."""
    cand = dataclasses.replace(Candidate(1, 2, "gpipe", 1, 1, 2, 1, 0, "square"), recompute=(0,))
    figures = {}
    for lat in (1e-5, 1e-2):
        p = build_problem(_norm_unet_costs(lat), cand, "throughput")
        key = p.stages[0].variant
        base = p.variants[key.split("+rc")[0]]
        figures[lat] = (sum(base.time), sum(p.variants[key].time) - sum(base.time))
    costs = _norm_unet_costs(1e-5)
    rules = [costs.rules.get(n.name) for n in costs.profile.nodes]
    halos = sum(1 for r in rules if r is not None and r.tileable and r.kind in ("conv", "pool") and any(r.halo))
    norms = sum(1 for r in rules if r is not None and r.kind == "norm")
    assert halos > 0 and norms > 0
    d = 1e-2 - 1e-5
    assert figures[1e-2][1] - figures[1e-5][1] >= (halos + norms) * d * 0.99
    assert figures[1e-2][0] - figures[1e-5][0] >= 2 * norms * d * 0.99
