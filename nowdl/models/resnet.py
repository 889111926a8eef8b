"""ResNet v1 (He et al. 2015) and pre-activation ResNet v2 (He et al. 2016), as used by GEMS."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, cast

import torch
from torch import Tensor, nn

from nowdl.errors import NowdlError
from nowdl.models._common import (
    batch_norm_cls,
    check_input_shape,
    check_spatial_dims,
)
from nowdl.models.resnet_blocks import (
    BasicBlockV1,
    BasicBlockV2,
    BottleneckV1,
    BottleneckV2,
    _BNConv,
    _ConvBN,
)

__all__ = ["ResNet", "resnet", "resnet110v2", "valid_resnet_depths", "blocks_per_stage",
           # the blocks live in nowdl.models.resnet_blocks
           "BasicBlockV1", "BottleneckV1", "BasicBlockV2", "BottleneckV2", "_ConvBN", "_BNConv"]

BlockKind = Literal["basic", "bottleneck"]

# Layers per residual block in the depth formula: depth = per_block * 3 * n + 2.
_LAYERS_PER_BLOCK: dict[str, int] = {"basic": 2, "bottleneck": 3}


def _default_block(version: int) -> BlockKind:
    return "basic" if version == 1 else "bottleneck"


def blocks_per_stage(depth: int, version: int = 1, block: BlockKind | None = None) -> int:
    """Residual blocks per stage ``n`` for ``depth``: ``6n+2`` (basic) or ``9n+2`` (bottleneck).

    The default block is ``basic`` for v1 and ``bottleneck`` for v2, as in the Keras
    CIFAR-10 ResNet example that GEMS/MPI4DL port (ResNet-110-v2 has ``n = 12``).
    Raises NowdlError naming the nearest valid depths when ``depth`` does not fit.
    """
    if version not in (1, 2):
        raise NowdlError(f"ResNet version must be 1 or 2, got {version!r}")
    kind = block if block is not None else _default_block(version)
    if kind not in _LAYERS_PER_BLOCK:
        raise NowdlError(f"ResNet block must be 'basic' or 'bottleneck', got {kind!r}")
    step = 3 * _LAYERS_PER_BLOCK[kind]
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise NowdlError(f"ResNet depth must be an int, got {depth!r}")
    if depth < step + 2 or (depth - 2) % step:
        lower = max(step + 2, (depth - 2) // step * step + 2)
        upper = lower + step if lower < depth else lower
        hint = f"try {lower} or {upper}" if lower != upper else f"try {lower}"
        raise NowdlError(
            f"depth must be {step}n+2 (n >= 1) for ResNet v{version} with {kind} blocks "
            f"(got {depth}): {hint}"
        )
    return (depth - 2) // step


def valid_resnet_depths(
    version: int = 1, block: BlockKind | None = None, *, limit: int = 5
) -> list[int]:
    """The first ``limit`` valid depths for this version/block (e.g. v1: 8, 14, 20, 26, 32)."""
    kind = block if block is not None else _default_block(version)
    step = 3 * _LAYERS_PER_BLOCK[kind]
    return [step * n + 2 for n in range(1, limit + 1)]


class ResNet(nn.Module):
    """CIFAR-style ResNet v1 (He et al. 2015) / v2 (He et al. 2016) with three stages.

    Layout follows the Keras ``cifar10_resnet`` example that GEMS/MPI4DL port:

    * stem: conv3x3(``width``)-BN-ReLU;
    * basic blocks (``depth = 6n+2``): stage widths ``width, 2*width, 4*width``;
    * bottleneck blocks (``depth = 9n+2``): stage (inner, outer) widths
      ``(w, 4w), (4w, 8w), (8w, 16w)`` -- the Keras example's widths, not the paper's;
    * stages 2 and 3 start with stride 2, so any input size works (sizes round up);
    * head: [BN-ReLU for v2] global average pooling, linear layer; returns logits
      (the GEMS code ends with a softmax, which belongs to the loss here).

    Convs keep their bias (Keras default, as in MPI4DL) unless ``conv_bias=False``.
    """

    def __init__(
        self,
        depth: int,
        version: int = 1,
        *,
        in_channels: int = 3,
        num_classes: int = 10,
        width: int = 16,
        block: BlockKind | None = None,
        spatial_dims: int = 2,
        conv_bias: bool = True,
    ) -> None:
        super().__init__()
        kind: BlockKind = block if block is not None else _default_block(version)
        n = blocks_per_stage(depth, version, kind)
        check_spatial_dims(spatial_dims)
        for name, value in (
            ("in_channels", in_channels),
            ("num_classes", num_classes),
            ("width", width),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise NowdlError(f"ResNet {name} must be a positive int, got {value!r}")
        self.depth = depth
        self.version = version
        self.block = kind
        self.in_channels = in_channels
        self.num_classes = num_classes
        self.spatial_dims = spatial_dims

        self.stem = _ConvBN(
            spatial_dims, in_channels, width, 3, 1, bn=True, relu=True, bias=conv_bias
        )
        stages: list[nn.ModuleList] = []
        in_ch = width
        for stage in range(3):
            blocks: list[nn.Module] = []
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                first = stage == 0 and i == 0
                if kind == "basic":
                    out_ch = width * 2**stage
                    if version == 1:
                        blocks.append(
                            BasicBlockV1(spatial_dims, in_ch, out_ch, stride, bias=conv_bias)
                        )
                    else:
                        # The stem already ends with BN-ReLU: skip the first pre-activation.
                        blocks.append(
                            BasicBlockV2(
                                spatial_dims,
                                in_ch,
                                out_ch,
                                stride,
                                preact=not first,
                                bias=conv_bias,
                            )
                        )
                else:
                    mid_ch = width if stage == 0 else width * 2 ** (stage + 1)
                    out_ch = width * 2 ** (stage + 2)
                    if version == 1:
                        blocks.append(
                            BottleneckV1(
                                spatial_dims,
                                in_ch,
                                mid_ch,
                                out_ch,
                                stride,
                                project=i == 0,
                                bias=conv_bias,
                            )
                        )
                    else:
                        blocks.append(
                            BottleneckV2(
                                spatial_dims,
                                in_ch,
                                mid_ch,
                                out_ch,
                                stride,
                                project=i == 0,
                                preact=not first,
                                bias=conv_bias,
                            )
                        )
                in_ch = out_ch
            stages.append(nn.ModuleList(blocks))
        self.stages = nn.ModuleList(stages)
        self.num_features = in_ch
        if version == 2:
            self.head_bn: nn.Module | None = batch_norm_cls(spatial_dims)(in_ch)
            self.head_relu: nn.Module | None = nn.ReLU()
        else:
            self.head_bn = None
            self.head_relu = None
        pool = nn.AdaptiveAvgPool2d if spatial_dims == 2 else nn.AdaptiveAvgPool3d
        self.pool = pool(1)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for stage in self.stages:
            for blk in cast(nn.ModuleList, stage):
                x = blk(x)
        if self.head_bn is not None and self.head_relu is not None:
            x = self.head_relu(self.head_bn(x))
        x = torch.flatten(self.pool(x), 1)
        return self.fc(x)

    def check_input(self, shape: Sequence[int]) -> None:
        """Raise NowdlError unless ``shape`` is ``(N, in_channels, *spatial)`` (any size >= 1)."""
        check_input_shape(
            f"ResNet-{self.depth}-v{self.version}",
            shape,
            in_channels=self.in_channels,
            spatial_dims=self.spatial_dims,
        )


def resnet(
    depth: int = 110,
    version: int = 2,
    *,
    in_channels: int = 3,
    num_classes: int = 10,
    width: int = 16,
    block: BlockKind | None = None,
    spatial_dims: int = 2,
    conv_bias: bool = True,
) -> ResNet:
    """Build a CIFAR-style ResNet v1 (He et al. 2015) or v2 (He et al. 2016).

    ``depth`` must be ``6n+2`` for basic blocks (v1 default: 20, 32, 44, 56, 110, ...)
    or ``9n+2`` for bottleneck blocks (v2 default: 29, 56, 110, 164, ...).
    """
    return ResNet(
        depth,
        version,
        in_channels=in_channels,
        num_classes=num_classes,
        width=width,
        block=block,
        spatial_dims=spatial_dims,
        conv_bias=conv_bias,
    )


def resnet110v2(
    *,
    in_channels: int = 3,
    num_classes: int = 10,
    width: int = 16,
    spatial_dims: int = 2,
) -> ResNet:
    """ResNet-110-v2 (bottleneck, n = 12), the GEMS model for 1024x1024 pathology tiles
    (Jain et al., SC'20; He et al. 2016)."""
    return ResNet(
        110,
        2,
        in_channels=in_channels,
        num_classes=num_classes,
        width=width,
        spatial_dims=spatial_dims,
    )
