"""Recomputing a prefix of a stage: its costs (costs/segments.py) and when the search takes it
over the whole stage (search/segments.py)."""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest
import torch

import nowdl
from nowdl.cli.levers import format_levers
from nowdl.partitioner.config.candidate import Candidate
from nowdl.partitioner.costs.costmodel import Costs, build_problem
from nowdl.partitioner.costs.problem import evaluate
from nowdl.partitioner.costs.tied import tied_nodes
from nowdl.partitioner.spatial.tileable import spatial_rules
from nowdl.plot.memory import memory_bars
from nowdl.profiler.devices import BUILTIN_SPECS

PINS = dict(gpus=2, stages=2, micro_batches=4, spatial_parts=1, replicas=1, dp=1, schedule="gpipe")


def _model() -> torch.nn.Module:
    return nowdl.models.unet(depth=2, base_width=8)


def _x() -> torch.Tensor:
    return torch.empty(1, 3, 64, 64, device="meta")


@cache
def _costs() -> Costs:
    cm = nowdl.compile(_model(), gpus=2, mode="estimate", progress=False, cache=False)
    t = cm.trace(_x())
    prof = cm.profile(_x())
    return Costs(profile=prof, rules=spatial_rules(t.gm, prof.out_ranks()), link_bw=450e9, mem_cap=None,
                 tied=tied_nodes(t.gm))


def test_segment_holds_its_prefix_once_and_adds_its_forward() -> None:
    """GPipe, 4 in flight: a prefix of stage 0 recomputed holds its saved bytes once and the rest's
    4 times, and adds the prefix's forward time; the whole stage and no recompute bracket it."""
    costs = _costs()
    nodes = costs.profile.nodes
    n = len(nodes)
    split = [0 if i < n // 2 else 1 for i in range(n)]
    cut = n // 4
    plain = Candidate(2, 4, "gpipe", 1, 1, 1, 0, 0, "square")
    whole = dataclasses.replace(plain, recompute=(0,))
    seg = dataclasses.replace(whole, segments=((0, cut),))
    (m0, t0), (m1, t1), (ms, ts) = (evaluate(build_problem(costs, c, "memory"), split) for c in (plain, whole, seg))
    kept = sum(x.act_bytes for x in nodes[cut:n // 2] if x.op != "placeholder")
    assert kept > 0 and m1[0] < ms[0] < m0[0] and t0[0] < ts[0] < t1[0]
    assert ms[0] - m1[0] == pytest.approx((4 - 1) * kept, rel=1e-9)
    assert ts[0] - t0[0] == pytest.approx(sum(x.fwd_s for x in nodes[:cut]), rel=1e-9)
    assert (ms[1], ts[1]) == (m0[1], t0[1])


def _plan(**kw: object) -> nowdl.Plan:
    return nowdl.compile(_model(), mode="estimate", progress=False, cache=False, **PINS, **kw).plan(_x())  # type: ignore[arg-type]


def _bound(plan: nowdl.Plan) -> float:
    return max(s.predicted["peak_bytes"] + s.predicted["freed_bytes"] for s in plan.stages)


@cache
def _bounds() -> tuple[float, float]:
    """The solvers' peak without recompute and with every stage recomputed whole."""
    return _bound(_plan(recompute="off", offload="off")), _bound(_plan(recompute="on", offload="off"))


def test_a_segment_wins_where_a_prefix_fits() -> None:
    """A cap a little under the plain plan's peak: recomputing a prefix fits and adds less time than
    the whole stage, so "auto" takes it; "on" recomputes whole stages, and is slower."""
    p0, p1 = _bounds()
    cap = p1 + 0.9 * (p0 - p1)
    plan = _plan(recompute="auto", offload="off", gpu_memory=cap)
    segs = [s for s in plan.stages if s.recompute_segment]
    assert len(segs) == 1 and _bound(plan) <= cap * (1 + 1e-9)
    s = segs[0]
    q = s.predicted
    a, b = s.recompute_segment
    assert a == 0 and 0 < b < len(s.nodes)
    assert 0 < q["recompute_s"] < q["fwd_s"] and 0 < q["segment_bytes"] < q["act_bytes"]
    assert q["recomputed_bytes"] == pytest.approx((q["inflight"] - 1) * q["segment_bytes"])
    on = _plan(recompute="on", offload="off", gpu_memory=cap)
    assert all(t.recompute and not t.recompute_segment for t in on.stages)
    assert plan.predicted["step_s"] < on.predicted["step_s"]
    again = nowdl.Plan.from_json(plan.to_json())
    assert [t.recompute_segment for t in again.stages] == [t.recompute_segment for t in plan.stages]
    text = format_levers(plan)
    assert f"stage {s.index}: recompute nodes {s.nodes[0]}..{s.nodes[b - 1]} (" in text
    assert f"{b} of {len(s.nodes)} nodes" in text
    assert any(f"recompute: nodes 0..{b - 1} of {len(s.nodes)}" in bar.label for bar in memory_bars(plan))


def test_the_whole_stage_stays_where_no_prefix_fits() -> None:
    """A cap at the whole-stage recompute's peak: no shorter prefix fits, the plan recomputes whole
    stages as before (no recompute_segment in its JSON)."""
    _, p1 = _bounds()
    plan = _plan(recompute="auto", offload="off", gpu_memory=p1)
    assert any(s.recompute for s in plan.stages)
    assert not any(s.recompute_segment for s in plan.stages)
    assert all("recompute_segment" not in s for s in plan.to_dict()["stages"])
    q = max((s for s in plan.stages if s.recompute), key=lambda s: s.predicted["fwd_s"]).predicted
    assert q["recompute_s"] == pytest.approx(q["fwd_s"])


def test_a_prefix_replaces_offload_where_it_adds_less_time() -> None:
    """The host link set so that offloading the stage adds less time than recomputing it whole
    (so the lever rounds offload it) but more than the prefix: the prefix wins. With the offload
    cheaper than the prefix, the offload stays."""
    p0, p1 = _bounds()
    cap = p1 + 0.9 * (p0 - p1)
    seg = next(s for s in _plan(recompute="auto", offload="off", gpu_memory=cap).stages if s.recompute_segment)
    q = seg.predicted
    a, busy, prefix, whole = q["act_bytes"], q["fwd_s"] + q["bwd_s"], q["recompute_s"], q["fwd_s"]
    assert q["inflight"] > 1 and 0 < prefix < whole

    def plan_at(offload_s: float) -> nowdl.Plan:
        bw = a / (offload_s + busy)  # [Note: host offload]: several in flight, A / bw - (fwd + bwd) exposed
        spec = dataclasses.replace(BUILTIN_SPECS["h100"], name=f"h100-link{bw:.6g}", host_link_bw=bw)
        return _plan(recompute="auto", offload="auto", gpu_memory=cap, device_spec=spec)

    won = plan_at((prefix + whole) / 2).stages[seg.index]
    assert won.recompute_segment == seg.recompute_segment and not won.offload
    kept = plan_at(prefix / 2).stages[seg.index]
    assert kept.offload and not kept.recompute
