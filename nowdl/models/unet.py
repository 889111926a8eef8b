"""UNet (Ronneberger et al. 2015) in 2D or 3D with same-size convolutions and long skips."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from nowdl.errors import NowdlError
from nowdl.models._common import (
    batch_norm_cls,
    check_input_shape,
    check_spatial_dims,
    conv_cls,
    conv_transpose_cls,
    max_pool_cls,
)

__all__ = ["UNet", "DoubleConv", "unet", "unet3d"]


class DoubleConv(nn.Module):
    """Two 3x3 (3x3x3) convs with padding 1, each followed by [BN and] ReLU."""

    def __init__(self, spatial_dims: int, in_ch: int, out_ch: int, *, norm: bool) -> None:
        super().__init__()
        conv, bn = conv_cls(spatial_dims), batch_norm_cls(spatial_dims)
        self.conv1 = conv(in_ch, out_ch, 3, padding=1, bias=not norm)
        self.bn1 = bn(out_ch) if norm else None
        self.relu1 = nn.ReLU()
        self.conv2 = conv(out_ch, out_ch, 3, padding=1, bias=not norm)
        self.bn2 = bn(out_ch) if norm else None
        self.relu2 = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        if self.bn1 is not None:
            x = self.bn1(x)
        x = self.relu1(x)
        x = self.conv2(x)
        if self.bn2 is not None:
            x = self.bn2(x)
        return self.relu2(x)


class UNet(nn.Module):
    """UNet (Ronneberger et al. 2015); 3D variant after Cicek et al. 2016.

    Level ``i`` (0..``depth``) has ``base_width * 2**i`` channels. The encoder applies a
    :class:`DoubleConv` per level with a 2x max pool between levels; the decoder
    up-samples with a stride-2 transposed conv (halving channels), concatenates the
    encoder output of the same level along channels (the long skip), and applies a
    :class:`DoubleConv`. A final 1x1 conv maps to ``out_channels``. Convs use padding 1,
    so the output has the input's spatial size.

    **Input constraint:** every spatial size must be a multiple of ``2**depth``
    (16 for the default depth 4); this cannot be checked inside a traceable
    ``forward``, so call :meth:`check_input` first.
    """

    def __init__(
        self,
        in_channels: int = 3,
        out_channels: int = 2,
        *,
        depth: int = 4,
        base_width: int = 64,
        spatial_dims: int = 2,
        norm: bool = False,
    ) -> None:
        super().__init__()
        check_spatial_dims(spatial_dims)
        for name, value in (
            ("in_channels", in_channels),
            ("out_channels", out_channels),
            ("depth", depth),
            ("base_width", base_width),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise NowdlError(f"UNet {name} must be a positive int, got {value!r}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.depth = depth
        self.spatial_dims = spatial_dims
        widths = [base_width * 2**i for i in range(depth + 1)]
        self.widths = tuple(widths)

        pool, up = max_pool_cls(spatial_dims), conv_transpose_cls(spatial_dims)
        self.encoders = nn.ModuleList(
            DoubleConv(spatial_dims, in_channels if i == 0 else widths[i - 1], widths[i], norm=norm)
            for i in range(depth + 1)
        )
        self.pools = nn.ModuleList(pool(2) for _ in range(depth))
        # Decoder modules are listed deepest first, in execution order.
        self.ups = nn.ModuleList(
            up(widths[i], widths[i - 1], 2, stride=2) for i in range(depth, 0, -1)
        )
        self.decoders = nn.ModuleList(
            DoubleConv(spatial_dims, 2 * widths[i - 1], widths[i - 1], norm=norm)
            for i in range(depth, 0, -1)
        )
        self.head = conv_cls(spatial_dims)(widths[0], out_channels, 1)

    @property
    def input_multiple(self) -> int:
        """Every spatial input size must be a multiple of this (``2**depth``)."""
        return 2**self.depth

    def forward(self, x: Tensor) -> Tensor:
        skips: list[Tensor] = []
        for i in range(self.depth):
            x = self.encoders[i](x)
            skips.append(x)
            x = self.pools[i](x)
        x = self.encoders[self.depth](x)
        for j in range(self.depth):
            x = self.ups[j](x)
            x = torch.cat([skips[self.depth - 1 - j], x], dim=1)
            x = self.decoders[j](x)
        return self.head(x)

    def check_input(self, shape: Sequence[int]) -> None:
        """Raise NowdlError unless ``shape`` is ``(N, in_channels, *spatial)`` with every
        spatial size a multiple of ``2**depth``."""
        check_input_shape(
            f"UNet(depth={self.depth})",
            shape,
            in_channels=self.in_channels,
            spatial_dims=self.spatial_dims,
            multiple=self.input_multiple,
        )


def unet(
    in_channels: int = 3,
    out_channels: int = 2,
    *,
    depth: int = 4,
    base_width: int = 64,
    spatial_dims: int = 2,
    norm: bool = False,
) -> UNet:
    """Build a UNet (Ronneberger et al. 2015); defaults are the paper's 2D network
    (4 down-steps, 64..1024 channels, no BatchNorm) with padded convs."""
    return UNet(
        in_channels,
        out_channels,
        depth=depth,
        base_width=base_width,
        spatial_dims=spatial_dims,
        norm=norm,
    )


def unet3d(
    in_channels: int = 1,
    out_channels: int = 2,
    *,
    depth: int = 4,
    base_width: int = 16,
    norm: bool = True,
) -> UNet:
    """Build a 3D UNet (Cicek et al. 2016: 3D convs, BatchNorm) with narrower default
    widths (16..256) so large volumes fit."""
    return UNet(
        in_channels, out_channels, depth=depth, base_width=base_width, spatial_dims=3, norm=norm
    )
