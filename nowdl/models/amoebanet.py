"""AmoebaNet-D (Real et al. 2018) as in the torchgpipe / MPI4DL benchmarks, as a plain module."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from nowdl.errors import NowdlError
from nowdl.models._common import check_input_shape

__all__ = [
    "AmoebaNetD",
    "amoebanetd",
    "NORMAL_OPERATIONS",
    "NORMAL_CONCAT",
    "REDUCTION_OPERATIONS",
    "REDUCTION_CONCAT",
]


def _relu_conv_bn(
    in_ch: int,
    out_ch: int,
    kernel_size: int | tuple[int, int] = 1,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
) -> list[nn.Module]:
    return [
        nn.ReLU(),
        nn.Conv2d(in_ch, out_ch, kernel_size, stride=stride, padding=padding, bias=False),
        nn.BatchNorm2d(out_ch),
    ]


class ReLUConvBN(nn.Module):
    """ReLU, 1x1 conv (no bias), BN: the cell's input adapters (torchgpipe ``relu_conv_bn``)."""

    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.conv = nn.Conv2d(in_ch, out_ch, 1, bias=False)
        self.bn = nn.BatchNorm2d(out_ch)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.conv(self.relu(x)))


class FactorizedReduce(nn.Module):
    """Halve H and W with two shifted stride-2 1x1 convs concatenated (torchgpipe/DARTS)."""

    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        if out_ch % 2:
            raise NowdlError(f"FactorizedReduce needs an even out_ch, got {out_ch}")
        self.relu = nn.ReLU()
        self.pad = nn.ZeroPad2d((0, 1, 0, 1))
        self.conv1 = nn.Conv2d(in_ch, out_ch // 2, 1, stride=2, bias=False)
        self.conv2 = nn.Conv2d(in_ch, out_ch // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(out_ch)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(x)
        x = torch.cat([self.conv1(x), self.conv2(self.pad(x[:, :, 1:, 1:]))], dim=1)
        return self.bn(x)


class _Stack(nn.Module):
    """A chain of layers with its own forward (kept out of ``nn.Sequential`` on purpose)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def none(channels: int, stride: int) -> nn.Module:
    """Identity, or FactorizedReduce when the op must down-sample."""
    return nn.Identity() if stride == 1 else FactorizedReduce(channels, channels)


def avg_pool_3x3(channels: int, stride: int) -> nn.Module:
    """3x3 average pooling, padding excluded from the mean."""
    return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)


def max_pool_3x3(channels: int, stride: int) -> nn.Module:
    """3x3 max pooling (torchgpipe and MPI4DL use an AvgPool2d here by mistake)."""
    return nn.MaxPool2d(3, stride=stride, padding=1)


def max_pool_2x2(channels: int, stride: int) -> nn.Module:
    """2x2 max pooling."""
    return nn.MaxPool2d(2, stride=stride, padding=0)


def conv_1x7_7x1(channels: int, stride: int) -> nn.Module:
    """1x1 squeeze to c/4, 1x7 then 7x1 convs, 1x1 expand back to c (each ReLU-conv-BN)."""
    c, q = channels, channels // 4
    return _Stack(
        _relu_conv_bn(c, q)
        + _relu_conv_bn(q, q, (1, 7), (1, stride), (0, 3))
        + _relu_conv_bn(q, q, (7, 1), (stride, 1), (3, 0))
        + _relu_conv_bn(q, c)
    )


def conv_1x1(channels: int, stride: int) -> nn.Module:
    """ReLU, 1x1 conv (may stride), BN."""
    return _Stack(_relu_conv_bn(channels, channels, 1, stride))


def conv_3x3(channels: int, stride: int) -> nn.Module:
    """1x1 squeeze to c/4, 3x3 conv, 1x1 expand back to c (each ReLU-conv-BN)."""
    c, q = channels, channels // 4
    return _Stack(_relu_conv_bn(c, q) + _relu_conv_bn(q, q, 3, stride, 1) + _relu_conv_bn(q, c))


Op = Callable[[int, int], nn.Module]

# AmoebaNet-D genotype, as in torchgpipe: pairs (input state index, operation); each
# consecutive pair of ops is summed into a new state.
NORMAL_OPERATIONS: tuple[tuple[int, Op], ...] = (
    (1, conv_1x1),
    (1, max_pool_3x3),
    (1, none),
    (0, conv_1x7_7x1),
    (0, conv_1x1),
    (0, conv_1x7_7x1),
    (2, max_pool_3x3),
    (2, none),
    (1, avg_pool_3x3),
    (5, conv_1x1),
)
# The paper says [4, 5, 6]; TensorFlow's reference (and torchgpipe, which reproduces
# GPipe's parameter counts with it) uses [0, 3, 4, 6].
NORMAL_CONCAT: tuple[int, ...] = (0, 3, 4, 6)

REDUCTION_OPERATIONS: tuple[tuple[int, Op], ...] = (
    (0, max_pool_2x2),
    (0, max_pool_3x3),
    (2, none),
    (1, conv_3x3),
    (2, conv_1x7_7x1),
    (2, max_pool_3x3),
    (3, none),
    (1, max_pool_2x2),
    (2, avg_pool_3x3),
    (3, conv_1x1),
)
REDUCTION_CONCAT: tuple[int, ...] = (4, 5, 6)


class Cell(nn.Module):
    """One AmoebaNet-D cell: ``forward(prev, prev_prev)`` returns the concatenated new states."""

    def __init__(
        self,
        channels_prev_prev: int,
        channels_prev: int,
        channels: int,
        *,
        reduction: bool,
        reduction_prev: bool,
    ) -> None:
        super().__init__()
        self.reduction = reduction
        self.reduce1 = ReLUConvBN(channels_prev, channels)
        self.reduce2: nn.Module | None = None
        if reduction_prev:
            self.reduce2 = FactorizedReduce(channels_prev_prev, channels)
        elif channels_prev_prev != channels:
            self.reduce2 = ReLUConvBN(channels_prev_prev, channels)
        genotype = REDUCTION_OPERATIONS if reduction else NORMAL_OPERATIONS
        self.indices: tuple[int, ...] = tuple(i for i, _ in genotype)
        self.concat: tuple[int, ...] = REDUCTION_CONCAT if reduction else NORMAL_CONCAT
        self.operations = nn.ModuleList(
            op(channels, 2 if reduction and i < 2 else 1) for i, op in genotype
        )
        self.out_channels = channels * len(self.concat)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction}, indices={self.indices}, concat={self.concat}"

    def forward(self, prev: Tensor, prev_prev: Tensor) -> Tensor:
        s1 = self.reduce1(prev)
        s2 = self.reduce2(prev_prev) if self.reduce2 is not None else prev_prev
        states = [s1, s2]
        ops = list(self.operations)
        for k in range(0, len(ops), 2):
            h1 = ops[k](states[self.indices[k]])
            h2 = ops[k + 1](states[self.indices[k + 1]])
            states.append(h1 + h2)
        return torch.cat([states[i] for i in self.concat], dim=1)


class Stem(nn.Module):
    """3x3 stride-2 conv and BN on the image (torchgpipe also puts a ReLU first; see AmoebaNetD)."""

    def __init__(self, in_channels: int, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, channels, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.conv(x))


class AmoebaNetD(nn.Module):
    """AmoebaNet-D (Real et al. 2018) for ImageNet-like inputs, GPipe/torchgpipe layout.

    Cells, in order (names as in torchgpipe): ``stem1`` (conv), ``stem2``/``stem3``
    (reduction), ``cell1_normal{1..L/3}``, ``cell2_reduction``, ``cell3_normal*``,
    ``cell4_reduction``, ``cell5_normal*``, then global average pooling and a linear
    classifier. Spatial size shrinks 32x, so H and W must be multiples of 32
    (see :meth:`check_input`). Differences from torchgpipe/MPI4DL, none affecting
    parameter counts: no ReLU on the raw image before the stem conv, ``max_pool_3x3``
    is a real max pool, adaptive global pooling instead of ``AvgPool2d(7)``.
    """

    def __init__(
        self,
        num_classes: int = 10,
        num_layers: int = 18,
        num_filters: int = 416,
        *,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_classes", num_classes),
            ("in_channels", in_channels),
            ("num_layers", num_layers),
            ("num_filters", num_filters),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise NowdlError(f"AmoebaNet-D {name} must be a positive int, got {value!r}")
        if num_layers % 3:
            lower = max(3, num_layers // 3 * 3)
            raise NowdlError(
                f"AmoebaNet-D num_layers must be a multiple of 3 (got {num_layers}): "
                f"try {lower} or {lower + 3}"
            )
        if num_filters % 8:
            lower = max(8, num_filters // 8 * 8)
            raise NowdlError(
                f"AmoebaNet-D num_filters must be a multiple of 8 (got {num_filters}): "
                f"try {lower} or {lower + 8}"
            )
        self.num_classes = num_classes
        self.num_layers = num_layers
        self.num_filters = num_filters
        self.in_channels = in_channels
        repeat = num_layers // 3

        channels = num_filters // 4
        c_pp = c_p = channels
        reduction_prev = False
        cells: dict[str, Cell] = {}

        def add(name: str, reduction: bool) -> None:
            nonlocal c_pp, c_p, channels, reduction_prev
            cell = Cell(c_pp, c_p, channels, reduction=reduction, reduction_prev=reduction_prev)
            cells[name] = cell
            c_pp, c_p, reduction_prev = c_p, cell.out_channels, reduction

        self.stem1 = Stem(in_channels, channels)
        for name in ("stem2", "stem3"):
            channels *= 2
            add(name, True)
        for group in (1, 3, 5):
            if group > 1:
                channels *= 2
                add(f"cell{group - 1}_reduction", True)
            for i in range(repeat):
                add(f"cell{group}_normal{i + 1}", False)
        self.cells = nn.ModuleDict(cells)
        self.num_features = c_p
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_p, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        prev = self.stem1(x)
        prev_prev = prev
        for cell in self.cells.values():
            prev, prev_prev = cell(prev, prev_prev), prev
        return self.fc(torch.flatten(self.pool(prev), 1))

    def check_input(self, shape: Sequence[int]) -> None:
        """Raise NowdlError unless ``shape`` is ``(N, in_channels, H, W)``, H and W multiples of 32."""
        check_input_shape(
            "AmoebaNet-D", shape, in_channels=self.in_channels, spatial_dims=2, multiple=32
        )


def amoebanetd(
    num_classes: int = 10,
    num_layers: int = 18,
    num_filters: int = 416,
    *,
    in_channels: int = 3,
) -> AmoebaNetD:
    """Build AmoebaNet-D (Real et al. 2018) with torchgpipe's ``amoebanetd`` signature.

    Defaults (18 layers, 416 filters) are MPI4DL's benchmark defaults; GPipe's Table 1
    uses (18, 208) = 82M and (18, 416) = 318M parameters at 1000 classes.
    ``num_layers`` is the number of normal cells (a multiple of 3).
    """
    return AmoebaNetD(num_classes, num_layers, num_filters, in_channels=in_channels)
