"""The residual blocks of :mod:`nowdl.models.resnet`: v1 (conv-BN-ReLU, He et al. 2015) and
v2 (pre-activation BN-ReLU-conv, He et al. 2016), basic and bottleneck, 2D or 3D."""

from __future__ import annotations

from torch import Tensor, nn

from nowdl.models._common import batch_norm_cls, conv_cls

__all__ = ["BasicBlockV1", "BottleneckV1", "BasicBlockV2", "BottleneckV2"]


class _ConvBN(nn.Module):
    """Keras ``resnet_layer`` with ``conv_first=True``: conv, optional BN, optional ReLU."""

    def __init__(
        self,
        spatial_dims: int,
        in_ch: int,
        out_ch: int,
        kernel_size: int,
        stride: int,
        *,
        bn: bool,
        relu: bool,
        bias: bool,
    ) -> None:
        super().__init__()
        self.conv = conv_cls(spatial_dims)(
            in_ch, out_ch, kernel_size, stride=stride, padding=kernel_size // 2, bias=bias
        )
        self.bn = batch_norm_cls(spatial_dims)(out_ch) if bn else None
        self.relu = nn.ReLU() if relu else None

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)
        if self.bn is not None:
            x = self.bn(x)
        if self.relu is not None:
            x = self.relu(x)
        return x


class _BNConv(nn.Module):
    """Keras ``resnet_layer`` with ``conv_first=False``: optional BN, optional ReLU, then conv."""

    def __init__(
        self,
        spatial_dims: int,
        in_ch: int,
        out_ch: int,
        kernel_size: int,
        stride: int,
        *,
        preact: bool,
        bias: bool,
    ) -> None:
        super().__init__()
        self.bn = batch_norm_cls(spatial_dims)(in_ch) if preact else None
        self.relu = nn.ReLU() if preact else None
        self.conv = conv_cls(spatial_dims)(
            in_ch, out_ch, kernel_size, stride=stride, padding=kernel_size // 2, bias=bias
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.bn is not None:
            x = self.bn(x)
        if self.relu is not None:
            x = self.relu(x)
        return self.conv(x)


class BasicBlockV1(nn.Module):
    """Post-activation basic block: conv3x3-BN-ReLU-conv3x3-BN, add, ReLU (He et al. 2015)."""

    def __init__(
        self, spatial_dims: int, in_ch: int, out_ch: int, stride: int, *, bias: bool = True
    ) -> None:
        super().__init__()
        self.conv1 = _ConvBN(spatial_dims, in_ch, out_ch, 3, stride, bn=True, relu=True, bias=bias)
        self.conv2 = _ConvBN(spatial_dims, out_ch, out_ch, 3, 1, bn=True, relu=False, bias=bias)
        # Keras example: 1x1 projection (no BN) only where the shape changes.
        self.shortcut = (
            _ConvBN(spatial_dims, in_ch, out_ch, 1, stride, bn=False, relu=False, bias=bias)
            if stride != 1 or in_ch != out_ch
            else None
        )
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv2(self.conv1(x))
        if self.shortcut is not None:
            x = self.shortcut(x)
        return self.relu(x + y)


class BottleneckV1(nn.Module):
    """Post-activation bottleneck: 1x1(stride)-3x3-1x1 with BN, add, ReLU (He et al. 2015)."""

    def __init__(
        self,
        spatial_dims: int,
        in_ch: int,
        mid_ch: int,
        out_ch: int,
        stride: int,
        *,
        project: bool,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.conv1 = _ConvBN(spatial_dims, in_ch, mid_ch, 1, stride, bn=True, relu=True, bias=bias)
        self.conv2 = _ConvBN(spatial_dims, mid_ch, mid_ch, 3, 1, bn=True, relu=True, bias=bias)
        self.conv3 = _ConvBN(spatial_dims, mid_ch, out_ch, 1, 1, bn=True, relu=False, bias=bias)
        self.shortcut = (
            _ConvBN(spatial_dims, in_ch, out_ch, 1, stride, bn=False, relu=False, bias=bias)
            if project
            else None
        )
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv3(self.conv2(self.conv1(x)))
        if self.shortcut is not None:
            x = self.shortcut(x)
        return self.relu(x + y)


class BasicBlockV2(nn.Module):
    """Pre-activation basic block: BN-ReLU-conv3x3-BN-ReLU-conv3x3, add (He et al. 2016)."""

    def __init__(
        self,
        spatial_dims: int,
        in_ch: int,
        out_ch: int,
        stride: int,
        *,
        preact: bool = True,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.conv1 = _BNConv(spatial_dims, in_ch, out_ch, 3, stride, preact=preact, bias=bias)
        self.conv2 = _BNConv(spatial_dims, out_ch, out_ch, 3, 1, preact=True, bias=bias)
        self.shortcut = (
            _ConvBN(spatial_dims, in_ch, out_ch, 1, stride, bn=False, relu=False, bias=bias)
            if stride != 1 or in_ch != out_ch
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv2(self.conv1(x))
        if self.shortcut is not None:
            x = self.shortcut(x)
        return x + y


class BottleneckV2(nn.Module):
    """Pre-activation bottleneck as in the Keras ResNet-v2 example ported by GEMS (He et al. 2016).

    ``[BN-ReLU]-conv1x1(stride) - BN-ReLU-conv3x3 - BN-ReLU-conv1x1``, plus a 1x1
    projection shortcut (no BN) on the raw input of each stage's first block.
    """

    def __init__(
        self,
        spatial_dims: int,
        in_ch: int,
        mid_ch: int,
        out_ch: int,
        stride: int,
        *,
        project: bool,
        preact: bool = True,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.conv1 = _BNConv(spatial_dims, in_ch, mid_ch, 1, stride, preact=preact, bias=bias)
        self.conv2 = _BNConv(spatial_dims, mid_ch, mid_ch, 3, 1, preact=True, bias=bias)
        self.conv3 = _BNConv(spatial_dims, mid_ch, out_ch, 1, 1, preact=True, bias=bias)
        self.shortcut = (
            _ConvBN(spatial_dims, in_ch, out_ch, 1, stride, bn=False, relu=False, bias=bias)
            if project
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv3(self.conv2(self.conv1(x)))
        if self.shortcut is not None:
            x = self.shortcut(x)
        return x + y
