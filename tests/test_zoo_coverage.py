"""Coverage over the model zoos: segmentation_models_pytorch, torchvision and timm (tests/helpers/zoo.py).

Every network plans and trains: 2 SGD steps in float64 on 2 gloo ranks match one process
(losses to 1e-9, every state-dict entry to 1e-9), then ``cm.eval_step`` of one sample (an
inference plan on the 2 ranks, with the trained weights) equals the trained model's forward in
eval mode (1e-9). All of it runs in one pool of 2 ranks (``helpers.zoo_train``): rank 0 compares
with one process while rank 1 runs the planner checks of the same net (``helpers.zoo_checks``). smp's UNet, UNet++ and DeepLabV3+ and torchvision's FCN train with the WHOLE
net on 2 tiles (sizes read off tiles, the ASPP pooling branch reduced over the tiles: [Note:
whole values on tiles]), the others on 2 pipeline stages; those say which node keeps them off
tiles. DeepLabV3+ with one sample per micro-batch pinned is refused naming its ASPP's BatchNorm
([Note: one-sample norms]; planning micro-batches of 2 samples instead is tested on a small net
in tests/trace/test_norm_batch.py); its inference plans take one sample. UNet's ``predict`` on the 2 training ranks' tiles equals the whole-image forward;
the timm classifier plans at 4096x4096.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.zoo import NETS, ZooNet, build, by_id, first_tensor
from helpers.zoo_train import TOL, Train, TrainResult, run_cases

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


# ---- exact training in float64 -------------------------------------------------------------------

_TILED = {"stages": 1, "spatial_parts": 2, "micro_batches": 2}
_PIPE = {"stages": 2, "spatial_parts": 1, "micro_batches": 2}
_WHOLE = ("whole",)

_SLOW = pytest.mark.slow

TRAIN = [
    pytest.param(Train("smp-Unet-resnet34", {**_TILED, "slice": "vertical"}, predict=True), id="smp-Unet-resnet34-tiled"),
    pytest.param(Train("smp-DeepLabV3Plus-resnet34", {**_TILED, "slice": "horizontal"},
                       ("one_sample_pinned",)), id="smp-DeepLabV3Plus-resnet34-tiled"),
    pytest.param(Train("smp-UnetPlusPlus-resnet34", {**_TILED, "slice": "vertical"}), id="smp-UnetPlusPlus-resnet34-tiled",
                 marks=_SLOW),
    pytest.param(Train("smp-FPN-resnet34", _PIPE, _WHOLE), id="smp-FPN-resnet34-pipeline", marks=_SLOW),
    pytest.param(Train("smp-Unet-convnext_atto", _PIPE, _WHOLE), id="smp-Unet-convnext_atto-pipeline"),
    pytest.param(Train("smp-UnetPlusPlus-convnext_atto", _PIPE, _WHOLE), id="smp-UnetPlusPlus-convnext_atto-pipeline",
                 marks=_SLOW),
    pytest.param(Train("smp-FPN-convnext_atto", _PIPE, _WHOLE), id="smp-FPN-convnext_atto-pipeline", marks=_SLOW),
    pytest.param(Train("smp-DeepLabV3Plus-convnext_atto", _PIPE, _WHOLE), id="smp-DeepLabV3Plus-convnext_atto-pipeline",
                 marks=_SLOW),
    pytest.param(Train("tv-fcn_resnet50", {**_TILED, "slice": "horizontal"}), id="tv-fcn_resnet50-tiled", marks=_SLOW),
    pytest.param(Train("tv-deeplabv3_resnet50", _PIPE, _WHOLE), id="tv-deeplabv3_resnet50-pipeline", marks=_SLOW),
    pytest.param(Train("timm-resnet18-classifier", _PIPE, _WHOLE), id="timm-resnet18-classifier-pipeline"),
]
_CASE = {p.values[0].net: str(p.id) for p in TRAIN}  # every net trains in one case
_MARKS = {p.values[0].net: p.marks for p in TRAIN}  # a check is as slow as the case it runs in
_UNET, _DLV3P = _CASE["smp-Unet-resnet34"], _CASE["smp-DeepLabV3Plus-resnet34"]
#: the case each test reads, by the test's name (the parametrized ones: by their case or net)
_READS = {"test_unet_predicts_on_two_tiles_exactly": _UNET, "test_one_pinned_sample_names_the_batchnorm_and_the_fix": _DLV3P}
_IMG = np.random.default_rng(4).random((3, 64, 128)).astype(np.float32)  # what the UNet predicts on 2 tiles


def _case_of(item: pytest.Item) -> str | None:
    spec = getattr(item, "callspec", None)
    if spec is not None and "case" in spec.params:
        return str(spec.id)
    if spec is not None and "net" in spec.params:
        return _CASE[spec.params["net"].id]
    return _READS.get(getattr(item, "originalname", ""))


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainResult | str]:
    """Every case a selected test of this module reads, trained in one pool of ranks."""
    here = Path(__file__).resolve()
    wanted = {_case_of(item) for item in request.session.items if Path(str(item.path)).resolve() == here}
    cases = {str(p.id): p.values[0] for p in TRAIN if p.id in wanted}
    d = tmp_path_factory.mktemp("zoo-predict")
    if any(c.predict for c in cases.values()):
        pytest.importorskip("zarr").save_array(str(d / "in.zarr"), _IMG)
    return run_cases(cases, str(d))


def _result(trained: dict[str, TrainResult | str], cid: str) -> TrainResult:
    res = trained[cid]
    if isinstance(res, str):
        pytest.fail(res, pytrace=False)
    return res


@pytest.mark.parametrize("case", TRAIN)
def test_trains_exactly_in_float64(case: Train, trained: dict[str, TrainResult | str],
                                   request: pytest.FixtureRequest) -> None:
    res = _result(trained, request.node.callspec.id)
    for r, other in enumerate(res.rank_losses):
        assert other == res.losses, f"rank {r} reports another loss"
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(res.ref_losses), rtol=TOL, atol=1e-12)
    assert not res.keys, f"state-dict entries on one side only: {res.keys}"
    # weights, running statistics, num_batches_tracked and eval_step's logits, compared on rank 0
    assert not res.off, "\n".join(res.off)
    assert len(res.layout) == case.cfg["stages"]
    if case.cfg["spatial_parts"] > 1:
        assert all(p == case.cfg["spatial_parts"] for p, _ in res.layout), f"not every stage is tiled: {res.layout}"


@pytest.mark.parametrize("net", [pytest.param(n, id=n.id, marks=_MARKS[n.id]) for n in NETS if n.refused])
def test_nets_that_do_not_tile_whole_say_why(net: ZooNet, trained: dict[str, TrainResult | str]) -> None:
    got = _result(trained, _CASE[net.id]).checks["whole"]
    assert got["error"] and "Node '" in got["text"] and net.refused in got["text"], got


# ---- batch 1: BatchNorm over one value per channel -----------------------------------------------


def test_one_pinned_sample_names_the_batchnorm_and_the_fix(trained: dict[str, TrainResult | str]) -> None:
    got = _result(trained, _DLV3P).checks["one_sample_pinned"]
    assert got["error"] == "OneSampleNormError", got
    text = got["text"]
    assert got["node"] == "decoder.aspp.0.convs.4.2"
    assert "one value per channel" in text and "[1, 32, 1, 1]" in text and "2 or more samples" in text
    assert "eval mode" in text


# ---- prediction ----------------------------------------------------------------------------------


def test_unet_predicts_on_two_tiles_exactly(trained: dict[str, TrainResult | str]) -> None:
    """One window (the image) streamed by ``cm.predict`` on the training ranks' 2 tiles: a
    ResNet-34 UNet reads 544 pixels of context on each side, so streamed windows need 1120
    pixels or more."""
    zarr = pytest.importorskip("zarr")
    line = _result(trained, _UNET).predict_line
    assert "exact" in line, line
    got = np.asarray(zarr.open_array(f"{_result(trained, _UNET).predict_out}/0")[:])
    with torch.no_grad():
        ref = first_tensor(build(by_id("smp-Unet-resnet34")).eval()(torch.from_numpy(_IMG)[None]))[0].numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_timm_classifier_plans_at_4096() -> None:
    net = by_id("timm-resnet18-classifier")
    cm = nowdl.compile(build(net), gpus=4, progress=False, cache=False, mode="estimate")
    big = cm.plan(torch.empty((1, 3, 4096, 4096), device="meta"))
    assert big.model["inputs"] == [[1, 3, 4096, 4096]] and big.stages


def test_fpn_predicts_exactly_through_its_stacked_merge(tmp_path: Path) -> None:
    """smp's FPN stacks its pyramid's levels into an (N, K, C, H, W) value and sums them:
    ``predict``'s window walk keeps the last dims as the image's, and the output is the
    whole-image forward's (one process, the image in one window)."""
    zarr = pytest.importorskip("zarr")
    net = build(by_id("smp-FPN-resnet34")).eval()
    img = np.random.default_rng(0).random((3, 32, 64), dtype=np.float32)
    zarr.save_array(str(tmp_path / "in.zarr"), img)
    cm = nowdl.compile(net, gpus=1, progress=False, cache=False, mode="estimate")
    summary = cm.predict(f"zarr:{tmp_path / 'in.zarr'}", str(tmp_path / "out.zarr"), measure_memory=False)
    assert "exact" in summary.line() and "NOT exact" not in summary.line(), summary.line()
    got = np.asarray(zarr.open_array(str(tmp_path / "out.zarr" / "0"))[:])
    with torch.no_grad():
        ref = first_tensor(net(torch.from_numpy(img)[None]))[0].numpy()
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
