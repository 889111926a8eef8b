"""Whole values in a spatial stage: sizes read off the image, and branches of pooled features.

[Note: whole values on tiles] Not every value in a spatial stage is a tile. Two kinds of node give
a value that is the same on every tile of the group:

* *shape* nodes read a tensor's metadata (``x.shape[2:]``, ``x.size(-1)``, arithmetic on sizes:
  :func:`nowdl.trace.metadata.metadata_nodes`). On a tile they give the WHOLE image's sizes, which
  the tile grid knows, so ``F.interpolate(x, size=skip.shape[2:])`` (smp's UNet and FPN decoders)
  upsamples to the skip's whole size and the tile keeps its part.
* *pooled* nodes average every pixel of the image: adaptive average pooling (any output size) or
  a mean over all spatial dims. Each tile sums its pixels per output bin, the group all-reduces
  the sums (as norms reduce their statistics) and divides by the bins' sizes: every rank holds the
  same pooled tensor. The nodes computed from pooled values only (*whole* nodes: the 1x1 conv,
  BatchNorm and ReLU of an ASPP pooling branch, a squeeze-and-excitation MLP) run as they are on
  every rank. A pooled branch must come back to the image inside the stage: through an
  elementwise op with tiles (``x * gate``; the whole value broadcasts over the tile) or an
  upsampling (the ASPP branch's interpolate to the image size: each rank computes its tile of
  it). Each rank's backward gives the branch the gradient of its own tile only; the sum over the
  group is the whole image's, so the pooling's backward all-reduces it before spreading it over
  the pixels, and the branch's weight gradients are summed over the tiles with all the others.

A pooled branch that reaches the model's output, or meets a tile anywhere else (a conv, a
concatenation), is not a whole value: the pooling keeps its rule (it ends a spatial region).
The planner keeps each pooled branch in one stage (:func:`pooled_groups`): only tiles travel
between spatial stages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from nowdl.partitioner.spatial.rule import SpatialRule
from nowdl.trace.metadata import metadata_nodes

__all__ = ["whole_value_rules", "pooled_groups", "is_global_pool", "mean_dims"]

_ADAPTIVE_AVG = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
_ADAPTIVE_AVG_FN = {F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d}
_aten = torch.ops.aten
_ADAPTIVE_AVG_ATEN = {_aten.adaptive_avg_pool1d.default, _aten.adaptive_avg_pool2d.default,
                      _aten._adaptive_avg_pool2d.default, _aten.adaptive_avg_pool3d.default,
                      _aten._adaptive_avg_pool3d.default}
_MEANS = {torch.mean, _aten.mean.dim}
_UPSAMPLE_FN = {F.interpolate, _aten.upsample_nearest1d.vec, _aten.upsample_nearest2d.vec,
                _aten.upsample_nearest3d.vec, _aten.upsample_linear1d.vec, _aten.upsample_bilinear2d.vec,
                _aten.upsample_trilinear3d.vec}


def _rank(node: object, ranks: Mapping[str, int] | None) -> int | None:
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dim()
    return (ranks or {}).get(node.name)


def mean_dims(node: fx.Node) -> list[int] | None:
    """The dims a mean node (``torch.mean``, ``x.mean``, ``aten.mean.dim``) reduces, as written."""
    is_mean = (node.op == "call_function" and node.target in _MEANS) or (
        node.op == "call_method" and node.target == "mean")
    if not is_mean:
        return None
    dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if isinstance(dims, int):
        return [dims]
    if isinstance(dims, (list, tuple)) and dims and all(isinstance(d, int) for d in dims):
        return list(dims)
    return None


def is_global_pool(gm: fx.GraphModule, node: fx.Node, ranks: Mapping[str, int] | None = None) -> bool:
    """Whether ``node`` averages over every spatial dim of its input: adaptive average pooling
    (module, function or ATen op, any output size) or a mean over the spatial dims (all of them
    where the input's rank is known; otherwise over dims that leave the batch and channels)."""
    size: Any = None
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if not isinstance(m, _ADAPTIVE_AVG):
            return False
        size = m.output_size
    elif node.op == "call_function" and (node.target in _ADAPTIVE_AVG_FN or node.target in _ADAPTIVE_AVG_ATEN):
        size = node.kwargs.get("output_size", node.args[1] if len(node.args) > 1 else None)
    if size is not None:  # a size of None along a dim keeps that dim: not every spatial dim is pooled
        return all(isinstance(s, int) for s in (size if isinstance(size, (tuple, list)) else (size,)))
    dims = mean_dims(node)
    if dims is None:
        return False
    rank = _rank(node.args[0], ranks)
    if rank is None:
        return all(d >= 2 or d < 0 for d in dims)
    return rank > 2 and sorted(d % rank for d in dims) == list(range(2, rank))


def _is_upsample(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), nn.Upsample)
    return node.op == "call_function" and node.target in _UPSAMPLE_FN


