"""The functional graph ops a spatial stage maps to modules: pools, interpolation, ATen upsampling.

Shared by :mod:`nowdl.runtime.spatial.stage` (which runs them on tiles) and
:mod:`nowdl.runtime.spatial.reach` (which measures how far they reach).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nowdl.errors import NowdlError

__all__ = ["ATEN_UP", "POOL_FN", "POOL_ARGS", "INTERP_ARGS", "bind"]

_aten = torch.ops.aten
ATEN_UP: dict[Any, str] = {
    _aten.upsample_nearest1d.vec: "nearest", _aten.upsample_nearest2d.vec: "nearest",
    _aten.upsample_nearest3d.vec: "nearest", _aten.upsample_linear1d.vec: "linear",
    _aten.upsample_bilinear2d.vec: "bilinear", _aten.upsample_trilinear3d.vec: "trilinear",
}
POOL_FN: dict[Any, type[nn.Module]] = {
    F.max_pool1d: nn.MaxPool1d, F.max_pool2d: nn.MaxPool2d, F.max_pool3d: nn.MaxPool3d,
    F.avg_pool1d: nn.AvgPool1d, F.avg_pool2d: nn.AvgPool2d, F.avg_pool3d: nn.AvgPool3d,
}
POOL_ARGS = {
    "max": ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"),
    "avg": ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override"),
}
INTERP_ARGS = ("size", "scale_factor", "mode", "align_corners", "recompute_scale_factor")


def bind(args: Sequence[Any], kwargs: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A functional call's positional ``args`` and ``kwargs`` by parameter ``names`` (antialias refused)."""
    out = dict(zip(names, args, strict=False))
    out.update({k: v for k, v in kwargs.items() if k in names or k == "antialias"})
    if out.get("antialias"):
        raise NowdlError("F.interpolate(antialias=True) is not tiled")
    return out

