"""How far a stage's outputs reach into its inputs: the margin and alignment sequential tiles need.

[Note: stage reach] :mod:`nowdl.runtime.spatial.sequential` runs a whole stage on a window of its
inputs and keeps only the outputs far enough from the window's cut edges. This module walks the
stage's fx graph once and gives, per spatial dim, in pixels of the *reference* resolution (the
finest stage input):

* ``scale[node]``: reference pixels per pixel of the node (a stride-2 conv doubles it, a
  scale-2 upsample or stride-2 transposed conv halves it); node pixel ``j`` covers reference
  ``[j * scale, (j + 1) * scale)``;
* ``reach[node]``: how many reference pixels beyond its own footprint a node pixel may depend
  on, on either side: summed along the worst path, each windowed op adds, in its input's scale,
  the larger of the inputs it reads before and after its footprint (a conv or pool with extent
  ``e = d * (k - 1) + 1``, stride ``s`` and padding ``lo`` before: ``max(lo, e - lo - s)``; a
  transposed conv the exact fraction of an input pixel its outputs read beyond their own
  footprint (``partitioner.spatial.tileable.convt_reach``; 1/2 for kernel = stride = 2); an upsample 2);
* ``align``: the least common multiple of every node's scale numerator: a window starting at a
  multiple of it starts on a whole pixel of every node, so strided ops see the same phase as
  on the whole image.

A window whose cut edges lie at least ``reach`` from the kept outputs computes those outputs
from the same input values as the whole image (its zero padding at a cut edge only spoils
pixels within ``reach`` of that edge); where the window reaches the image border, the padding
is the image's own. Norms whose statistics span the image (BatchNorm, InstanceNorm, GroupNorm
modules) run with statistics passes ([Note: sequential norms] in
:mod:`nowdl.runtime.spatial.statistics.seq_norms`); other ops whose result depends on the whole extent are
refused here with the node named: a norm module of another type (a subclass with its own
forward), global pooling, alpha dropout (other dropout is keyed by image coordinates:
:mod:`nowdl.runtime.spatial.dropout`), upsampling to a fixed size, by a non-integer factor
or with ``align_corners=True``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from nowdl.errors import NowdlError
from nowdl.geometry import conv_pads, ntuple
from nowdl.partitioner.spatial.tileable import UPSAMPLE_REACH, aten_upsample_scales, convt_reach
from nowdl.partitioner.spatial.whole_values import is_global_pool
from nowdl.runtime.spatial.dropout import keyed_spec
from nowdl.runtime.spatial.graph_ops import ATEN_UP, INTERP_ARGS, POOL_ARGS, POOL_FN, bind
from nowdl.trace.exported import ModeAware

__all__ = ["Reach", "stage_reach", "node_reach", "refuse_sequential", "SEQ_NORMS"]

_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.GroupNorm)
#: the norm modules sequential tiles normalise with the whole image's statistics (exact types)
SEQ_NORMS: tuple[type, ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d,
                               nn.InstanceNorm2d, nn.InstanceNorm3d, nn.GroupNorm)
_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)
_F_DROPOUTS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout)
_ATEN_ALPHA = (torch.ops.aten.alpha_dropout.default, torch.ops.aten.feature_alpha_dropout.default)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONVTS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)

Scale = tuple[Fraction, ...]


@dataclass(frozen=True)
class Reach:
    """Per spatial dim: each output's scale, the stage's reach and alignment (reference pixels)."""

    out_scale: tuple[Scale, ...]  # per stage output
    reach: tuple[int, ...]
    align: tuple[int, ...]


def _why_not(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """Why ``node`` cannot run in sequential tiles (None: it can)."""
    if is_global_pool(gm, node):
        return ("it averages over the whole image, which sequential tiles would need from every tile before any "
                "tile goes on (no pooling pass is implemented)")
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if isinstance(m, _NORMS) and type(m) not in SEQ_NORMS:
            return (f"{type(m).__name__} is a norm module nowdl cannot combine over tiles exactly (its own forward, "
                    f"not {type(m).__mro__[1].__name__}'s); use {type(m).__mro__[1].__name__} itself")
        if isinstance(m, _DROPOUTS) and m.p > 0 and keyed_spec(gm, node) is None:
            return (f"{type(m).__name__}(p={m.p}) would draw new random numbers in each tile's recomputation "
                    "(only Dropout and Dropout1d/2d/3d are keyed by image coordinates)")
        if isinstance(m, ModeAware) and m.op in _ATEN_ALPHA:
            return f"{m.op} would draw new random numbers in each tile's recomputation"
        if isinstance(m, nn.Upsample):
            return _upsample_why(m.size, m.scale_factor, m.align_corners)
    if node.op == "call_function":
        if node.target in _F_DROPOUTS and keyed_spec(gm, node) is None:
            return f"{getattr(node.target, '__name__', node.target)} would draw new random numbers in each recomputation"
        if node.target is F.interpolate:
            o = bind(node.args[1:], dict(node.kwargs), INTERP_ARGS)
            return _upsample_why(o.get("size"), o.get("scale_factor"), o.get("align_corners"))
        if node.target in ATEN_UP:  # to the traced size: whole-pixel alignment only for integer scales
            linear = ATEN_UP[node.target] != "nearest"
            return _upsample_why(None, aten_upsample_scales(node), linear and len(node.args) > 2 and node.args[2])
    return None


def _upsample_why(size: Any, scale: Any, align: Any) -> str | None:
    if size is not None or scale is None:
        return "upsampling to a fixed size depends on the whole extent"
    scales = scale if isinstance(scale, (tuple, list)) else [scale]
    if any(not float(f).is_integer() for f in scales):
        return f"upsampling by a non-integer factor {scale} has no whole-pixel alignment"
    if align:
        return "upsampling with align_corners=True maps pixels by the whole extent"
    return None


def refuse_sequential(gm: fx.GraphModule, stage: int, tiles_per_gpu: int) -> None:
    """Raise NowdlError naming the first node that sequential tiles cannot run (else nothing)."""
    for node in gm.graph.nodes:
        why = _why_not(gm, node)
        if why is not None:
            raise NowdlError(
                f"stage {stage} cannot run {tiles_per_gpu} sequential tiles per GPU: node {node.name!r}: {why}. "
                "Use tiles_per_gpu=1 for this stage (more GPUs or spatial parts instead), or end the spatial "
                "stage before that node")


def _node_step(gm: fx.GraphModule, node: fx.Node, n: int) -> tuple[list[Fraction], list[Fraction]]:
    """(scale factor, reach added in input pixels) per dim of one node (factor > 1: coarser)."""
    one, none = [Fraction(1)] * n, [Fraction(0)] * n
    m: Any = None
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
    elif node.op == "call_function" and node.target in POOL_FN:
        kind = "max" if "max" in getattr(node.target, "__name__", "") else "avg"
        m = POOL_FN[node.target](**bind(node.args[1:], dict(node.kwargs), POOL_ARGS[kind]))
    elif node.op == "call_function" and node.target is F.interpolate:
        m = nn.Upsample(**{k: v for k, v in bind(node.args[1:], dict(node.kwargs), INTERP_ARGS).items()
                           if k != "antialias"})
    elif node.op == "call_function" and node.target in ATEN_UP:
        sc = aten_upsample_scales(node) or (1.0,)
        sc = tuple(sc) * n if len(sc) == 1 else tuple(sc)
        return [Fraction(1) / Fraction(int(f)) for f in sc], [Fraction(UPSAMPLE_REACH[0])] * n
    if isinstance(m, (*_CONVS, *_POOLS)):
        k = ntuple(m.kernel_size, n)
        s = ntuple(m.stride if m.stride not in (None, (), []) else m.kernel_size, n)
        d = ntuple(getattr(m, "dilation", 1), n)
        lo = [a for a, _ in conv_pads(m, n, k, d)] if isinstance(m, _CONVS) else list(ntuple(m.padding, n))
        # output j reads inputs [j*s - lo, j*s - lo + e): beyond its footprint [j*s, j*s + s) by lo
        # before and e - lo - s after
        return [Fraction(v) for v in s], [Fraction(max(lo[i], d[i] * (k[i] - 1) + 1 - lo[i] - s[i], 0))
                                          for i in range(n)]
    if isinstance(m, _CONVTS):
        # output o reads inputs ceil((o + p - d(k-1)) / s) .. floor((o + p) / s)
        k, s, d, p = (ntuple(v, n) for v in (m.kernel_size, m.stride, m.dilation, m.padding))
        return [Fraction(1, v) for v in s], [convt_reach(k[i], s[i], d[i], p[i]) for i in range(n)]
    if isinstance(m, nn.Upsample):
        sf = m.scale_factor if isinstance(m.scale_factor, (tuple, list)) else [m.scale_factor] * n
        return [Fraction(1) / Fraction(int(float(f or 1))) for f in sf], [Fraction(UPSAMPLE_REACH[0])] * n
    return one, none


def stage_reach(gm: fx.GraphModule, in_scales: Sequence[Scale]) -> Reach:
    """The :class:`Reach` of a stage whose inputs (placeholders, in order) have ``in_scales``."""
    n = len(in_scales[0])
    scale, reach, outs = node_reach(gm, in_scales)
    missing = [o for o in outs if o not in scale]
    if missing:
        raise NowdlError(f"stage outputs {missing} do not derive from the stage's image inputs: sequential tiles "
                         "cannot place them; use tiles_per_gpu=1 for this stage")
    align = [1] * n
    for sc in scale.values():
        for i in range(n):
            align[i] = math.lcm(align[i], sc[i].numerator)
    r = tuple(math.ceil(max(reach[o][i] for o in outs)) for i in range(n))
    return Reach(tuple(scale[o] for o in outs), r, tuple(align))


def node_reach(gm: fx.GraphModule, in_scales: Sequence[Scale]
               ) -> tuple[dict[str, Scale], dict[str, tuple[Fraction, ...]], list[str]]:
    """Per node on the image: its ``scale`` and ``reach`` ([Note: stage reach]); and the stage's outputs."""
    n = len(in_scales[0])
    scale: dict[str, Scale] = {}
    reach: dict[str, tuple[Fraction, ...]] = {}
    phs = [nd for nd in gm.graph.nodes if nd.op == "placeholder"]
    for ph, sc in zip(phs, in_scales, strict=True):
        scale[ph.name], reach[ph.name] = tuple(sc), (Fraction(0),) * n
    outs: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "output":
            args = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
            outs = [a.name for a in args]
            continue
        ins = [a.name for a in node.all_input_nodes if a.name in scale]
        if node.op in ("placeholder", "get_attr") or not ins:
            continue
        f_in, r_in = scale[ins[0]], tuple(max(reach[a][i] for a in ins) for i in range(n))
        factor, add = _node_step(gm, node, n)
        scale[node.name] = tuple(f_in[i] * factor[i] for i in range(n))
        reach[node.name] = tuple(r_in[i] + add[i] * f_in[i] for i in range(n))
    return scale, reach, outs
