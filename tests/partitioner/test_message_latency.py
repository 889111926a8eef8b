"""[Note: message latency]: a plan's predicted stage times add one link latency per boundary message."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import nowdl
from nowdl.plan.plan import Plan
from nowdl.profiler import BUILTIN_SPECS

TINY: dict[str, Any] = {"depth": 14, "version": 1, "width": 4, "num_classes": 3}


def _plan(tmp_path: Path, latency_s: float, **kw: Any) -> Plan:
    spec = dataclasses.replace(BUILTIN_SPECS["h100"], name=f"h100-lat{latency_s}", link_latency_s=latency_s)
    path = tmp_path / f"spec-{latency_s}.json"
    path.write_text(spec.to_json())
    return nowdl.compile(nowdl.models.resnet(**TINY), device_spec=str(path), mode="estimate", progress=False,
                         cache=False, balance="compute", micro_batches=4, dp=1, **{"spatial_parts": 1, **kw}).plan(torch.empty(1, 3, 64, 64, device="meta"))


def _messages(plan: Plan, s: int) -> int:
    """Messages one rank of stage ``s`` sends or receives per micro-batch: each crossing tensor,
    both ways, once per tile rank of the other stage its own tile meets."""
    def n(a: int, b: int) -> int:  # ranks of stage b that one rank of stage a talks to
        return math.ceil(plan.stages[b].parts / plan.stages[a].parts)

    out = sum(n(s, c) for t in plan.tensors if t.from_stage == s for c in t.to_stages if c != s)
    into = sum(n(s, t.from_stage) for t in plan.tensors if t.from_stage != s and s in t.to_stages)
    return 2 * (out + into)


@pytest.mark.parametrize("kw", [{"gpus": 3, "stages": 3}, {"gpus": 4, "stages": 4, "replicas": 2},
                                {"gpus": 3, "stages": 2, "spatial_parts": 2, "spatial_stages": 1, "replicas": 1}])
def test_each_boundary_message_costs_one_latency(tmp_path: Path, kw: dict[str, Any]) -> None:
    fast, slow = _plan(tmp_path, 1e-5, **kw), _plan(tmp_path, 2e-5, **kw)  # the halo latency too
    assert [s.nodes for s in fast.stages] == [s.nodes for s in slow.stages]  # the solvers do not weigh it
    for a, b in zip(fast.stages, slow.stages, strict=True):
        n = _messages(slow, a.index)
        assert n > 0
        assert b.predicted["comm_s"] - a.predicted["comm_s"] == pytest.approx(n * 1e-5)
        assert b.predicted["time_s"] - a.predicted["time_s"] == pytest.approx(n * 1e-5)
        assert b.predicted["fwd_s"] == a.predicted["fwd_s"] and b.predicted["bwd_s"] == a.predicted["bwd_s"]
    for ra, rb in zip(fast.ranks, slow.ranks, strict=True):  # a MASTER rank holds two stages: both latencies
        held = [h["stage"] for h in rb.stages]
        assert rb.predicted_time_s == pytest.approx(sum(slow.stages[h].predicted["time_s"] for h in held))
        assert rb.predicted_time_s - ra.predicted_time_s == pytest.approx(sum(_messages(slow, h) for h in held) * 1e-5)
    assert slow.predicted["step_s"] > fast.predicted["step_s"]
