"""Tests for the model zoo: shapes, fx tracing, validation, registry and parameter counts."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import fx, nn

from nowdl.errors import NowdlError
from nowdl.models import (
    DEFAULT_INPUTS,
    MODELS,
    AmoebaNetD,
    ResNet,
    UNet,
    amoebanetd,
    blocks_per_stage,
    get_model,
    resnet,
    resnet110v2,
    unet,
    unet3d,
    valid_resnet_depths,
)
from nowdl.models.resnet import _BNConv, _ConvBN


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# (id, builder of a small model, input shape, expected output shape)
SMALL: list[tuple[str, Callable[[], nn.Module], tuple[int, ...], tuple[int, ...]]] = [
    ("resnet20v1", lambda: resnet(20, 1, width=4), (2, 3, 32, 32), (2, 10)),
    ("resnet29v2", lambda: resnet(29, 2, width=4, num_classes=3), (2, 3, 32, 32), (2, 3)),
    (
        "resnet14v2-basic-odd",
        lambda: resnet(14, 2, block="basic", width=4),
        (2, 3, 33, 31),
        (2, 10),
    ),
    (
        "resnet11v1-bottleneck",
        lambda: resnet(11, 1, block="bottleneck", width=4),
        (2, 3, 32, 32),
        (2, 10),
    ),
    (
        "resnet8v1-3d",
        lambda: resnet(8, 1, width=4, spatial_dims=3, in_channels=1),
        (2, 1, 16, 16, 16),
        (2, 10),
    ),
    ("resnet11v2-3d", lambda: resnet(11, 2, width=4, spatial_dims=3), (2, 3, 8, 16, 16), (2, 10)),
    ("resnet110v2-narrow", lambda: resnet110v2(width=2, num_classes=2), (2, 3, 32, 32), (2, 2)),
    (
        "amoebanet",
        lambda: amoebanetd(num_classes=5, num_layers=3, num_filters=32),
        (2, 3, 64, 64),
        (2, 5),
    ),
    ("amoebanet-1ch", lambda: amoebanetd(4, 6, 16, in_channels=1), (2, 1, 32, 64), (2, 4)),
    ("unet", lambda: unet(depth=2, base_width=4), (2, 3, 32, 32), (2, 2, 32, 32)),
    (
        "unet-norm",
        lambda: unet(1, 4, depth=3, base_width=4, norm=True),
        (2, 1, 16, 24),
        (2, 4, 16, 24),
    ),
    ("unet3d", lambda: unet3d(depth=2, base_width=4), (2, 1, 16, 16, 16), (2, 2, 16, 16, 16)),
    (
        "unet-3d-via-unet",
        lambda: unet(2, 3, depth=1, base_width=4, spatial_dims=3),
        (1, 2, 8, 4, 6),
        (1, 3, 8, 4, 6),
    ),
]


@pytest.mark.parametrize(
    ("build", "shape", "out"), [c[1:] for c in SMALL], ids=[c[0] for c in SMALL]
)
def test_forward_shape(
    build: Callable[[], nn.Module], shape: tuple[int, ...], out: tuple[int, ...]
) -> None:
    model = build().eval()
    assert isinstance(model, (ResNet, AmoebaNetD, UNet))
    model.check_input(shape)
    with torch.no_grad():
        assert tuple(model(torch.randn(*shape)).shape) == out


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize(
    ("build", "shape", "out"), [c[1:] for c in SMALL], ids=[c[0] for c in SMALL]
)
def test_fx_trace_matches_eager(
    build: Callable[[], nn.Module], shape: tuple[int, ...], out: tuple[int, ...], train: bool
) -> None:
    torch.manual_seed(0)
    model = build()
    traced = fx.symbolic_trace(copy.deepcopy(model))
    model.train(train)
    traced.train(train)
    x = torch.randn(*shape)
    with torch.no_grad():
        torch.manual_seed(1)
        expected = model(x)
        torch.manual_seed(1)
        got = traced(x)
    assert got.shape == expected.shape == out
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # Tracing must see every call as a graph node, not a single opaque call.
    assert sum(1 for n in traced.graph.nodes if n.op == "call_module") > 5


def test_models_are_plain_modules() -> None:
    for model in (resnet(8, 1, width=2), amoebanetd(2, 3, 16), unet(depth=1, base_width=2)):
        assert not isinstance(model, nn.Sequential)


# --- ResNet ---------------------------------------------------------------------------


def _main_path_layers(model: ResNet) -> int:
    """Convs on the main path plus the classifier: what the depth in "ResNet-110" counts."""
    convs = 0
    for name, mod in model.named_modules():
        if isinstance(mod, (_ConvBN, _BNConv)) and not name.endswith("shortcut"):
            convs += 1
    return convs + 1


@pytest.mark.parametrize(
    ("depth", "version", "block"),
    [
        (20, 1, None),
        (56, 1, None),
        (110, 1, None),
        (29, 2, None),
        (110, 2, None),
        (20, 2, "basic"),
        (29, 1, "bottleneck"),
    ],
)
def test_resnet_depth_counts_layers(depth: int, version: int, block: str | None) -> None:
    model = resnet(depth, version, width=2, block=block)  # type: ignore[arg-type]
    assert _main_path_layers(model) == depth


def test_resnet110v2_matches_gems() -> None:
    model = resnet110v2()
    assert model.depth == 110 and model.version == 2 and model.block == "bottleneck"
    assert blocks_per_stage(110, 2) == 12  # GEMS: n = (depth - 2) // 9
    assert [len(s) for s in model.stages] == [12, 12, 12]  # type: ignore[arg-type]
    assert model.num_features == 256  # Keras v2 widths: 16 -> 64, 128, 256
    assert blocks_per_stage(110, 1) == 18  # v1 basic: (depth - 2) // 6


@pytest.mark.parametrize(
    ("depth", "millions"),
    # He et al. 2015, Table 6 (CIFAR-10): ResNet-20/32/44/56/110 parameter counts.
    [(20, 0.27), (32, 0.46), (44, 0.66), (56, 0.85), (110, 1.7)],
)
def test_resnet_v1_param_counts_match_paper(depth: int, millions: float) -> None:
    count = n_params(resnet(depth, 1, width=16, conv_bias=False))
    assert abs(count / 1e6 - millions) / millions < 0.03, count
    # Keras/MPI4DL keep conv biases: slightly more, still the same figure.
    assert abs(n_params(resnet(depth, 1)) / 1e6 - millions) / millions < 0.03


def test_resnet_v2_param_count_plausible() -> None:
    # Keras ResNet-v2 bottleneck widths (16/64, 64/128, 128/256) are wider than the
    # paper's, so ResNet-110-v2 is ~3.3M rather than the paper-style ~1.1M.
    assert 3.2e6 < n_params(resnet110v2()) < 3.4e6
    # Pre-activation basic blocks have exactly the v1 parameter count.
    assert n_params(resnet(110, 2, block="basic")) == n_params(resnet(110, 1))


@pytest.mark.parametrize(
    ("depth", "version", "block", "fragments"),
    [
        (57, 1, None, ["6n+2", "v1", "57", "try 56 or 62"]),
        (100, 2, None, ["9n+2", "v2", "bottleneck", "100", "try 92 or 101"]),
        (111, 1, "bottleneck", ["9n+2", "v1", "111", "try 110 or 119"]),
        (2, 1, None, ["6n+2", "try 8"]),
        (-4, 2, None, ["9n+2", "try 11"]),
    ],
)
def test_resnet_invalid_depth(
    depth: int, version: int, block: str | None, fragments: list[str]
) -> None:
    with pytest.raises(ValueError) as info:
        resnet(depth, version, block=block)  # type: ignore[arg-type]
    for fragment in fragments:
        assert fragment in str(info.value)


def test_resnet_other_errors() -> None:
    with pytest.raises(NowdlError, match="version must be 1 or 2"):
        resnet(20, 3)
    with pytest.raises(NowdlError, match="block must be"):
        resnet(20, 1, block="wide")  # type: ignore[arg-type]
    with pytest.raises(NowdlError, match="spatial_dims"):
        resnet(20, 1, spatial_dims=1)
    with pytest.raises(NowdlError, match="width"):
        resnet(20, 1, width=0)
    with pytest.raises(NowdlError, match="in_channels=3 but the input has 1"):
        resnet(20, 1).check_input((1, 1, 32, 32))
    assert valid_resnet_depths(1) == [8, 14, 20, 26, 32]
    assert valid_resnet_depths(2, limit=3) == [11, 20, 29]


# --- AmoebaNet-D ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "filters", "millions"),
    # GPipe (Huang et al. 2019), Table 1: AmoebaNet-D (L, D) parameter counts.
    [(18, 208, 82.0), (18, 416, 318.0), (18, 544, 542.0)],
)
def test_amoebanet_param_counts_match_gpipe(layers: int, filters: int, millions: float) -> None:
    with torch.device("meta"):
        model = amoebanetd(num_classes=1000, num_layers=layers, num_filters=filters)
    assert abs(n_params(model) / 1e6 - millions) / millions < 0.01


def test_amoebanet_structure() -> None:
    model = amoebanetd(10, 6, 32)
    assert list(model.cells) == [
        "stem2",
        "stem3",
        "cell1_normal1",
        "cell1_normal2",
        "cell2_reduction",
        "cell3_normal1",
        "cell3_normal2",
        "cell4_reduction",
        "cell5_normal1",
        "cell5_normal2",
    ]


def test_amoebanet_errors() -> None:
    with pytest.raises(ValueError, match=r"multiple of 3 \(got 4\): try 3 or 6"):
        amoebanetd(num_layers=4)
    with pytest.raises(ValueError, match=r"multiple of 8 \(got 12\): try 8 or 16"):
        amoebanetd(num_filters=12)
    model = amoebanetd(2, 3, 16)
    model.check_input((1, 3, 64, 96))
    with pytest.raises(ValueError, match="multiple of 32"):
        model.check_input((1, 3, 48, 64))


# --- UNet -------------------------------------------------------------------------------


def test_unet_defaults_and_params() -> None:
    model = unet()
    assert isinstance(model, UNet)
    assert model.widths == (64, 128, 256, 512, 1024)
    assert model.input_multiple == 16
    # The classic padded UNet has ~31.0M parameters.
    assert abs(n_params(model) / 1e6 - 31.03) < 0.05
    model3 = unet3d()
    assert model3.spatial_dims == 3 and model3.widths == (16, 32, 64, 128, 256)
    assert any(isinstance(m, nn.BatchNorm3d) for m in model3.modules())
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def test_unet_check_input() -> None:
    model = unet(depth=4, base_width=4)
    model.check_input((1, 3, 2048, 2048))
    with pytest.raises(ValueError, match=r"multiple of 16, got \(30, 32\); e.g. use \(32, 32\)"):
        model.check_input((1, 3, 30, 32))
    with pytest.raises(ValueError, match="4-d input"):
        model.check_input((1, 3, 32, 32, 32))
    with pytest.raises(ValueError, match="in_channels=3"):
        model.check_input((1, 4, 32, 32))
    with pytest.raises(ValueError, match="depth"):
        unet(depth=0)


# --- registry ---------------------------------------------------------------------------


def test_registry_names() -> None:
    assert {"resnet", "resnet110v2", "amoebanet", "unet", "unet3d"} <= set(MODELS)
    assert set(DEFAULT_INPUTS) == set(MODELS)
    assert DEFAULT_INPUTS["unet"] == (1, 3, 2048, 2048)
    assert DEFAULT_INPUTS["resnet110v2"] == (1, 3, 1024, 1024)
    assert DEFAULT_INPUTS["unet3d"] == (1, 1, 128, 128, 128)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_registry_defaults_build_and_accept_default_input(name: str) -> None:
    with torch.device("meta"):
        model = get_model(name)
        assert isinstance(model, (ResNet, AmoebaNetD, UNet))
        shape = DEFAULT_INPUTS[name]
        model.check_input(shape)
        out = model(torch.empty(shape))
    assert out.shape[0] == shape[0]
    if isinstance(model, UNet):
        assert tuple(out.shape[2:]) == shape[2:]
    else:
        assert out.ndim == 2


def test_get_model_kwargs() -> None:
    model = get_model("resnet", depth=20, version=1, width=4)
    assert isinstance(model, ResNet) and model.depth == 20 and model.version == 1
    model = get_model("unet", base_width=8, depth=2, out_channels=5)
    assert isinstance(model, UNet) and model.out_channels == 5


def test_get_model_errors() -> None:
    with pytest.raises(
        ValueError, match="unknown model 'resnet50'; known models: amoebanet, resnet"
    ):
        get_model("resnet50")
    with pytest.raises(ValueError, match=r"model 'unet' does not accept argument\(s\) 'width'"):
        get_model("unet", width=8)
    with pytest.raises(ValueError, match="model 'resnet110v2' does not accept argument.*'depth'"):
        get_model("resnet110v2", depth=56)
    with pytest.raises(ValueError, match="6n\\+2"):
        get_model("resnet", depth=57, version=1)
