"""The memory picture of a plan that recomputes and offloads: bars still add up to the peak, and
the bytes kept off the GPU are drawn above them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nowdl
from nowdl.plot.memory import OFF_DEVICE, memory_bars

PIPE = dict(gpus=2, stages=2, micro_batches=4, spatial_parts=1, replicas=1, dp=1, schedule="1f1b")


def test_bars_show_recomputed_and_offloaded_bytes(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plan = nowdl.compile(nowdl.models.unet(depth=2, base_width=8), mode="estimate", progress=False, cache=False,
                         recompute=[0], offload=[1], **PIPE).plan(torch.empty(1, 3, 64, 64, device="meta"))  # type: ignore[arg-type]
    bars = memory_bars(plan)
    for b in bars:
        assert sum(b.parts.values()) == pytest.approx(b.peak, rel=1e-9)
        assert set(b.off_device) <= set(OFF_DEVICE)
    assert bars[0].off_device["recomputed (not held)"] == plan.stages[0].predicted["recomputed_bytes"] > 0
    assert bars[1].off_device["offloaded to host"] == plan.stages[1].predicted["offloaded_bytes"] > 0
    from nowdl.cli.pictures import draw_plan

    out = tmp_path / "p.png"
    draw_plan(plan, str(out), quiet=True)
    assert out.stat().st_size > 0
