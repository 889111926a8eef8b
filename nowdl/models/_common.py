"""Helpers shared by the model zoo: 2D/3D layer choice and input-shape checks."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from nowdl.errors import NowdlError

__all__ = [
    "conv_cls",
    "batch_norm_cls",
    "max_pool_cls",
    "conv_transpose_cls",
    "check_spatial_dims",
    "check_input_shape",
]

_CONV: dict[int, type[nn.Module]] = {2: nn.Conv2d, 3: nn.Conv3d}
_BN: dict[int, type[nn.Module]] = {2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_MAXPOOL: dict[int, type[nn.Module]] = {2: nn.MaxPool2d, 3: nn.MaxPool3d}
_CONVT: dict[int, type[nn.Module]] = {2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


def check_spatial_dims(spatial_dims: int) -> int:
    """Return ``spatial_dims`` if it is 2 or 3, else raise NowdlError."""
    if spatial_dims not in (2, 3):
        raise NowdlError(f"spatial_dims must be 2 (images) or 3 (volumes), got {spatial_dims!r}")
    return spatial_dims


def conv_cls(spatial_dims: int) -> type[nn.Module]:
    """``nn.Conv2d`` or ``nn.Conv3d``."""
    return _CONV[check_spatial_dims(spatial_dims)]


def batch_norm_cls(spatial_dims: int) -> type[nn.Module]:
    """``nn.BatchNorm2d`` or ``nn.BatchNorm3d``."""
    return _BN[check_spatial_dims(spatial_dims)]


def max_pool_cls(spatial_dims: int) -> type[nn.Module]:
    """``nn.MaxPool2d`` or ``nn.MaxPool3d``."""
    return _MAXPOOL[check_spatial_dims(spatial_dims)]


def conv_transpose_cls(spatial_dims: int) -> type[nn.Module]:
    """``nn.ConvTranspose2d`` or ``nn.ConvTranspose3d``."""
    return _CONVT[check_spatial_dims(spatial_dims)]


def check_input_shape(
    model: str, shape: Sequence[int], *, in_channels: int, spatial_dims: int, multiple: int = 1
) -> None:
    """Raise NowdlError unless ``shape`` is ``(N, in_channels, *spatial)`` with each spatial
    size a positive multiple of ``multiple``."""
    shape = tuple(int(s) for s in shape)
    want = 2 + spatial_dims
    if len(shape) != want:
        layout = "N, C, H, W" if spatial_dims == 2 else "N, C, D, H, W"
        raise NowdlError(
            f"{model} expects a {want}-d input ({layout}), got shape {shape} ({len(shape)}-d)"
        )
    if shape[0] < 1:
        raise NowdlError(f"{model}: batch size must be >= 1, got shape {shape}")
    if shape[1] != in_channels:
        raise NowdlError(
            f"{model} was built with in_channels={in_channels} but the input has "
            f"{shape[1]} channels (shape {shape})"
        )
    bad = [s for s in shape[2:] if s < multiple or s % multiple]
    if bad:
        fixed = tuple(max(multiple, round(s / multiple) * multiple) for s in shape[2:])
        raise NowdlError(
            f"{model}: every spatial size must be a positive multiple of {multiple}, got "
            f"{shape[2:]}; e.g. use {fixed}"
        )
