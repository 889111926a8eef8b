"""Precision in the plan: bf16/fp16 activations and sent tensors at that width, fp32 state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nowdl
from nowdl.cli.commands import main


def _plan(precision: str, mode: str = "estimate") -> nowdl.Plan:
    m = nowdl.models.unet(in_channels=1, out_channels=2, depth=2, base_width=8)
    x = torch.empty(1, 1, 64, 64, device="meta") if mode == "estimate" else torch.randn(1, 1, 64, 64)
    cm = nowdl.compile(m, gpus=2, stages=2, micro_batches=2, dp=1, replicas=1, progress=False,
                       precision=precision, mode=mode, halo_fusion="off")
    return cm.plan(x)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_halves_activations_and_messages_keeps_state(precision: str) -> None:
    full, half = _plan("fp32"), _plan(precision)
    assert half.config["precision"] == precision and half.profile["precision"] == precision
    assert full.config["precision"] == "fp32"
    # the splits may differ (activations and the loss's charge shrink, state does not), the total state not
    static_full = sum(s.predicted["static_bytes"] for s in full.stages)
    static_half = sum(s.predicted["static_bytes"] for s in half.stages)
    assert static_half == static_full > 0, "weights, grads, Adam stay fp32"
    act_full = sum(s.predicted["act_bytes"] for s in full.stages)
    act_half = sum(s.predicted["act_bytes"] for s in half.stages)
    # activations at 2 bytes; autocast also saves a 2-byte copy of each conv weight per micro-batch
    assert 0.45 * act_full <= act_half <= 0.7 * act_full, (act_half, act_full)
    want = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    assert half.tensors and all(t.dtype == want for t in half.tensors)
    sent_full = {t.producer: t.bytes for t in full.tensors}
    for t in half.tensors:
        if t.producer in sent_full:
            assert t.bytes * 2 == sent_full[t.producer]
    assert f"{precision} autocast" in str(half)


def test_measure_mode_under_autocast() -> None:
    plan = _plan("bf16", mode="measure")
    assert plan.profile["precision"] == "bf16"
    assert all(t.dtype == "bfloat16" for t in plan.tensors)


def test_cli_precision(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    rc = main(["plan", "unet", "--model-args", '{"depth": 2, "base_width": 8}', "--input", "1x3x64x64",
               "--gpus", "2", "--stages", "2", "--precision", "bf16", "--out", str(out)])
    assert rc == 0
    assert "bf16 autocast" in capsys.readouterr().out
    assert nowdl.Plan.load(out).config["precision"] == "bf16"
