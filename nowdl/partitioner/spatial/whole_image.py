"""Ops whose result depends on the whole image, and what predict does with them.

[Note: whole-image ops] Most of a segmentation network computes each output pixel from a bounded
neighbourhood of input pixels, so a window read with enough margin computes its centre exactly.
Some ops do not: InstanceNorm and GroupNorm without running statistics (and BatchNorm in training
mode) normalise with statistics over the whole image, global (adaptive) pooling and attention read
every pixel. On one window that covers the image (the default for images up to 2048² or 128³)
nowdl's spatial tiles still compute them exactly: the tiles reduce the statistics together. When
an image streams in several windows, predict takes the statistics (or pools, or attends) over each
window instead, and says so in its summary line. An inference plan lists these ops in
``config.whole_image_ops`` (docs/plan-format.md); ``nowdl show`` prints them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from nowdl.partitioner.spatial.tileable import SpatialRule, aten_upsample_scales, spatial_rules

__all__ = ["why_whole", "whole_image_ops", "WINDOWED"]

_STAT_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.GroupNorm)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_GLOBAL_POOLS = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
                 nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)

#: What predict does with each kind of whole-image op when the image streams in several windows.
WINDOWED = {
    "instance/group norm statistics": "statistics over each window (exact when one window covers the image)",
    "batch norm statistics": "statistics over each window (exact when one window covers the image)",
    "global pooling": "pools over each window (exact when one window covers the image)",
    "attention": "attends within each window (exact when one window covers the image)",
    "whole-image op": "runs on each window (exact when one window covers the image)",
}


def why_whole(gm: fx.GraphModule, node: fx.Node, rule: SpatialRule) -> str | None:
    """The kind of whole-image op ``node`` is (a key of :data:`WINDOWED`), or None."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if isinstance(m, _STAT_NORMS) and not getattr(m, "track_running_stats", False):
            return "instance/group norm statistics"
        if isinstance(m, _BATCH_NORMS) and not m.track_running_stats:
            return "batch norm statistics"
        if isinstance(m, nn.MultiheadAttention):
            return "attention"
        if isinstance(m, _GLOBAL_POOLS):
            return "global pooling"
    if rule.kind == "pooled":  # exact over tiles, not over windows: [Note: whole values on tiles]
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


def whole_image_ops(gm: fx.GraphModule, shapes: Mapping[str, Sequence[int] | None], nd: int
                    ) -> list[dict[str, Any]]:
    """``[{"node", "op", "kind", "windowed"}]`` for each op of ``gm`` that reads an image derived from
    the input (``shapes``: each node's output shape, ``(N, C, *spatial)`` with ``nd`` spatial dims)
    and whose result depends on the whole image; ``windowed`` says what predict does when the image
    streams in several windows."""
    rules = spatial_rules(gm)
    image: set[str] = set()
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
        rule = rules.get(node.name, SpatialRule(tileable=True))
        kind = why_whole(gm, node, rule)
        if kind is not None:
            out.append({"node": node.name, "op": _op_name(gm, node), "kind": kind, "windowed": WINDOWED[kind]})
        if spatial:
            image.add(node.name)
    return out
