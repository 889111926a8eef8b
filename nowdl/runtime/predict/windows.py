"""Streaming windows over an image larger than the job: the network's reach and the window layout.

[Note: predict windows] A network's output pixel depends on the input pixels within its
receptive field. :func:`network_reach` walks the traced graph and adds up, per spatial dim, the
halo every conv, pool and upsample reads (``nowdl.partitioner.spatial.tileable``), scaled to
input pixels by the resolution the op runs at: the ``margin``. A window read with ``margin``
pixels of context on every side that is not the image border computes its centre (the ``core``)
exactly as the whole-image forward does. Window starts are multiples of the network's total
stride (``align``), so its pooling grid lines up with the whole image's.

Ops whose result depends on the whole image cannot be made exact by a margin: InstanceNorm and
GroupNorm (and BatchNorm without running statistics) use statistics over the image, global
pooling and attention read every pixel. :func:`network_reach` names them (``whole``; the same
list an inference plan records, [Note: whole-image ops]) with the statistics pass that gathers
their whole-image statistics when the image streams in several windows ([Note: statistics
passes] in ``passes``); the others predict computes over each window, and names in its summary
line. A pooled value is the same for every window once gathered: it adds no margin. With one
window covering the whole image nothing changes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from nowdl.errors import NowdlError
from nowdl.partitioner.spatial.tileable import spatial_rules
from nowdl.partitioner.spatial.whole_image import pass_prefixes
from nowdl.profiler.cache import atomic_write_text, cache_key, graph_digest, resolve_cache_dir
from nowdl.runtime.spatial.statistics.accumulate import StatOp, stat_op

__all__ = ["Reach", "Window", "network_reach", "cached_reach", "layout_windows"]

#: bump when :func:`network_reach` changes what it returns, so reaches cached by an older nowdl are not read
REACH_FORMAT = 2

@dataclass(frozen=True)
class Reach:
    """How far a network's output pixel reaches into its input.

    Attributes:
        margin: input pixels per side, per spatial dim, that a window needs around its core.
        align: window starts must be multiples of this, per spatial dim (the total stride).
        scale: input pixels per output pixel, per spatial dim (1 for a same-size segmentation).
        whole: ``(node, op, kind, statistics pass)`` for each op whose result depends on the whole
            image; pass 0: computed over each window when the image streams in several.
        out_channels: channels of the output (classes of a segmentation).
        stat_ops: what the statistics passes gather, one per op of a pass > 0.
        prefix: ``(node, passes that need it, its output shape)`` for each image value some
            statistics pass does not need (it is zeros there).
    """

    margin: tuple[int, ...]
    align: tuple[int, ...]
    scale: tuple[int, ...]
    whole: tuple[tuple[str, str, str, int], ...] = ()
    out_channels: int = 1
    stat_ops: tuple[StatOp, ...] = ()
    prefix: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()

    @property
    def passes(self) -> int:
        """Statistics passes a streamed image needs before the writing pass."""
        return max((p for *_, p in self.whole), default=0)

    def whole_text(self, exact: bool = False, also: Sequence[str] = ()) -> str:
        """The ops computed over each window, by kind and with their nodes: ``"whole-image op (1:
        up)"``; ``exact``: those gathered in statistics passes instead, counted by kind:
        ``"instance/group norm statistics (6)"``. ``also``: ops of a pass > 0 that are computed
        over each window all the same."""
        counts: dict[str, list[str]] = {}
        for node, _, kind, p in self.whole:
            if (p > 0 and node not in also) == exact:
                counts.setdefault(kind, []).append(node)
        if exact:
            return ", ".join(f"{kind} ({len(ns)})" for kind, ns in counts.items())
        return ", ".join(f"{kind} ({len(ns)}: {', '.join(ns[:3])}{', ...' if len(ns) > 3 else ''})"
                         for kind, ns in counts.items())


def _shapes(gm: fx.GraphModule, example: torch.Tensor) -> None:
    """Put ``tensor_meta`` on every node (fake tensors: nothing is computed or allocated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.shape_prop import ShapeProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = mode.from_tensor(torch.empty(tuple(example.shape), dtype=example.dtype))
    ShapeProp(gm, fake_mode=mode).propagate(fake)


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    shape = getattr(node.meta.get("tensor_meta"), "shape", None)
    return tuple(int(s) for s in shape) if shape is not None else None


def cached_reach(gm: fx.GraphModule, example: torch.Tensor, cache: Any) -> Reach:
    """:func:`network_reach`, kept in the profile cache folder (``cache`` as ``nowdl.compile`` takes
    it) by graph and input shape. A second prediction of the model at this window shape skips the
    shape propagation, whose fake tensors import torch._dynamo: seconds of a short prediction's start."""
    folder = resolve_cache_dir(cache)
    path = None
    if folder is not None:
        key = cache_key({"kind": "reach", "reach_format": REACH_FORMAT, "graph": graph_digest(gm),
                         "input": list(example.shape), "dtype": str(example.dtype)})
        path = folder / f"reach-{key}.json"
        try:
            return _reach_from(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: compute it
            pass
    reach = network_reach(gm, example)
    if path is not None:
        try:
            atomic_write_text(path, json.dumps(dataclasses.asdict(reach)))
        except OSError:  # a read-only cache folder: the next run computes it again
            pass
    return reach


def _reach_from(d: dict[str, Any]) -> Reach:
    """A :class:`Reach` back from its JSON (``dataclasses.asdict``)."""
    return Reach(tuple(d["margin"]), tuple(d["align"]), tuple(d["scale"]),
                 tuple((str(n), str(o), str(k), int(p)) for n, o, k, p in d["whole"]), int(d["out_channels"]),
                 tuple(StatOp(str(o["node"]), int(o["stat_pass"]), str(o["reduce"]), tuple(o["shape"]),
                              tuple(o["spatial"]), bool(o["keep"])) for o in d["stat_ops"]),
                 tuple((str(n), tuple(p), tuple(sh)) for n, p, sh in d["prefix"]))


_STACKS = (torch.stack, torch.ops.aten.stack.default)


def _spatial(node: object, nd: int) -> tuple[int, ...] | None:
    """The spatial sizes of ``node``'s (N, C, *spatial) value; a stack of such images along dim 0
    or 1 (FPN's merge: (N, K, C, *spatial)) keeps its last ``nd`` dims as the spatial ones."""
    tm = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    shape = getattr(tm, "shape", None)
    if shape is None:
        return None
    if len(shape) == nd + 3 and isinstance(node, fx.Node) and node.target in _STACKS:
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        if isinstance(dim, int) and dim in (0, 1, -nd - 3, -nd - 2):
            return tuple(int(s) for s in shape[-nd:])
    if len(shape) != nd + 2:
        return None
    return tuple(int(s) for s in shape[2:])


def network_reach(gm: fx.GraphModule, example: torch.Tensor) -> Reach:
    """The margin, alignment and output scale of ``gm`` for inputs shaped like ``example``
    ``(N, C, *spatial)``, and the ops that depend on the whole image.

    Raises:
        NowdlError: the graph's output is not an ``(N, C, *spatial)`` image of the input's dims.
    """
    nd = example.dim() - 2
    _shapes(gm, example)
    rules = spatial_rules(gm)
    shapes = {n.name: _shape(n) for n in gm.graph.nodes}
    ops, needed = pass_prefixes(gm, shapes, nd)
    by_name = {n.name: n for n in gm.graph.nodes}
    pooled = {o["node"] for o in ops if o["kind"] == "global pooling"}  # whole values: no margin
    size_in = tuple(int(s) for s in example.shape[2:])
    margin: dict[str, list[float]] = {}
    scale: dict[str, list[float]] = {}
    align = [1] * nd
    out_node: fx.Node | None = None
    for node in gm.graph.nodes:
        sp = _spatial(node, nd)
        if node.op == "placeholder":
            if sp is not None and not margin:
                margin[node.name], scale[node.name] = [0.0] * nd, [1.0] * nd
            continue
        if node.op == "output":
            out_node = node
            continue
        ins = [a for a in node.all_input_nodes if a.name in margin]
        rule = rules[node.name]
        if sp is None or not ins or node.name in pooled:
            continue
        m_in = [max(margin[a.name][d] for a in ins) for d in range(nd)]
        s_in = [max(scale[a.name][d] for a in ins) for d in range(nd)]
        halo = list(rule.halo) + [rule.halo[-1]] * (nd - len(rule.halo)) if rule.halo else [0] * nd
        s_out = [size_in[d] / sp[d] if sp[d] else s_in[d] for d in range(nd)]
        m_out = []
        for d in range(nd):
            m = m_in[d] + halo[d] * s_in[d]
            if s_out[d] > 1:  # a pixel at this resolution covers s_out input pixels (windows start aligned)
                m = math.ceil(m / s_out[d]) * s_out[d]
            m_out.append(m)
            if s_out[d] >= 1:
                align[d] = math.lcm(align[d], int(round(s_out[d])))
        margin[node.name], scale[node.name] = m_out, s_out
    outs = [a for a in (out_node.all_input_nodes if out_node is not None else []) if a.name in margin]
    if not outs:
        raise NowdlError("the model's output is not an (N, C, *spatial) image with the input's spatial dims: predict "
                         "writes dense outputs (segmentation logits); classify whole images with eval_step instead")
    out = outs[0]
    sc = tuple(max(1, int(round(s))) for s in scale[out.name])
    marg = tuple(math.ceil(max(margin[a.name][d] for a in outs) / align[d]) * align[d] for d in range(nd))
    shape = out.meta["tensor_meta"].shape
    stat = []
    for o in ops:
        if o["pass"]:
            first = by_name[o["node"]].all_input_nodes[0]
            stat.append(stat_op(gm, by_name[o["node"]], o["pass"], shapes[first.name] or ()))
    passes = max((o["pass"] for o in ops), default=0)
    prefix = tuple((name, tuple(sorted(ks)), shapes[name] or ()) for name, ks in needed.items() if len(ks) < passes)
    return Reach(margin=marg, align=tuple(align), scale=sc, out_channels=int(shape[1]), stat_ops=tuple(stat),
                 prefix=prefix, whole=tuple((o["node"], o["op"], o["kind"], o["pass"]) for o in ops))


@dataclass(frozen=True)
class Window:
    """One window: the input region read and the output region it writes exactly (input pixels)."""

    read: tuple[tuple[int, int], ...]
    core: tuple[tuple[int, int], ...]


def _dim_windows(size: int, window: int, margin: int, grain: int, what: str) -> list[tuple[int, int, int, int]]:
    """(read lo, read hi, core lo, core hi) along one dim."""
    if size <= window:
        return [(0, size, 0, size)]
    step = (window - 2 * margin) // grain * grain
    if step <= 0:
        raise NowdlError(f"a window of {window} pixels along {what} leaves no exact centre: the network reads "
                         f"{margin} pixels of context on each side (its receptive field), and the centre is cut in "
                         f"steps of {grain}: use a window of at least {2 * margin + grain} pixels")
    out: list[tuple[int, int, int, int]] = []
    lo, start = 0, 0
    while True:
        hi = size if start + window >= size else (start + window - margin) // grain * grain
        out.append((start, start + window, lo, hi))
        if hi >= size:
            return out
        lo = hi
        start = min(hi - margin, size - window)


def layout_windows(shape: Sequence[int], window: Sequence[int], reach: Reach,
                   grain: Sequence[int] | None = None) -> list[Window]:
    """Windows of ``window`` pixels (clipped to ``shape``) whose cores tile ``shape`` once.

    Each core lies ``reach.margin`` inside its window wherever the window does not touch the image
    border, and core borders are multiples of ``grain`` (default ``reach.align``; a multiple of the
    output's chunk size lets ranks write whole chunks). Every window has the same shape.

    Raises:
        NowdlError: a size that is not a multiple of the network's stride while windows are needed,
            or a window too small for the receptive field.
    """
    nd = len(shape)
    g = tuple(grain) if grain is not None else reach.align
    per_dim: list[list[tuple[int, int, int, int]]] = []
    for d in range(nd):
        size, win = int(shape[d]), min(int(window[d]), int(shape[d]))
        what = f"spatial dim {d}"
        if size > win:
            a = reach.align[d]
            if size % a or win % a:
                raise NowdlError(f"the image is {size} pixels along {what} and the window {win}: with more than one "
                                 f"window both must be multiples of {a}, the network's total stride, so the windows' "
                                 f"pooling grid lines up with the whole image's: crop or pad the image to a multiple "
                                 f"of {a}, or use a window of {math.ceil(size / a) * a} pixels (the whole image)")
            if g[d] % a:
                raise NowdlError(f"the window grain {g[d]} along {what} is not a multiple of the network's stride {a}")
        per_dim.append(_dim_windows(size, win, reach.margin[d], g[d], what))
    out: list[Window] = []

    def rec(d: int, read: tuple[tuple[int, int], ...], core: tuple[tuple[int, int], ...]) -> None:
        if d == nd:
            out.append(Window(read, core))
            return
        for r0, r1, c0, c1 in per_dim[d]:
            rec(d + 1, read + ((r0, r1),), core + ((c0, c1),))

    rec(0, (), ())
    return out
