"""The spread level (no idle GPU): demo UNet, a toy that idles without it, warnings in plans."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from pathlib import Path

import pytest
import torch
from helpers.problems import check_valid, close, random_problem
from torch import nn

import nowdl
from nowdl.models import unet
from nowdl.partitioner.chain.chain_dp import IDLE_FRACTION, lexicographic, spread_ok
from nowdl.partitioner.costs.no_idle import idle_stages, stage_work
from nowdl.partitioner.costs.problem import NodeVectors, Partition, Problem, StageSpec
from nowdl.partitioner.costs.structure import objective_values, topological_order
from nowdl.partitioner.exact.order_dp import _OrderCosts, _SegmentCosts, solve_dp
from nowdl.partitioner.milp.solve import solve_ilp
from nowdl.partitioner.solver import solve

REPO = Path(__file__).resolve().parents[2]


def _stage_work(plan: nowdl.Plan) -> list[float]:
    return [s.predicted["fwd_s"] + s.predicted["bwd_s"] for s in plan.stages]


def test_demo_unet_has_no_idle_stage() -> None:
    """`make demo`: UNet 2048², 8 GPUs, 8 stages, balance memory: every stage works."""
    x = torch.empty(1, 3, 2048, 2048, device="meta")
    cm = nowdl.compile(unet(), gpus=8, stages=8, balance="memory", mode="estimate",
                       device_spec="h100", progress=False, cache=False)
    plan = cm.plan(x)
    work = _stage_work(plan)
    assert min(work) >= IDLE_FRACTION * max(work), work
    placeholders = {n.name for n in cm.trace(x).gm.graph.nodes if n.op == "placeholder"}
    assert all(not set(s.nodes) <= placeholders for s in plan.stages)
    assert plan.warnings == []
    assert plan.solver["status"] == "optimal"


def idle_toy(objective: str) -> Problem:
    """x -> big -> s1 -> s2 -> s3 -> out in K = 3 stages holding 3, 2, 1 micro-batches.

    ``big`` (10 s, 5 bytes of activations) alone is the time bottleneck wherever it sits,
    and it costs least memory in stage 1; the split that puts it there leaves stage 0 with
    the input only. By time, {x, big} | {s1} | {s2, s3, out} is as fast and keeps every
    stage busy (at a higher memory bottleneck); by memory, nothing else is as lean.
    """
    names = ["x", "big", "s1", "s2", "s3", "out"]
    tim = [0.0, 10.0, 1.0, 1.0, 1.0, 0.0]
    act = [0.0, 5.0, 1.0, 1.0, 1.0, 0.0]
    vec = NodeVectors(act=act, time=tim, workspace=[0.0] * 6, out=[1e-3] * 6)
    return Problem(names=names, edges=[(i, i + 1) for i in range(5)], static=[0.0] * 6,
                   variants={"plain": vec}, stages=[StageSpec(inflight=m) for m in (3, 2, 1)],
                   objective=objective, pinned={0: 0, 5: 2})


def _solvers(p: Problem) -> list[Partition]:
    return [solve_dp(p), solve(p), solve_ilp(p)]


def test_spread_fixes_an_idle_stage() -> None:
    p = idle_toy("compute")
    # levels 1 and 2 alone (time, then memory) leave stage 0 with the input only
    costs = _OrderCosts(p, _SegmentCosts(p, topological_order(p)), None)
    plain = lexicographic(costs, spread=False)
    assert plain is not None and not plain.spread_ok and plain.cuts[:2] == [0, 1]
    for part in _solvers(p):
        check_valid(p, part)
        work = stage_work(p, part.stage_of)
        assert spread_ok(work) and idle_stages(p, part.stage_of) == [], (part.solver, work)
        prim, sec = objective_values(p, part)
        assert close(prim, plain.primary)  # the primary optimum is kept
        assert sec > plain.secondary  # the secondary gave way: an idle GPU is worse


def test_idle_stage_kept_when_the_primary_needs_it() -> None:
    p = idle_toy("memory")
    for part in _solvers(p):
        check_valid(p, part)
        assert idle_stages(p, part.stage_of) == [0], part.solver
        assert close(part.bottleneck_mem, 2 * (5 + 2e-3))  # big alone in stage 1


@pytest.mark.parametrize("seed", range(8))
def test_spread_never_worsens_the_primary(seed: int) -> None:
    rng = random.Random(300 + seed)
    p = random_problem(rng, rng.randint(10, 16), rng.randint(2, 4), master=seed % 3 == 2,
                       objective=rng.choice(["memory", "compute"]), zeros=0.4)
    with_spread = solve_ilp(p, time_limit=20)
    without = solve_ilp(p, time_limit=20, spread=False)
    assert with_spread.status == without.status == "optimal"
    assert close(objective_values(p, with_spread)[0], objective_values(p, without)[0])
    exact = solve(p)
    assert close(objective_values(p, exact)[0], objective_values(p, without)[0])


def test_more_stages_than_work_warns(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    x = torch.randn(4, 64)
    with caplog.at_level(logging.WARNING, logger="nowdl.partitioner.search.best_plan"):
        plan = nowdl.compile(model, gpus=3, stages=3, balance="compute", mode="estimate",
                             device_spec="h100", progress=False, cache=False).plan(x)
    assert plan.config["stages"] == 3
    assert plan.warnings and "less work than 3 stages" in plan.warnings[0]
    assert "--stages" in plan.warnings[0]
    assert any("less work than" in r.getMessage() for r in caplog.records)
    assert "warning:" in str(plan)


def test_memory_split_that_idles_a_stage_says_why_and_offers_compute() -> None:
    # a small MONAI UNet in 2 pinned stages, MASTER: each rank holds a stage 0 (two micro-batches
    # in flight) and a stage 1 (one), so any node moved to stage 0 raises both ranks' memory and the
    # memory optimum gives stage 0 the input alone, though the model has work enough to share
    from monai.networks.nets import UNet

    model = UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2))
    x = torch.randn(1, 1, 64, 64)
    plan = nowdl.compile(model, gpus=2, stages=2, micro_batches=2, dp=1, replicas=2, mode="estimate",
                         device_spec="h100", progress=False, cache=False).plan(x)
    assert plan.warnings, "expected stage 0 to hold the input alone"
    text = plan.warnings[0]
    assert "keeps the fullest GPU lowest leaves it (almost) no work" in text and "less work than" not in text
    assert "--balance compute" in text and "each GPU works already" in text
    balanced = nowdl.compile(model, gpus=2, stages=2, micro_batches=2, dp=1, replicas=2, balance="compute",
                             mode="estimate", device_spec="h100", progress=False, cache=False).plan(x)
    assert not balanced.warnings and all(len(s.nodes) > 1 for s in balanced.stages)


def test_plan_warnings_roundtrip_and_old_plans_load(tmp_path: Path) -> None:
    old = REPO / "experiments" / "unet_2048_8gpu_memory.json"
    d = json.loads(old.read_text())
    d.pop("warnings", None)  # plans written before warnings existed
    plan = nowdl.Plan.from_dict(d)
    assert plan.warnings == []
    assert "warnings" not in plan.to_dict()
    plan = dataclasses.replace(plan, warnings=["3 of 8 stages get less than 5% of the work"])
    again = nowdl.Plan.load(plan.save(tmp_path / "p.json"))
    assert again.warnings == plan.warnings
    assert "warning: 3 of 8 stages" in str(again)
    d["warnings"] = "not a list"
    with pytest.raises(nowdl.errors.PlanError, match="warnings"):
        nowdl.Plan.from_dict(d)