def _branches(gm: fx.GraphModule, pools: set[str], rules: Mapping[str, SpatialRule],
              meta: set[str]) -> tuple[dict[str, set[str]], dict[str, set[str]], set[str]]:
    """Per pool: the whole nodes computed from it and the nodes where it meets the image; and the
    pools whose branch fails (reaches the output or meets a tile elsewhere)."""
    nodes = list(gm.graph.nodes)
    whole: dict[str, set[str]] = {}  # whole node -> the pools it derives from
    joins: dict[str, set[str]] = {}
    failed: set[str] = set()
    for n in nodes:
        if n.name in pools:
            whole[n.name] = {n.name}
            continue
        from_pools = set().union(*(whole[a.name] for a in n.all_input_nodes if a.name in whole))
        if not from_pools:
            continue
        if n.op == "output":
            failed |= from_pools
            continue
        tiles = [a for a in n.all_input_nodes if a.name not in whole and a.name not in meta and a.op != "get_attr"]
        if not tiles and _is_upsample(gm, n) and rules[n.name].tileable:
            joins[n.name] = from_pools  # up to the image's size: a tile from here on
        elif not tiles:
            whole[n.name] = from_pools
        elif rules[n.name].kind == "elementwise" and all(rules[a.name].tileable for a in [n, *tiles]):
            joins[n.name] = from_pools  # the whole value broadcasts over the tile
        else:
            failed |= from_pools
    return ({p: {w for w, src in whole.items() if p in src and w != p} for p in pools},
            {p: {j for j, src in joins.items() if p in src} for p in pools}, failed)


def _accepted(gm: fx.GraphModule, rules: Mapping[str, SpatialRule], ranks: Mapping[str, int] | None
              ) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """The pools whose branches come back to the image, with their whole nodes and joins."""
    meta = metadata_nodes(gm)
    pools = {n.name for n in gm.graph.nodes if is_global_pool(gm, n, ranks)}
    while True:
        whole, joins, failed = _branches(gm, pools, rules, meta)
        if not failed:
            return whole, joins
        pools -= failed  # a failed branch's nodes are no longer whole: recheck the rest


def whole_value_rules(gm: fx.GraphModule, rules: Mapping[str, SpatialRule],
                      ranks: Mapping[str, int] | None = None) -> dict[str, SpatialRule]:
    """The rules of the shape, pooled and whole nodes of ``gm`` ([Note: whole values on tiles]),
    to override ``rules`` (the nodes' own rules) with."""
    out = {name: SpatialRule(True, "", (), "shape") for name in metadata_nodes(gm)}
    whole, _ = _accepted(gm, rules, ranks)
    for pool, branch in whole.items():
        out[pool] = SpatialRule(True, "", (), "pooled")
        out.update({w: SpatialRule(True, "", (), "whole") for w in branch if w not in out})
    return out


def pooled_groups(gm: fx.GraphModule, rules: Mapping[str, SpatialRule],
                  ranks: Mapping[str, int] | None = None) -> tuple[tuple[str, ...], ...]:
    """Each accepted pooled branch (the pool, its whole nodes and its joins): nodes that must
    share a stage."""
    whole, joins = _accepted(gm, rules, ranks)
    return tuple(tuple([p, *sorted(whole[p]), *sorted(joins[p])]) for p in sorted(whole))
