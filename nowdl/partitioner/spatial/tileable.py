"""Which graph nodes may run on image tiles, the halo each needs, and tile geometry.

[Note: spatial rules] A node may sit in a spatial stage when it computes each output pixel
from a bounded neighbourhood of input pixels (convolutions, pooling with a fixed window,
upsampling, elementwise ops, channel concatenation), or from statistics that the tiles can
reduce together exactly (BatchNorm, InstanceNorm, GroupNorm). Anything that needs the whole
image at once (flatten, view, linear, attention, reductions over spatial dims) ends the region;
sizes read off a tile give the whole image's, and average pooling whose branch comes back to the
image is reduced over the tiles ([Note: whole values on tiles] in ``whole_values``). Unknown ops are refused: planning a
spatial region through an op nowdl cannot tile would train a different model.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from nowdl.partitioner.spatial.rule import SpatialRule
from nowdl.partitioner.spatial.whole_values import whole_value_rules

__all__ = ["SpatialRule", "spatial_rules", "slice_grid", "SLICE_METHODS", "tile_shape", "halo_elements", "convt_reach",
           "UPSAMPLE_REACH"]

SLICE_METHODS = ("vertical", "horizontal", "square", "depth", "cube")


UPSAMPLE_REACH = (2.0,)
"""Input pixels an upsample's output pixel may read beyond its footprint, as sequential tiles count them."""


