"""[Note: loss memory]: the loss's bytes on the last stage, measured or by default, and in the plan."""

from __future__ import annotations

import pytest
import torch

import nowdl
from nowdl.profiler.loss_cost import default_loss_cost, measure_loss_cost, output_bytes


def test_cross_entropy_measured() -> None:
    """Per-pixel cross-entropy keeps its log-softmax (one output) and, in its backward, the
    gradients of the log-softmax and of the output (two more); labels count off the CPU only."""
    out = torch.randn(1, 2, 32, 32)
    y = torch.randint(0, 2, (1, 32, 32))
    one = out.numel() * 4
    cpu = measure_loss_cost(torch.nn.CrossEntropyLoss(), out, y, "cpu")
    assert cpu.saved_bytes == pytest.approx(one, abs=64)
    assert cpu.workspace_bytes == pytest.approx(2 * one, abs=64)
    assert cpu.target_bytes == 0 and cpu.source == "measured"
    gpu = measure_loss_cost(torch.nn.CrossEntropyLoss(), out, y, "cuda:0 (NVIDIA H100)")
    assert gpu.target_bytes == y.numel() * 8
    # estimate mode: a GPU spec holds the labels, a CPU spec (built-in or calibrated) does not
    assert measure_loss_cost(torch.nn.CrossEntropyLoss(), out, y, "estimate:h100").target_bytes == y.numel() * 8
    for spec in ("estimate:cpu", "estimate:cpu-1t-calibrated"):
        assert measure_loss_cost(torch.nn.CrossEntropyLoss(), out, y, spec).target_bytes == 0


def _plan(**kw: object) -> nowdl.Plan:
    model = nowdl.models.unet(depth=2, base_width=8)
    cm = nowdl.compile(model, gpus=2, stages=2, micro_batches=4, schedule="1f1b", mode="estimate", dp=1,
                       replicas=1, spatial_parts=1, progress=False, cache=False, **kw)  # type: ignore[arg-type]
    return cm.plan(torch.randn(1, 3, 64, 64), target=torch.randint(0, 2, (1, 64, 64)))


def test_plan_charges_the_loss_on_the_last_stage() -> None:
    default = _plan()
    measured = _plan(loss_fn=torch.nn.CrossEntropyLoss())
    assert default.profile["loss"]["source"] == "default"
    assert measured.profile["loss"]["source"] == "measured"
    lo = measured.profile["loss"]
    # estimate mode plans for a GPU: the labels (int64, one per pixel) are held per micro-batch
    assert lo["target_bytes"] == 64 * 64 * 8
    last = measured.stages[-1].predicted
    assert last["workspace_bytes"] >= lo["workspace_bytes"]
    assert last["saved_bytes"] >= lo["saved_bytes"] + lo["target_bytes"]


def test_default_is_output_sized() -> None:
    model = nowdl.models.unet(depth=2, base_width=8)
    prof = nowdl.profile(model, torch.randn(1, 3, 32, 32), mode="estimate", cache=False, progress=False)
    out = output_bytes(prof)
    assert out > 0
    d = default_loss_cost(prof)
    assert (d.saved_bytes, d.workspace_bytes, d.source) == (out, 2 * out, "default")
