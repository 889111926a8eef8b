"""Predict runs inference plans: made for the window, or given as a file; a training plan file is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.predict_models import reference, seg_net

import nowdl
from nowdl.errors import PlanError
from nowdl.plan.purpose import is_inference
from nowdl.runtime.predict.runner import plan_for

zarr = pytest.importorskip("zarr")


def _source(d: Path) -> tuple[str, np.ndarray]:
    img = np.random.default_rng(3).random((1, 48, 64)).astype(np.float32)
    zarr.save_array(str(d / "in.zarr"), img)
    return f"zarr:{d / 'in.zarr'}", img


def test_predict_runs_the_inference_plan_of_the_window(tmp_path: Path) -> None:
    src, img = _source(tmp_path)
    cm = nowdl.compile(seg_net(), gpus=1, progress=False, cache=False)
    summary = cm.predict(src, tmp_path / "p.zarr", window=(32, 32))
    got = np.asarray(zarr.open_array(str(tmp_path / "p.zarr" / "0"))[:])
    np.testing.assert_allclose(got, reference(seg_net(), img), atol=1e-5, rtol=0)
    example = torch.empty((1, 1, 32, 32), device="meta")
    plan = plan_for(cm, example)
    assert is_inference(plan) and plan.config["schedule"] == "forward"
    assert summary.predicted_bytes == [int(plan.ranks[0].predicted_peak_bytes)]  # the figure the run reports
    assert plan.ranks[0].predicted_peak_bytes < cm.plan(example).ranks[0].predicted_peak_bytes  # training holds more


def test_a_training_plan_file_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    src, _ = _source(tmp_path)
    example = torch.empty((1, 1, 32, 32), device="meta")
    for train, name in ((True, "train.json"), (False, "infer.json")):
        nowdl.compile(seg_net(), gpus=1, progress=False, cache=False).plan(example, train=train).save(tmp_path / name)
    cm = nowdl.compile(seg_net(), plan=str(tmp_path / "train.json"), progress=False)
    with pytest.raises(PlanError, match=r"train\.json is a training plan .*Make an inference plan"):
        cm.predict(src, tmp_path / "t.zarr")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.zarr", "infer.json", "train.json"]
    ok = nowdl.compile(seg_net(), plan=str(tmp_path / "infer.json"), progress=False)
    assert ok.predict(src, tmp_path / "i.zarr").windows == 6  # 32x32 windows over 48x64: 2 x 3