def convt_reach(k: int, s: int, d: int, p: int) -> Fraction:
    """Input pixels a transposed conv's output pixel reads beyond its own footprint (``[o/s, (o+1)/s)``
    in input pixels), on the farther side: exact, often a fraction (kernel = stride = s, no
    padding: (s - 1) / s), which sequential tiles' window alignment rounds once per stage."""
    before = max(Fraction(o, s) - -(-(o + p - d * (k - 1)) // s) for o in range(s))
    after = max((o + p) // s + 1 - Fraction(o + 1, s) for o in range(s))
    return max(before, after, Fraction(0))


_ELEMENTWISE_MODULES: tuple[type, ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh,
    nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
)
_NORM_MODULES: tuple[type, ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.GroupNorm,
)
_CONV_MODULES: tuple[type, ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONVT_MODULES: tuple[type, ...] = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_POOL_MODULES: tuple[type, ...] = (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
)
_GLOBAL_MODULES: tuple[type, ...] = (
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.Flatten, nn.Linear, nn.MultiheadAttention, nn.LayerNorm, nn.Softmax, nn.LogSoftmax,
)

_ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.iadd,
    operator.imul, torch.add, torch.sub, torch.mul, torch.div, torch.relu, torch.sigmoid,
    torch.tanh, torch.neg, torch.exp, torch.clamp, torch.abs, F.relu, F.relu6, F.leaky_relu,
    F.elu, F.gelu, F.silu, F.mish, F.sigmoid, F.tanh, F.hardswish, F.softplus, F.dropout,
    F.dropout2d, F.dropout3d,
}
_ELEMENTWISE_METHODS = {
    "add", "sub", "mul", "div", "relu", "sigmoid", "tanh", "clamp", "contiguous", "float",
    "half", "bfloat16", "neg", "exp", "abs", "add_", "mul_", "relu_",
}


def _tuple(v: object, n: int) -> tuple[int, ...]:
    if isinstance(v, (tuple, list)):
        return tuple(int(x) for x in v)
    return (int(v),) * n  # type: ignore[call-overload]


def _conv_halo(m: nn.Module) -> tuple[int, ...]:
    n = len(m.kernel_size)  # type: ignore[arg-type]
    k = _tuple(m.kernel_size, n)  # type: ignore[arg-type]
    d = _tuple(m.dilation, n)  # type: ignore[arg-type]
    return tuple((d[i] * (k[i] - 1) + 1) // 2 for i in range(n))


def _module_rule(m: nn.Module) -> SpatialRule:
    name = type(m).__name__
    if isinstance(m, (*_CONV_MODULES, *_CONVT_MODULES)) and getattr(m, "padding_mode", "zeros") != "zeros":
        return SpatialRule(False, f"{name}(padding_mode={m.padding_mode!r}) is not tiled (only zero padding is)")
    if isinstance(m, _CONV_MODULES):
        return SpatialRule(True, "", _conv_halo(m), "conv")
    if isinstance(m, _CONVT_MODULES):
        n = len(m.kernel_size)  # type: ignore[arg-type]
        k, s = _tuple(m.kernel_size, n), _tuple(m.stride, n)  # type: ignore[arg-type]
        d, p = _tuple(m.dilation, n), _tuple(m.padding, n)  # type: ignore[arg-type]
        return SpatialRule(True, "", tuple(max(0, math.ceil((k[i] - s[i]) / max(s[i], 1))) for i in range(n)), "upsample",
                           tuple(float(convt_reach(k[i], s[i], d[i], p[i])) for i in range(n)))
    if isinstance(m, _POOL_MODULES) and getattr(m, "return_indices", False):
        return SpatialRule(False, f"{name}(return_indices=True) is not tiled (the indices would be tile-local)")
    if isinstance(m, _POOL_MODULES):
        n = {"1d": 1, "2d": 2, "3d": 3}[name[-2:]]
        k = _tuple(m.kernel_size, n)  # type: ignore[arg-type]
        s = _tuple(m.stride or m.kernel_size, n)  # type: ignore[arg-type]
        d = _tuple(getattr(m, "dilation", 1), n)  # type: ignore[arg-type]
        return SpatialRule(True, "", tuple(max(0, (d[i] * (k[i] - 1) + 1 - s[i] + 1) // 2) for i in range(n)), "pool")
    if isinstance(m, nn.Upsample):
        mode = m.mode
        if mode in ("nearest", "nearest-exact"):
            return SpatialRule(True, "", (), "upsample", UPSAMPLE_REACH)
        if mode in ("bilinear", "linear", "trilinear"):
            return SpatialRule(True, "", (1,), "upsample", UPSAMPLE_REACH)
        return SpatialRule(False, f"Upsample(mode={mode!r}) is not tiled (nearest, nearest-exact, linear, bilinear and "
                                  "trilinear are)")
    if isinstance(m, _NORM_MODULES):
        return SpatialRule(True, "", (), "norm")
    if isinstance(m, _ELEMENTWISE_MODULES):
        return SpatialRule(True, "", (), "elementwise")
    if isinstance(m, _GLOBAL_MODULES):
        return SpatialRule(False, f"{name} needs the whole image (it ends a spatial region)")
    return SpatialRule(False, f"{name} is not a module nowdl knows how to run on tiles")


def _cat_dim(node: fx.Node) -> int:
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    return int(dim) if isinstance(dim, int) else 0


_ATEN_COPIES = {torch.ops.aten.to.dtype, torch.ops.aten.clone.default, torch.ops.aten.contiguous.default,
                torch.ops.aten._to_copy.default, torch.ops.aten.alias.default}


def _aten_rule(node: fx.Node, op: torch._ops.OpOverload) -> SpatialRule:
    """ATen calls in torch.export graphs: pointwise ops (by their ``pointwise`` tag), dtype
    copies and channel concatenation run on tiles; anything else names itself."""
    name = f"aten.{op._schema.name.partition('::')[2]}"
    if op in (torch.ops.aten.cat.default, torch.ops.aten.concat.default):
        dim = _cat_dim(node)
        if dim == 1:
            return SpatialRule(True, "", (), "concat")
        return SpatialRule(False, f"{name} along dim {dim} (only channel concatenation, dim 1, is tiled)")
    if op in (torch.ops.aten.pad.default, torch.ops.aten.constant_pad_nd.default):
        return _pad_rule(node, name)
    if op is torch.ops.aten.repeat.default:
        return _repeat_rule(node, name)
    if op in _ATEN_UPSAMPLE:
        sizes, scales = (list(node.args[1:]) + [None] * 3)[0], node.args[-1] if len(node.args) > 2 else None
        if aten_upsample_scales(node) is not None or any(
                isinstance(v, (list, tuple)) and v and all(isinstance(f, (int, float)) and float(f).is_integer() for f in v)
                for v in (sizes, scales)):
            # by whole scales or to the traced (whole) size, which each tile's part is cut from, align_corners too
            return SpatialRule(True, "", () if "nearest" in name else (1,), "upsample", UPSAMPLE_REACH)
        return SpatialRule(False, f"{name} to a computed output size is not tiled (a scale factor or a fixed size is)")
    if op is torch.ops.aten._to_copy.default and node.kwargs.get("device") is not None:
        return SpatialRule(False, f"{name} to another device is not tiled")
    if torch.Tag.pointwise in op.tags or op in _ATEN_COPIES:
        return SpatialRule(True, "", (), "elementwise")
    return SpatialRule(False, f"{name} is not an op nowdl knows how to run on tiles (pointwise ATen ops, channel "
                              "cat and the standard nn modules are)")


_ATEN_UPSAMPLE = {torch.ops.aten.upsample_nearest1d.vec, torch.ops.aten.upsample_nearest2d.vec,
                  torch.ops.aten.upsample_nearest3d.vec, torch.ops.aten.upsample_linear1d.vec,
                  torch.ops.aten.upsample_bilinear2d.vec, torch.ops.aten.upsample_trilinear3d.vec}


def _rank(node: object) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def aten_upsample_scales(node: fx.Node) -> tuple[float, ...] | None:
    """Integer scale factors of an ATen upsample node (from its scales, or from a traced output
    size that is a whole multiple of the traced input size), or None."""
    nearest = "nearest" in str(node.target)
    args: list[Any] = list(node.args)
    sizes = args[1] if len(args) > 1 else None
    scales = args[2 if nearest else 3] if len(args) > (2 if nearest else 3) else None
    if not nearest and len(args) > 2 and args[2]:
        return None  # align_corners=True: a tile's corners are not the image's
    if scales is not None and all(float(f).is_integer() for f in scales):
        return tuple(float(f) for f in scales)
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if sizes is None or not isinstance(val, torch.Tensor):
        return None
    ins = [int(d) for d in val.shape[2:]]
    outs = [int(d) for d in sizes]
    if len(ins) != len(outs) or any(o % i for i, o in zip(ins, outs, strict=True)):
        return None
    return tuple(float(o // i) for i, o in zip(ins, outs, strict=True))


def _pad_rule(node: fx.Node, name: str) -> SpatialRule:
    """A pad that adds nothing along the spatial dims (only channels, or zero) runs on tiles."""
    pads = node.args[1] if len(node.args) > 1 else ()
    if not isinstance(pads, (list, tuple)) or not all(isinstance(p, int) for p in pads):
        return SpatialRule(False, f"{name} with computed amounts is not tiled")
    rank = _rank(node.args[0])
    spatial = len(pads) // 2 if rank is None else min(len(pads) // 2, rank - 2)
    if any(pads[: 2 * spatial]):
        return SpatialRule(False, f"{name} {list(pads)} pads the image's border (it needs the whole image)")
    return SpatialRule(True, "", (), "elementwise")


def _repeat_rule(node: fx.Node, name: str, rank: int | None = None) -> SpatialRule:
    """``x.repeat(1, c, 1, 1)``: repeating only the batch and channel dims runs on tiles."""
    sizes: Any = node.args[1:] if node.op == "call_method" else node.args[1:2]
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
        sizes = sizes[0]
    rank = _rank(node.args[0]) if rank is None else rank
    if not sizes or not all(isinstance(s, int) for s in sizes) or (rank is not None and len(sizes) != rank):
        return SpatialRule(False, f"{name} with computed sizes or new dims needs the whole tensor")
    if any(s != 1 for s in sizes[2:]):
        return SpatialRule(False, f"{name}{tuple(sizes)} repeats the image along a spatial dim (it needs the whole image)")
    return SpatialRule(True, "", (), "elementwise")


def _function_rule(node: fx.Node) -> SpatialRule:
    t = node.target
    tname = getattr(t, "__name__", str(t))
    if isinstance(t, torch._ops.OpOverload):
        return _aten_rule(node, t)
    if t in (torch.cat, torch.concat, torch.concatenate):
        dim = _cat_dim(node)
        if dim == 1:
            return SpatialRule(True, "", (), "concat")
        return SpatialRule(False, f"torch.cat along dim {dim} (only channel concatenation, dim 1, is tiled)")
    if t in _ELEMENTWISE_FUNCTIONS:
        return SpatialRule(True, "", (), "elementwise")
    if t is F.interpolate:
        mode = node.kwargs.get("mode", node.args[3] if len(node.args) > 3 else "nearest")
        if node.kwargs.get("antialias"):
            return SpatialRule(False, "F.interpolate(antialias=True) is not tiled")
        if mode in ("nearest", "nearest-exact"):
            return SpatialRule(True, "", (), "upsample", UPSAMPLE_REACH)
        if mode in ("bilinear", "linear", "trilinear"):
            return SpatialRule(True, "", (1,), "upsample", UPSAMPLE_REACH)
        return SpatialRule(False, f"F.interpolate(mode={mode!r}) is not tiled")
    if t in (F.max_pool1d, F.max_pool2d, F.max_pool3d) and (node.kwargs.get("return_indices") or len(node.args) > 6):
        return SpatialRule(False, f"{tname}(return_indices=True) is not tiled (the indices would be tile-local)")
    if t in (F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d):
        k = node.kwargs.get("kernel_size", node.args[1] if len(node.args) > 1 else 1)
        kk = max(_tuple(k, 1)) if isinstance(k, (int, tuple, list)) else 1
        return SpatialRule(True, "", ((kk - 1) // 2,), "pool")
    if t in (F.conv1d, F.conv2d, F.conv3d):
        return SpatialRule(False, f"{tname} (functional convolution) is not tiled; use nn.Conv{tname[-2:]} modules")
    if t in (F.batch_norm, F.instance_norm, F.group_norm, F.layer_norm):
        return SpatialRule(False, f"{tname} (functional normalisation) is not tiled: its statistics would be per tile; "
                                  "use the nn module (BatchNorm, InstanceNorm, GroupNorm)")
    if t is operator.getitem:
        return SpatialRule(False, "indexing (getitem) may slice spatial dims; it ends a spatial region")
    return SpatialRule(False, f"{tname} is not an op nowdl knows how to run on tiles")


def spatial_rules(gm: fx.GraphModule, ranks: Mapping[str, int] | None = None) -> dict[str, SpatialRule]:
    """The SpatialRule of every node of ``gm`` (keyed by node name). ``ranks`` gives each node's
    output rank where the graph does not carry it (fx graphs; the profile's ``out_shape``)."""
    out: dict[str, SpatialRule] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            out[node.name] = SpatialRule(True, "", (), "io")
        elif node.op == "get_attr":
            out[node.name] = SpatialRule(True, "", (), "io")
        elif node.op == "call_module":
            out[node.name] = _module_rule(gm.get_submodule(str(node.target)))  # a shared module has several paths
        elif node.op == "call_function":
            out[node.name] = _function_rule(node)
        elif node.op == "call_method":
            if node.target in _ELEMENTWISE_METHODS:
                out[node.name] = SpatialRule(True, "", (), "elementwise")
            elif node.target == "repeat":
                src = node.args[0]
                rank = (ranks or {}).get(src.name) if isinstance(src, fx.Node) else None
                out[node.name] = _repeat_rule(node, "tensor.repeat", rank)
            else:
                out[node.name] = SpatialRule(False, f"tensor.{node.target}() needs the whole tensor (it ends a spatial region)")
        else:  # pragma: no cover - fx has no other ops
            out[node.name] = SpatialRule(False, f"fx op {node.op}")
    out.update(whole_value_rules(gm, out, ranks))  # sizes and pooled branches: [Note: whole values on tiles]
    return out


def slice_grid(method: str, parts: int, spatial_dims: int) -> tuple[int, ...]:
    """How many tiles along each spatial dim (H, W) or (D, H, W) for a slice method.

    Raises:
        ValueError: unknown method, a method that does not fit the dims, or parts < 1.
    """
    if parts < 1:
        raise ValueError(f"spatial parts must be >= 1 (got {parts})")
    if method not in SLICE_METHODS:
        raise ValueError(f"unknown slice method {method!r}: use one of {', '.join(SLICE_METHODS)}")
    if spatial_dims == 1:
        return (parts,)
    lead = (1,) * (spatial_dims - 2)
    if method == "vertical":
        return lead + (1, parts)
    if method == "horizontal":
        return lead + (parts, 1)
    if method == "square":
        a = int(math.isqrt(parts))
        while parts % a:
            a -= 1
        return lead + (a, parts // a)
    if spatial_dims != 3:
        raise ValueError(f"slice method {method!r} is for 3D volumes; use vertical, horizontal or square for 2D")
    if method == "depth":
        return (parts, 1, 1)
    c = round(parts ** (1 / 3))
    if c**3 != parts:
        raise ValueError(f"cube slicing needs a cube number of parts (8, 27, 64), got {parts}")
    return (c, c, c)


def tile_shape(shape: Sequence[int], grid: Sequence[int]) -> tuple[int, ...]:
    """The largest tile of an (N, C, *spatial) shape cut by ``grid`` (uneven tiles round up)."""
    sp = list(shape[2:])
    g = list(grid)[-len(sp):] if sp else []
    g = [1] * (len(sp) - len(g)) + g
    return tuple(shape[:2]) + tuple(math.ceil(s / max(1, gi)) for s, gi in zip(sp, g, strict=True))


def halo_elements(shape: Sequence[int], grid: Sequence[int], halo: Sequence[int]) -> int:
    """Elements one interior tile receives for a halo of ``halo`` pixels per side (corners included)."""
    if not halo or len(shape) < 3:
        return 0
    tile = tile_shape(shape, grid)
    sp = list(tile[2:])
    h = list(halo) + [halo[-1]] * (len(sp) - len(halo))
    g = [1] * (len(sp) - len(grid)) + list(grid)[-len(sp):]
    # padded tile minus tile; only along dims that are actually cut
    padded = 1
    plain = 1
    for s, hi, gi in zip(sp, h[: len(sp)], g, strict=True):
        plain *= s
        padded *= s + (2 * hi if gi > 1 else 0)
    return int(tile[0]) * int(tile[1]) * (padded - plain)
