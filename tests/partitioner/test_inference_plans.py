"""Inference plans: live activations only, a forward-only schedule, the plan's purpose checked."""

from __future__ import annotations

import pytest
import torch

import nowdl
from nowdl.errors import NowdlError, PlanError
from nowdl.partitioner.costs.inference import inference_profile, live_bytes
from nowdl.plan.purpose import require_inference, require_training
from nowdl.profiler.cost import NodeCost
from nowdl.profiler.memory import AllocTracker
from nowdl.schedule import (
    build_schedule,
    format_plan_schedule,
    simulate,
    stage_deps,
    validate_schedule,
)


def _node(name: str, op: str = "call_module", out: int = 0) -> NodeCost:
    return NodeCost(name, op, "", out_bytes=out, grad_bytes=7, optim_bytes=9, act_bytes=5, saved_bytes=5,
                    bwd_s=1.0, fwd_s=0.5)


def test_live_bytes_frees_each_value_after_its_last_reader() -> None:
    # x -> a -> b -> c -> cat(a, c): a long skip keeps a alive until the cat
    nodes = [_node("x", "placeholder", 1), _node("a", out=10), _node("b", out=20), _node("c", out=30),
             _node("cat", "call_function", 40), _node("p", "get_attr", 1000), _node("output", "output")]
    edges = [("x", "a"), ("a", "b"), ("b", "c"), ("a", "cat"), ("c", "cat"), ("cat", "output")]
    assert live_bytes(nodes, edges) == [1, 11, 31, 61, 81, 41, 41]  # the input x is held throughout
    prof = nowdl.profiler.cost.Profile(nodes=nodes, edges=edges, source="estimate", device="x")
    inf = inference_profile(prof)
    assert [n.workspace_bytes for n in inf.nodes] == [1, 11, 31, 61, 81, 41, 41]
    assert all(n.grad_bytes == n.optim_bytes == n.act_bytes == n.saved_bytes == 0 and n.bwd_s == 0 for n in inf.nodes)
    assert [n.fwd_s for n in inf.nodes] == [n.fwd_s for n in nodes]


def _unet() -> torch.nn.Module:
    torch.manual_seed(0)
    return nowdl.models.unet(3, 2, depth=3, base_width=8)


def test_one_stage_peak_matches_a_no_grad_forward_on_cpu() -> None:
    x = torch.randn(1, 3, 128, 128)
    cm = nowdl.compile(_unet(), gpus=1, mode="estimate", cache=False, progress=False)
    plan = cm.plan(torch.empty(1, 3, 128, 128, device="meta"), train=False)
    assert plan.config["inference"] is True and plan.config["schedule"] == "forward"
    predicted = plan.ranks[0].predicted_peak_bytes
    model = _unet().eval()
    gm = cm.trace(x).gm  # what the stages run (values dropped after their last use)
    static = sum(p.numel() * 4 for p in model.parameters())
    with torch.no_grad(), AllocTracker() as tracker:
        gm(x)
    measured = static + x.numel() * 4 + tracker.peak
    assert 0.9 < measured / predicted < 1.1, (measured, predicted)
    train = nowdl.compile(_unet(), gpus=1, mode="estimate", cache=False, progress=False).plan(
        torch.empty(1, 3, 128, 128, device="meta"))
    assert predicted < 0.5 * train.ranks[0].predicted_peak_bytes  # no gradients, Adam state or saved activations


def test_forward_schedule_of_a_pipelined_inference_plan() -> None:
    cm = nowdl.compile(_unet(), gpus=2, stages=2, micro_batches=3, spatial_parts=1, mode="estimate", cache=False,
                       progress=False)
    plan = cm.plan(torch.empty(1, 3, 64, 64, device="meta"), train=False)
    sched = build_schedule(plan)
    assert {a.kind for acts in sched.values() for a in acts} == {"F"}
    assert [(a.stage, a.microbatch) for a in sched[1]] == [(1, 0), (1, 1), (1, 2)]
    validate_schedule(sched, 2, 3)
    simulate(sched, stage_deps(plan))
    assert "F" in format_plan_schedule(plan)
    assert plan.schedule["inflight"] == [1, 1] and plan.config["pinned"].get("schedule") is None
    assert all(st.predicted["grad_bytes"] == st.predicted["optim_bytes"] == 0 for st in plan.stages)
    # cached separately from the training plan of the same input
    assert "inference" not in cm.plan(torch.empty(1, 3, 64, 64, device="meta")).config


def test_purpose_checks_and_bad_requests() -> None:
    cm = nowdl.compile(_unet(), gpus=1, mode="estimate", cache=False, progress=False)
    x = torch.empty(1, 3, 32, 32, device="meta")
    inf, train = cm.plan(x, train=False), cm.plan(x)
    require_inference(inf)
    require_training(train)
    with pytest.raises(PlanError, match="is an inference plan .* cannot train"):
        require_training(inf)
    with pytest.raises(PlanError, match="is a training plan"):
        require_inference(train)
    with pytest.raises(NowdlError, match="replicas=2"):
        nowdl.compile(_unet(), gpus=2, replicas=2, mode="estimate", progress=False).plan(x, train=False)


@pytest.mark.parametrize(("precision", "gpus"), [("fp32", 2), ("fp32", 1), ("bf16", 1)])
def test_unet_16384_inference_gpus(precision: str, gpus: int) -> None:
    """The built-in UNet at 16384^2 (estimate, H100 80 GiB): training needs 16 GPUs; inference
    plans on ``gpus`` with sequential tiles. Its peak holds the whole input, the whole output
    tiles and one sub-tile's share of the largest live set (the last decoder's cat: the skip, the
    upsampled map and their concatenation at full resolution), so bf16 needs fewer tiles than
    fp32 and each plan's peak is at least that sum."""
    x = torch.empty(1, 3, 16384, 16384, device="meta")
    cm = nowdl.compile(nowdl.models.unet(), gpus=gpus, mode="estimate", device_spec="h100", precision=precision,
                       cache=False, progress=False)
    plan = cm.plan(x, train=False)
    peak = max(r.predicted_peak_bytes for r in plan.ranks)
    tiles = plan.stages[0].tiles_per_gpu
    assert plan.config["gpus"] == gpus and peak <= 80 * 2**30 and tiles > 1
    assert tiles <= (2 if precision == "bf16" else 4)
    prof = inference_profile(cm.profile(x))
    nodes = prof.nodes
    held = sum(n.out_bytes for n in nodes if n.op == "placeholder")
    out = sum(n.out_bytes for n in nodes if n.op != "placeholder" and any(
        u == n.name and nodes[-1].name == v for u, v in prof.edges))
    largest = max(n.workspace_bytes for n in nodes)
    assert peak >= held + out + (largest - held) / tiles
