"""Coverage over the model zoos: segmentation_models_pytorch, torchvision and timm (tests/helpers/zoo.py).

Every network plans and trains: 2 SGD steps in float64 on 2 gloo ranks match one process
(losses to 1e-9, every state-dict entry to 1e-9), then ``cm.eval_step`` of one sample (an
inference plan on the 2 ranks, with the trained weights) equals the trained model's forward in
eval mode (1e-9). smp's UNet, UNet++ and DeepLabV3+ and torchvision's FCN train with the WHOLE
net on 2 tiles (sizes read off tiles, the ASPP pooling branch reduced over the tiles: [Note:
whole values on tiles]), the others on 2 pipeline stages; those say which node keeps them off
tiles. DeepLabV3+ with a batch of 1 is planned with micro-batches of 2 samples, and refused
naming its BatchNorm when one sample is pinned ([Note: one-sample norms]); its inference plans
take one sample. UNet's ``predict`` (one process, and 2 tiles) equals the whole-image forward;
the timm classifier plans at 4096x4096.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.distributed import run_workers
from helpers.zoo import NETS, ZooNet, build, by_id, first_tensor
from helpers.zoo_train import WORLD, Train, TrainResult, run_cases

import nowdl

pytest.importorskip("segmentation_models_pytorch")


def _input(net: ZooNet, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(net.shape, generator=torch.Generator().manual_seed(0), dtype=dtype)


def test_the_list_covers_what_the_issue_asks() -> None:
    ids = {n.id for n in NETS}
    for arch in ("Unet", "UnetPlusPlus", "FPN", "DeepLabV3Plus"):
        assert {f"smp-{arch}-resnet34", f"smp-{arch}-convnext_atto"} <= ids
    assert {"tv-fcn_resnet50", "tv-deeplabv3_resnet50"} <= ids
    assert any(n.library == "timm" and n.output == "classes" for n in NETS)
    assert {p.values[0].net for p in TRAIN} == ids, "every net trains"


@pytest.mark.parametrize("net", [n for n in NETS if n.refused], ids=lambda n: n.id)
def test_nets_that_do_not_tile_whole_say_why(net: ZooNet) -> None:
    cm = nowdl.compile(build(net), gpus=2, stages=1, spatial_parts=2, slice="vertical", progress=False, cache=False)
    with pytest.raises(nowdl.NowdlError) as e:
        cm.plan(torch.empty(net.shape, device="meta"))
    assert net.refused and "Node '" in str(e.value) and net.refused in str(e.value), str(e.value)


# ---- batch 1: BatchNorm over one value per channel -----------------------------------------------


def test_deeplabv3plus_with_one_sample_plans_micro_batches_of_two(caplog: pytest.LogCaptureFixture) -> None:
    net = by_id("smp-DeepLabV3Plus-resnet34")
    x = torch.empty((1, *net.shape[1:]), device="meta")
    cm = nowdl.compile(build(net), gpus=2, stages=2, progress=False, cache=False, global_batch=4)
    with caplog.at_level(logging.WARNING):
        plan = cm.plan(x)
    assert plan.config["micro_batch_size"] >= 2 and plan.model["inputs"][0][0] >= 2, plan.config
    assert "decoder.aspp.0.convs.4.2" in caplog.text


def test_one_pinned_sample_names_the_batchnorm_and_the_fix() -> None:
    net = by_id("smp-DeepLabV3Plus-resnet34")
    cm = nowdl.compile(build(net), gpus=2, stages=2, progress=False, cache=False, global_batch=4, micro_batches=4,
                       replicas=1, dp=1)
    with pytest.raises(nowdl.OneSampleNormError) as e:
        cm.plan(torch.empty((1, *net.shape[1:]), device="meta"))
    text = str(e.value)
    assert e.value.node == "decoder.aspp.0.convs.4.2"
    assert "one value per channel" in text and "[1, 32, 1, 1]" in text and "2 or more samples" in text
    assert "eval mode" in text


# ---- exact training in float64 -------------------------------------------------------------------

_TILED = {"stages": 1, "spatial_parts": 2, "micro_batches": 2}
_PIPE = {"stages": 2, "spatial_parts": 1, "micro_batches": 2}
_SLOW = pytest.mark.slow

TRAIN = [
    pytest.param(Train("smp-Unet-resnet34", {**_TILED, "slice": "vertical"}), id="smp-Unet-resnet34-tiled"),
    pytest.param(Train("smp-DeepLabV3Plus-resnet34", {**_TILED, "slice": "horizontal"}),
                 id="smp-DeepLabV3Plus-resnet34-tiled"),
    pytest.param(Train("smp-UnetPlusPlus-resnet34", {**_TILED, "slice": "vertical"}), id="smp-UnetPlusPlus-resnet34-tiled",
                 marks=_SLOW),
    pytest.param(Train("smp-FPN-resnet34", _PIPE), id="smp-FPN-resnet34-pipeline", marks=_SLOW),
    pytest.param(Train("smp-Unet-convnext_atto", _PIPE), id="smp-Unet-convnext_atto-pipeline"),
    pytest.param(Train("smp-UnetPlusPlus-convnext_atto", _PIPE), id="smp-UnetPlusPlus-convnext_atto-pipeline",
                 marks=_SLOW),
    pytest.param(Train("smp-FPN-convnext_atto", _PIPE), id="smp-FPN-convnext_atto-pipeline", marks=_SLOW),
    pytest.param(Train("smp-DeepLabV3Plus-convnext_atto", _PIPE), id="smp-DeepLabV3Plus-convnext_atto-pipeline",
                 marks=_SLOW),
    pytest.param(Train("tv-fcn_resnet50", {**_TILED, "slice": "horizontal"}), id="tv-fcn_resnet50-tiled", marks=_SLOW),
    pytest.param(Train("tv-deeplabv3_resnet50", _PIPE), id="tv-deeplabv3_resnet50-pipeline", marks=_SLOW),
    pytest.param(Train("timm-resnet18-classifier", _PIPE), id="timm-resnet18-classifier-pipeline"),
]


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest) -> dict[str, TrainResult | str]:
    wanted = {item.callspec.id for item in request.session.items
              if getattr(item, "originalname", "") == "test_trains_exactly_in_float64" and hasattr(item, "callspec")}
    return run_cases({str(p.id): p.values[0] for p in TRAIN if p.id in wanted})


@pytest.mark.parametrize("case", TRAIN)
def test_trains_exactly_in_float64(case: Train, trained: dict[str, TrainResult | str],
                                   request: pytest.FixtureRequest) -> None:
    res = trained[request.node.callspec.id]
    if isinstance(res, str):
        pytest.fail(res, pytrace=False)
    for r, other in enumerate(res.rank_losses):
        assert other == res.losses, f"rank {r} reports another loss"
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(res.ref_losses), rtol=1e-9, atol=1e-12)
    assert list(res.sd) == list(res.ref_sd), set(res.sd) ^ set(res.ref_sd)
    for k, ref in res.ref_sd.items():  # weights, running statistics and num_batches_tracked
        torch.testing.assert_close(res.sd[k], ref, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(res.pred, res.ref_pred, rtol=1e-9, atol=1e-9, msg=lambda m: f"eval_step: {m}")
    assert len(res.layout) == case.cfg["stages"]
    if case.cfg["spatial_parts"] > 1:
        assert all(p == case.cfg["spatial_parts"] for p, _ in res.layout), f"not every stage is tiled: {res.layout}"


# ---- prediction ----------------------------------------------------------------------------------


def _unet_predict(rank: int, world: int, source: str, out: str, pins: dict[str, object], window: object) -> str:
    cm = nowdl.compile(build(by_id("smp-Unet-resnet34")).eval(), gpus=world, progress=False, cache=False, **pins)
    return cm.predict(source, out, window=window).line()


def _reference(img: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return first_tensor(build(by_id("smp-Unet-resnet34")).eval()(torch.from_numpy(img)[None]))[0].numpy()


def test_unet_predicts_exactly(tmp_path: Path) -> None:
    """One window (the image): a ResNet-34 UNet reads 544 pixels of context on each side, so
    streamed windows need 1120 pixels or more."""
    zarr = pytest.importorskip("zarr")
    img = np.random.default_rng(3).random((3, 96, 128)).astype(np.float32)
    zarr.save_array(str(tmp_path / "in.zarr"), img)
    line = _unet_predict(0, 1, f"zarr:{tmp_path / 'in.zarr'}", str(tmp_path / "out.zarr"), {}, None)
    assert "exact" in line, line
    got = np.asarray(zarr.open_array(str(tmp_path / "out.zarr" / "0"))[:])
    np.testing.assert_allclose(got, _reference(img), atol=1e-4, rtol=0)


def test_unet_predicts_on_two_tiles_exactly(tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    img = np.random.default_rng(4).random((3, 64, 128)).astype(np.float32)
    zarr.save_array(str(tmp_path / "in.zarr"), img)
    pins = {"stages": 1, "spatial_parts": 2, "slice": "vertical", "micro_batches": 1, "replicas": 1, "dp": 1}
    run_workers(_unet_predict, WORLD, f"zarr:{tmp_path / 'in.zarr'}", str(tmp_path / "out.zarr"), pins, None,
                timeout_s=600)
    got = np.asarray(zarr.open_array(str(tmp_path / "out.zarr" / "0"))[:])
    np.testing.assert_allclose(got, _reference(img), atol=1e-4, rtol=0)


def test_timm_classifier_plans_at_4096() -> None:
    net = by_id("timm-resnet18-classifier")
    cm = nowdl.compile(build(net), gpus=4, progress=False, cache=False, mode="estimate")
    big = cm.plan(torch.empty((1, 3, 4096, 4096), device="meta"))
    assert big.model["inputs"] == [[1, 3, 4096, 4096]] and big.stages
