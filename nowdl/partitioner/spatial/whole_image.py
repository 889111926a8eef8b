"""Ops whose result depends on the whole image, and what predict does with them.

[Note: whole-image ops] Most of a segmentation network computes each output pixel from a bounded
neighbourhood of input pixels, so a window read with enough margin computes its centre exactly.
Some ops do not: InstanceNorm and GroupNorm without running statistics (and BatchNorm without
them) normalise with statistics over the whole image, global (adaptive) pooling and attention
read every pixel. On one window that covers the image (the default for images up to 2048² or
128³) nowdl's spatial tiles compute them exactly: the tiles reduce the statistics together.

When an image streams in several windows, predict makes the *statistics ops* exact with
statistics passes ([Note: statistics passes] in ``nowdl/runtime/predict/passes.py``): the
norms' per-channel (per-group) mean and variance and the pooled averages or maxima of the whole
image are gathered over the windows' cores before the pass that writes the output. The statistics
of an op depend on the ops before it, so each op gets a *pass*: one more than the deepest pass
among the statistics ops it depends on (:func:`whole_image_ops`); pass k runs the forward of
every window with the ops of passes < k applying the whole-image statistics gathered before. A
MONAI UNet's six InstanceNorms in a chain need six passes; a squeeze-and-excitation block's
pooling and the GroupNorm after it two.

The others cannot be streamed exactly and are computed on each window, named in the plan and in
predict's summary line: attention over the image, adaptive pooling that returns indices or keeps
a dim, an upsampling that maps pixels by the whole extent (``align_corners=True``, or a pooled
grid of more than one bin brought back to the image), and ops nowdl does not know. BatchNorm and
InstanceNorm with running statistics in eval mode (module, ``F.batch_norm(training=False)`` or
ATen's no-training batch norm) are per-pixel affine maps: exact, not listed.

An inference plan lists these ops in ``config.whole_image_ops`` with their pass (0: not exact
when streamed; docs/plan-format.md); ``nowdl show`` prints them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from nowdl.partitioner.spatial.tileable import SpatialRule, aten_upsample_scales, spatial_rules
from nowdl.partitioner.spatial.whole_values import mean_dims

__all__ = ["why_whole", "whole_image_ops", "stream_kind", "windowed_text", "pass_prefixes"]

_STAT_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.GroupNorm)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_AVG_POOLS = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
_MAX_POOLS = (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
_aten = torch.ops.aten
_AVG_FN = {F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, _aten.adaptive_avg_pool1d.default,
           _aten.adaptive_avg_pool2d.default, _aten._adaptive_avg_pool2d.default, _aten.adaptive_avg_pool3d.default,
           _aten._adaptive_avg_pool3d.default}
_MAX_FN = {F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d}
#: norms given as functions: (kind, index and name of the flag that says "statistics of the input")
_NORM_FN: dict[Any, tuple[str, int, str]] = {
    F.instance_norm: ("norm", 5, "use_input_stats"), F.group_norm: ("norm", -1, ""),
    F.batch_norm: ("batch", 5, "training"), _aten.group_norm.default: ("norm", -1, ""),
    _aten.instance_norm.default: ("norm", 5, "use_input_stats"), _aten.batch_norm.default: ("batch", 5, "training"),
}
_POINTWISE_BN = {_aten._native_batch_norm_legit_no_training.default}

STREAMED = ("instance/group norm statistics", "batch norm statistics", "global pooling")
"""The kinds predict streams exactly with statistics passes (where :func:`stream_kind` says so)."""


def _flag(node: fx.Node, index: int, name: str, default: bool) -> bool:
    value = node.kwargs.get(name, node.args[index] if len(node.args) > index else default)
    return bool(value) if isinstance(value, bool) else default


def why_whole(gm: fx.GraphModule, node: fx.Node, rule: SpatialRule, rank: int | None = None) -> str | None:
    """The kind of whole-image op ``node`` is (``instance/group norm statistics``, ``batch norm
    statistics``, ``global pooling``, ``attention`` or ``whole-image op``), or None (``rank``: the
    number of dims of its first input, where known)."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if isinstance(m, _STAT_NORMS):
            return None if getattr(m, "track_running_stats", False) else "instance/group norm statistics"
        if isinstance(m, _BATCH_NORMS):
            return None if m.track_running_stats else "batch norm statistics"
        if isinstance(m, nn.MultiheadAttention):
            return "attention"
        if isinstance(m, _AVG_POOLS + _MAX_POOLS):
            return "global pooling"
    if node.op == "call_function" and node.target in _NORM_FN:
        kind, index, name = _NORM_FN[node.target]
        if index >= 0 and not _flag(node, index, name, kind == "norm"):
            return None  # running statistics: a per-channel affine map
        return "instance/group norm statistics" if kind == "norm" else "batch norm statistics"
    if node.op == "call_function" and node.target in _POINTWISE_BN:
        return None
    if rule.kind == "pooled" or (node.op == "call_function" and node.target in _AVG_FN | _MAX_FN):
        return "global pooling"  # exact over tiles ([Note: whole values on tiles]); streamed over windows
    dims = mean_dims(node)
    if dims is not None and not rule.tileable:
        if rank is not None and all(d % rank == 1 for d in dims):
            return None  # a mean over the channels: per pixel
        return "global pooling"
    if rule.kind == "upsample" and _aligned(gm, node):  # maps pixels by the whole extent
        return "whole-image op"
    if not rule.tileable:
        low = rule.reason.lower()
        if "attention" in low or "softmax" in low or "matmul" in low or "bmm" in low:
            return "attention"
        if "pool" in low or "mean" in low or "sum" in low:
            return "global pooling"
        return "whole-image op"
    return None


