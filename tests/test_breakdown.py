"""The plan's memory breakdown adds up to each stage's predicted peak (pipeline, MASTER, spatial)."""

from __future__ import annotations

import pytest
import torch

import nowdl
from nowdl.partitioner.breakdown import MEMORY_KEYS


@pytest.mark.parametrize(
    "kw",
    [dict(gpus=4, stages=4), dict(gpus=4, stages=4, replicas=2, dp=1),
     dict(gpus=6, stages=2, spatial_parts=[4, 2], dp=1, replicas=1)],
    ids=["pipeline", "master", "spatial"],
)
def test_breakdown_sums_to_peak(kw: dict[str, object]) -> None:
    model = nowdl.models.unet(depth=2, base_width=8)
    plan = nowdl.compile(model, balance="memory", mode="estimate", **kw).plan(  # type: ignore[arg-type]
        torch.empty(1, 3, 64, 64, device="meta"))
    for s in plan.stages:
        q = s.predicted
        assert set(MEMORY_KEYS) <= set(q)
        static = q["weight_bytes"] + q["grad_bytes"] + q["optim_bytes"]
        assert static == pytest.approx(q["static_bytes"])
        held = q["inflight"] * (q["saved_bytes"] + q["recv_bytes"] + q["send_bytes"])
        assert static + held + q["workspace_bytes"] == pytest.approx(q["peak_bytes"], rel=1e-9)
    again = nowdl.Plan.from_json(plan.to_json())
    assert again.stages[0].predicted["saved_bytes"] == plan.stages[0].predicted["saved_bytes"]
