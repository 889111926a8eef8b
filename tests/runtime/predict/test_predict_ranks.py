"""Prediction on several gloo ranks equals the one-process whole-image forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.distributed import run_workers
from helpers.predict_models import (
    predict_twice_worker,
    predict_worker,
    reference,
    seg_net,
    train_then_predict_worker,
)

zarr = pytest.importorskip("zarr")
tifffile = pytest.importorskip("tifffile")


def _source(d: Path, shape: tuple[int, ...]) -> tuple[str, np.ndarray]:
    img = np.random.default_rng(7).random(shape).astype(np.float32)
    zarr.save_array(str(d / "in.zarr"), img)
    return f"zarr:{d / 'in.zarr'}", img


@pytest.mark.slow
def test_four_tiles_equal_the_whole_image_forward(tmp_path: Path) -> None:
    src, img = _source(tmp_path, (1, 96, 128))
    pins = {"stages": 1, "spatial_parts": 4, "slice": "square", "micro_batches": 1, "replicas": 1, "dp": 1}
    lines = run_workers(predict_worker, 4, src, str(tmp_path / "a.zarr"), pins, {"window": (64, 64)},
                        timeout_s=600)
    assert "6 window(s), exact" in lines[0] and lines[0].count("(plan ") == 4
    ref = reference(seg_net(), img)
    np.testing.assert_allclose(np.asarray(zarr.open_array(str(tmp_path / "a.zarr" / "0"))[:]), ref, atol=1e-4, rtol=0)
    run_workers(predict_worker, 4, src, str(tmp_path / "b.zarr"), pins, {}, timeout_s=600)  # one window: the image
    np.testing.assert_allclose(np.asarray(zarr.open_array(str(tmp_path / "b.zarr" / "0"))[:]), ref, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_two_ranks_write_a_tiff_equal_to_the_whole_image_forward(tmp_path: Path) -> None:
    src, img = _source(tmp_path, (1, 128, 96))
    pins = {"stages": 1, "spatial_parts": 2, "slice": "horizontal", "micro_batches": 1, "replicas": 1, "dp": 1}
    run_workers(predict_worker, 2, src, str(tmp_path / "p.tif"), pins, {"window": (64, 96)}, timeout_s=600)
    got = tifffile.imread(tmp_path / "p.tif")
    np.testing.assert_allclose(got, reference(seg_net(), img), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_ranks_write_their_own_tiles_when_they_end_on_whole_chunks(tmp_path: Path) -> None:
    src, img = _source(tmp_path, (1, 512, 256))  # 256² chunks: the two row tiles meet on a chunk edge
    pins = {"stages": 1, "spatial_parts": 2, "slice": "horizontal", "micro_batches": 1, "replicas": 1, "dp": 1}
    run_workers(predict_worker, 2, src, str(tmp_path / "t.zarr"), pins, {}, None, True, timeout_s=600)
    np.testing.assert_allclose(np.asarray(zarr.open_array(str(tmp_path / "t.zarr" / "0"))[:]),
                               reference(seg_net(), img), atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("steps", [0, 3])
def test_predict_after_training_in_the_same_job_runs_the_trained_weights(tmp_path: Path, steps: int) -> None:
    """Only the stages pinned at compile (predict's plan must still take one window per step), trained
    on batches of 2 with each rank holding its own stage, then predicted in the same processes."""
    src, img = _source(tmp_path, (1, 64, 64))
    sd = run_workers(train_then_predict_worker, 2, src, str(tmp_path / "p.zarr"), steps, timeout_s=600)[0]
    net = seg_net()
    net.load_state_dict(sd)
    got = np.asarray(zarr.open_array(str(tmp_path / "p.zarr" / "0"))[:])
    np.testing.assert_allclose(got, reference(net, img), atol=1e-4, rtol=0)
    if steps:
        assert np.abs(got - reference(seg_net(), img)).max() > 1e-3  # the weights did move


@pytest.mark.slow
def test_a_second_predict_reuses_the_engine_and_sees_new_weights(tmp_path: Path) -> None:
    src, img = _source(tmp_path, (1, 64, 96))
    pins = {"stages": 1, "spatial_parts": 2, "slice": "vertical", "micro_batches": 1, "replicas": 1, "dp": 1}
    reused = run_workers(predict_twice_worker, 2, src, str(tmp_path), pins, timeout_s=600)
    assert reused == [True, True]
    for suffix, seed in (("1", 0), ("2", 1)):
        got = np.asarray(zarr.open_array(str(tmp_path / f"{suffix}.zarr" / "0"))[:])
        np.testing.assert_allclose(got, reference(seg_net(seed=seed), img), atol=1e-4, rtol=0)
