"""runtime/training/metrics.py: the metrics.jsonl format, TensorBoard being optional, and the peak meter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import nowdl
from nowdl.runtime.training.metrics import METRICS_FILE, MetricsWriter, PeakMeter


def test_writer_format_and_nothing_before_the_first_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed: jsonl only
    d = tmp_path / "log"
    w = MetricsWriter(d, rank=0, world=1, meta={"model": "m", "world": 1, "config": {"stages": 1}}, predicted_bytes=10.7)
    assert not d.exists()
    w.step(1, loss=0.5, images_per_s=2.0, step_s=1.0, data_wait_s=0.25, peak_bytes=9)
    w.step(2, loss=float("nan"), images_per_s=4.0, step_s=0.5, data_wait_s=0.0, peak_bytes=11)
    lines = (d / METRICS_FILE).read_text().splitlines()  # flushed before close
    w.close()
    assert json.loads(lines[0]) == {"meta": {"model": "m", "world": 1, "config": {"stages": 1}}}
    first, second = json.loads(lines[1]), json.loads(lines[2])
    assert list(first) == ["step", "time", "loss", "images_per_s", "step_s", "data_wait_s", "ranks"]
    assert first["step"] == 1 and first["loss"] == 0.5 and first["data_wait_s"] == 0.25 and first["time"] > 1e9
    assert first["ranks"] == [{"rank": 0, "peak_bytes": 9, "predicted_bytes": 10}]
    assert second["loss"] is None  # a NaN loss is null (strict JSON)
    assert not list(d.glob("events.out.tfevents.*"))


def test_tensorboard_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    w = MetricsWriter(tmp_path, rank=0, world=1, meta={}, predicted_bytes=0)
    w.step(1, loss=1.0, images_per_s=1.0, step_s=1.0, data_wait_s=0.0, peak_bytes=1)
    w.close()
    assert list(tmp_path.glob("events.out.tfevents.*"))


def test_peak_meter_cpu() -> None:
    torch.manual_seed(0)
    model = nowdl.models.unet(depth=2, base_width=4)
    cm = nowdl.compile(model, gpus=1, stages=1, micro_batches=1, mode="estimate", progress=False, cache=False,
                       loss_fn=torch.nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    meter = PeakMeter(cm, cuda=False)
    x, y = torch.randn(1, 3, 32, 32), torch.randint(0, 2, (1, 32, 32))
    peaks = [meter.run(lambda: cm.train_step(x, y))[1] for _ in range(3)]
    params = sum(p.numel() * 4 for p in model.parameters())
    assert peaks[0] >= 3 * params  # step 1: weights + Adam's two moments
    assert peaks[1] > peaks[0] and peaks[2] == peaks[1]  # step 2 tracked, step 3 repeats it
    predicted = cm._trainer.plan.ranks[0].predicted_peak_bytes
    assert 0.5 < peaks[1] / predicted < 2
