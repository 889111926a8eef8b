"""Test helper (not a test module): the model-zoo networks of tests/test_zoo_coverage.py.

segmentation_models_pytorch's UNet, UNet++, FPN and DeepLabV3+ on a ResNet-34 encoder and on a
timm ConvNeXt encoder, torchvision's FCN and DeepLabV3 (ResNet-50) and a timm ResNet as a plain
classifier: every one with random weights (``encoder_weights=None``, ``weights=None``: nothing
is downloaded) and without dropout, so that training can match one process.

The shapes are about the smallest that keep every BatchNorm above two values per channel and give
each of 2 tiles the context its convs read (dilated ASPP and FCN convs need 8 rows at their scale
on 2 horizontal tiles); only the nets with an ASPP pooling branch need 2 samples per micro-batch
([Note: one-sample norms]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["ZooNet", "NETS", "by_id", "build", "first_tensor", "out_shape"]


@dataclass(frozen=True)
class ZooNet:
    id: str
    library: str  # smp, torchvision, timm
    make: Callable[[], nn.Module]
    shape: tuple[int, ...]  # one micro-batch of the coverage tests
    output: str = "image"  # "image" (dense logits) or "classes"
    classes: int = 2
    tiles: str = ""  # "" when the whole net runs on tiles, else why not
    refused: str = ""  # what the planner's refusal to tile it whole says (with the node's name)
    notes: str = ""
    args: dict[str, Any] = field(default_factory=dict)


def _smp(arch: str, encoder: str, **kw: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import segmentation_models_pytorch as smp

        return getattr(smp, arch)(encoder_name=encoder, encoder_weights=None, in_channels=3, classes=2, **kw)
    return make


def _tv(name: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import torchvision

        return getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None, num_classes=2,
                                                              aux_loss=False)
    return make


def _timm(name: str, **kw: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, **kw)
    return make


_UNET = {"decoder_channels": (32, 16, 16, 8, 8)}
_DLV3P = {"decoder_channels": 32, "decoder_aspp_dropout": 0.0, "decoder_atrous_rates": (1, 2, 3)}
_CONVNEXT = "ConvNeXt's LayerNorm2d permutes to channels-last"
_RES = (1, 3, 32, 64)  # one sample; 1x2 values at 1/32
# trained on 2 tiles: 2x2 values at 1/32. At 32x64 the BatchNorms of layer4 see 2 values per
# channel and make training chaotic: one process fed inputs 1e-15 apart ends step 2 with losses
# 3e-7 and weights 5e-3 apart, as far as 2 tiles end from it
_TILED = (1, 3, 64, 64)

NETS: list[ZooNet] = [
    ZooNet("smp-Unet-resnet34", "smp", _smp("Unet", "resnet34", **_UNET), _TILED, args=_UNET),
    ZooNet("smp-UnetPlusPlus-resnet34", "smp", _smp("UnetPlusPlus", "resnet34", **_UNET), _TILED,
           args=_UNET),
    ZooNet("smp-FPN-resnet34", "smp", _smp("FPN", "resnet34", decoder_dropout=0.0, decoder_pyramid_channels=32,
                                           decoder_segmentation_channels=32), _RES,
           tiles="its merge stacks the pyramid's levels", refused="aten.stack"),
    # ASPP's dilated convs need tiles at least as tall as their rate at 1/16 of the input: rates
    # (1, 2, 3) at 128 rows give 8 at the ASPP (the defaults, 12, 24 and 36, need 1152 rows for 2 tiles)
    ZooNet("smp-DeepLabV3Plus-resnet34", "smp", _smp("DeepLabV3Plus", "resnet34", **_DLV3P), (2, 3, 128, 32),
           args=_DLV3P, notes="ASPP pooling branch: BatchNorm over one value per channel at batch 1"),
    ZooNet("smp-Unet-convnext_atto", "smp", _smp("Unet", "tu-convnext_atto", **_UNET), _RES,
           tiles=_CONVNEXT, refused="permute"),
    ZooNet("smp-UnetPlusPlus-convnext_atto", "smp", _smp("UnetPlusPlus", "tu-convnext_atto", **_UNET), _RES,
           tiles=_CONVNEXT, refused="permute"),
    ZooNet("smp-FPN-convnext_atto", "smp", _smp("FPN", "tu-convnext_atto", decoder_dropout=0.0,
                                                decoder_pyramid_channels=32, decoder_segmentation_channels=32),
           _RES, tiles=_CONVNEXT, refused="permute"),
    ZooNet("smp-DeepLabV3Plus-convnext_atto", "smp", _smp("DeepLabV3Plus", "tu-convnext_atto", **_DLV3P),
           (2, 3, 64, 32), tiles=_CONVNEXT, refused="permute"),
    # FCN's dilation-4 convs at 1/8 of the input read 4 rows past a tile: 64 rows for 2 tiles
    ZooNet("tv-fcn_resnet50", "torchvision", _tv("fcn_resnet50"), (1, 3, 64, 32),
           notes="returns a dict {'out': logits}; its head's Dropout(0.1) is set to p=0"),
    ZooNet("tv-deeplabv3_resnet50", "torchvision", _tv("deeplabv3_resnet50"), (2, 3, 32, 32),
           notes="returns a dict {'out': logits}; ASPP pooling branch",
           tiles="not at 32^2: its dilated convs (4 in layer4, 36 in the ASPP, at 1/8 of the input) read halos wider "
           "than its 2 tiles, 2 pixels each there (576 pixels hold them)", refused="reads a halo of"),
    ZooNet("timm-resnet18-classifier", "timm", _timm("resnet18", num_classes=3), _RES, output="classes", classes=3,
           tiles="its head (a Linear on the pooled features) needs the whole image", refused="needs the whole image"),
]


def out_shape(net: ZooNet, n: int) -> tuple[int, ...]:
    """The output of ``n`` samples: (n, classes, H, W) logits of a dense net, (n, classes) of a classifier."""
    return (n, net.classes, *net.shape[2:]) if net.output == "image" else (n, net.classes)


def by_id(net_id: str) -> ZooNet:
    return next(n for n in NETS if n.id == net_id)


def build(net: ZooNet, seed: int = 0) -> nn.Module:
    """The seeded network, every Dropout at p=0 (torchvision's FCN head has one)."""
    torch.manual_seed(seed)
    m = net.make()
    for mod in m.modules():
        if isinstance(mod, nn.modules.dropout._DropoutNd):
            mod.p = 0.0
    return m


def first_tensor(out: Any) -> torch.Tensor:
    """The logits of a model's output: a tensor, or torchvision's ``{"out": ...}``."""
    if isinstance(out, dict):
        out = out["out"]
    while isinstance(out, (list, tuple)):
        out = out[0]
    assert isinstance(out, torch.Tensor), type(out)
    return out