def stream_kind(gm: fx.GraphModule, node: fx.Node, rank: int | None) -> str | None:
    """``"norm"`` or ``"pool"`` when predict gathers ``node``'s whole-image statistics in a
    statistics pass, else None (``rank``: its input's number of dims, where known)."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if isinstance(m, _STAT_NORMS + _BATCH_NORMS):
            return "norm"
        if isinstance(m, _AVG_POOLS + _MAX_POOLS):
            return "pool" if _int_sizes(m.output_size) and not getattr(m, "return_indices", False) else None
        return None
    if node.op == "call_function" and node.target in _NORM_FN:
        return "norm"
    if node.op == "call_function" and node.target in _AVG_FN | _MAX_FN:
        size = node.kwargs.get("output_size", node.args[1] if len(node.args) > 1 else None)
        indices = node.kwargs.get("return_indices", node.args[2] if len(node.args) > 2 else False)
        return "pool" if _int_sizes(size) and not indices else None
    dims = mean_dims(node)
    if dims is not None and rank is not None and rank > 2 and sorted(d % rank for d in dims) == list(range(2, rank)):
        return "pool"
    return None


def _int_sizes(size: Any) -> bool:
    return all(isinstance(s, int) for s in (size if isinstance(size, (tuple, list)) else (size,)))


def _aligned(gm: fx.GraphModule, node: fx.Node) -> bool:
    """An upsampling with align_corners=True, or to a fixed size that is no whole multiple (ATen)."""
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "align_corners", False))
    if node.target is F.interpolate:
        return bool(node.kwargs.get("align_corners", node.args[4] if len(node.args) > 4 else False))
    linear = "nearest" not in str(node.target)
    return (linear and len(node.args) > 2 and bool(node.args[2])) or aten_upsample_scales(node) is None


def _op_name(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__
    return getattr(node.target, "__name__", str(node.target))


def windowed_text(stat_pass: int) -> str:
    """What predict does with a whole-image op of statistics pass ``stat_pass`` (0: none) when
    the image streams in several windows."""
    if stat_pass:
        return f"exact: whole-image statistics gathered over the windows in statistics pass {stat_pass}"
    return "NOT exact: computed over each window (exact when one window covers the image)"


def whole_image_ops(gm: fx.GraphModule, shapes: Mapping[str, Sequence[int] | None], nd: int
                    ) -> list[dict[str, Any]]:
    """``[{"node", "op", "kind", "pass", "windowed"}]`` for each op of ``gm`` that reads an image
    derived from the input (``shapes``: each node's output shape, ``(N, C, *spatial)`` with ``nd``
    spatial dims) and whose result depends on the whole image. ``pass`` is the statistics pass
    that gathers its whole-image statistics when the image streams in windows ([Note: whole-image
    ops]), 0 for an op that is computed over each window instead."""
    return _classify(gm, shapes, nd)[0]


def _classify(gm: fx.GraphModule, shapes: Mapping[str, Sequence[int] | None], nd: int
              ) -> tuple[list[dict[str, Any]], set[str], set[str]]:
    """(:func:`whole_image_ops`, the image values derived from the input, those computed from
    streamed poolings only)."""
    rules = spatial_rules(gm)
    image: set[str] = set()
    depth: dict[str, int] = {}  # the deepest statistics pass a node's value waits for
    pooled: set[str] = set()  # values computed from streamed poolings only (no image pixels)
    out: list[dict[str, Any]] = []
    for node in gm.graph.nodes:
        shape = shapes.get(node.name)
        spatial = shape is not None and len(shape) == nd + 2
        if node.op == "placeholder":
            if spatial and not image:
                image.add(node.name)
            continue
        if node.op == "output":
            continue
        ins = [a for a in node.all_input_nodes if a.name in image]
        if not ins:
            continue
        d = max((depth.get(a.name, 0) for a in node.all_input_nodes), default=0)
        rule = rules.get(node.name, SpatialRule(tileable=True))
        in_shape = shapes.get(ins[0].name)
        rank = len(in_shape) if in_shape else None
        on_pooled = all(a.name in pooled for a in ins)  # a whole value: the same on every window
        kind = None if on_pooled else why_whole(gm, node, rule, rank)
        streamed = kind in STREAMED and stream_kind(gm, node, rank) is not None
        if on_pooled and rule.kind == "upsample" and in_shape is not None and any(int(s) > 1 for s in in_shape[2:]):
            kind = "whole-image op"  # a pooled grid brought back by the window's extent, not the image's
        if kind is not None:
            p = d + 1 if streamed else 0
            out.append({"node": node.name, "op": _op_name(gm, node), "kind": kind, "pass": p,
                        "windowed": windowed_text(p)})
            d = max(d, p)
        depth[node.name] = d
        if (streamed and kind == "global pooling") or on_pooled:
            pooled.add(node.name)
        if spatial:
            image.add(node.name)
    return out, image, pooled


def pass_prefixes(gm: fx.GraphModule, shapes: Mapping[str, Sequence[int] | None], nd: int
                  ) -> tuple[list[dict[str, Any]], dict[str, frozenset[int]]]:
    """(:func:`whole_image_ops`, the statistics passes that need each image value of ``gm``). A
    statistics pass runs only the prefix of the network its ops read: an image value (computed
    from the input's pixels, not from a pooled value) that no op of the pass reads, directly or
    through other nodes, is zeros there ([Note: statistics passes])."""
    ops, image, pooled = _classify(gm, shapes, nd)
    by_name = {n.name: n for n in gm.graph.nodes}
    needed: dict[str, set[int]] = {}
    for op in ops:
        k = int(op["pass"])
        if not k:
            continue
        stack, seen = [by_name[str(op["node"])]], {str(op["node"])}
        while stack:
            n = stack.pop()
            for a in n.all_input_nodes:
                if a.name not in seen:
                    seen.add(a.name)
                    stack.append(a)
        for name in seen:
            needed.setdefault(name, set()).add(k)
    return ops, {name: frozenset(needed.get(name, ())) for name in image - pooled
                 if by_name[name].op not in ("placeholder", "get_attr")}
