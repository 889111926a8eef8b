"""Coordinate-keyed dropout: a mask that every tile, margin and recomputation draws alike.

[Note: keyed dropout] On sequential tiles ([Note: sequential tiles] in
:mod:`nowdl.runtime.spatial.sequential`) a stage runs several times per micro-batch (statistics
passes, the forward, the recomputation in backward) on overlapping windows; torch's dropout
would draw a new mask each time, and on plain tiles each rank would draw its own. A spatial
stage (:class:`nowdl.runtime.spatial.stage.TiledStage`, sequential or not) therefore runs its
Dropout/Dropout1d/2d/3d modules, ``F.dropout*`` calls and exported ATen dropouts as *keyed*
dropout, which draws no mask: whether element
``(n, c, i_1 .. i_k)`` is kept is a pure function of

* a 62-bit seed drawn once per micro-batch and dropout node (:func:`draw_seed`, one
  ``torch.randint`` from the CPU generator, the nodes in graph order; on several ranks the tile
  group's first rank's seeds are broadcast, so ranks seeded alike or not agree),
* the sample index ``n`` in the micro-batch, the channel ``c``,
* and the pixel's coordinates ``i_d`` on the WHOLE image at the node's resolution (a window's
  origin is added to its local coordinates),

hashed in int64 (a 32-bit integer hash whose products stay below 2**63) and compared with ``p * 2**32``: kept with probability ``1 - p``, scaled by
``1 / (1 - p)``. Dropout1d/2d/3d (whole channels) key on ``(n, c)`` only. Any sub-tile, margin,
recomputation or neighbouring GPU therefore computes the same mask for the same pixel, and the
whole image run with the same keyed dropout and the same seeds is the same function. A stage the
pipeline recomputes draws its seeds again from the replayed generator: the same seeds
([Note: recompute exactness] in :mod:`nowdl.runtime.pipeline.recompute`). The mask is only int64
arithmetic, so any device gives the same bits.

The reference: one process running the same micro-batches with :class:`KeyedDropout` in place of
torch's dropout modules (:func:`keyed_dropout`), its CPU generator in the state the ranks' are in.
Each :class:`KeyedDropout` call in training draws its seed as the stage does. The masks have
torch's distribution (independent Bernoulli(1 - p) per element or channel) but are other numbers
than ``torch.nn.functional.dropout`` draws from the same seed.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from nowdl.errors import NowdlError
from nowdl.trace.exported import ModeAware

__all__ = ["KeyedDropout", "KeyedNode", "keyed_dropout", "keyed_mask", "draw_seed", "keyed_graph", "keyed_run",
           "draw_seeds", "keyed_spec", "keyed_nodes", "KEYED_MODULES"]

_M1, _M2, _LOW = 0x7FEB352D, 0x5BD1E995, 0xFFFFFFFF  # odd multipliers < 2**31: h * m < 2**63 for h < 2**32
_CHUNK = 1 << 20  # elements hashed at a time (a few int64 temporaries of this size)
#: dropout modules keyed dropout replaces (exact types: AlphaDropout keeps its own refusal)
KEYED_MODULES: dict[type, bool] = {nn.Dropout: False, nn.Dropout1d: True, nn.Dropout2d: True, nn.Dropout3d: True}
_KEYED_FNS: dict[Any, bool] = {F.dropout: False, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True}
_aten = torch.ops.aten
_KEYED_ATEN: dict[Any, bool] = {_aten.dropout.default: False, _aten.feature_dropout.default: True}


def _mix(h: Tensor) -> Tensor:
    """A 32-bit integer hash of ``h`` (int64 in [0, 2**32))."""
    h = h ^ (h >> 16)
    h = (h * _M1) & _LOW
    h = h ^ (h >> 15)
    h = (h * _M2) & _LOW
    return h ^ (h >> 16)


def draw_seed() -> int:
    """One dropout seed from the CPU generator (what every keyed dropout call in training draws)."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64))


def _coords(start: int, size: int, d: int, nd: int, device: torch.device | str) -> Tensor:
    view = [1] * nd
    view[d] = size
    return (torch.arange(start, start + size, dtype=torch.int64, device=device) & _LOW).view(view)


def keyed_mask(shape: Sequence[int], p: float, seed: int, origin: Sequence[int] = (), channels: bool = False,
               device: torch.device | str = "cpu") -> Tensor:
    """The keep mask (bool) of an ``(N, C, *spatial)`` tensor whose spatial dims start at ``origin``
    on the whole image ([Note: keyed dropout]); ``channels``: one value per ``(n, c)``. The hash
    runs in chunks of the first spatial dim of at most ``_CHUNK`` elements (its int64 temporaries)."""
    shape, nd = tuple(int(v) for v in shape), len(shape)
    origin = tuple(origin) or (0,) * max(nd - 2, 0)
    if len(origin) != max(nd - 2, 0):
        raise NowdlError(f"keyed dropout: origin {tuple(origin)} has {len(origin)} dims for a tensor of shape "
                         f"{shape} ({nd - 2} spatial dims); give one start per spatial dim")
    h = torch.tensor([seed & 0x7FFFFFFF], dtype=torch.int64, device=device)
    h = _mix(_mix(h) ^ (seed >> 31))
    for d in range(min(nd, 2)):
        h = _mix(h ^ _coords(0, shape[d], d, nd, device))
    thr = min(int(p * 2**32), 2**32)
    if channels or nd <= 2:
        return h >= thr
    keep = torch.empty(shape, dtype=torch.bool, device=device)
    step = max(1, _CHUNK // max(1, math.prod(shape) // shape[2]))
    for r in range(0, shape[2], step):
        rows = min(step, shape[2] - r)
        hr = _mix(h ^ _coords(origin[0] + r, rows, 2, nd, device))
        for d in range(3, nd):
            hr = _mix(hr ^ _coords(origin[d - 2], shape[d], d, nd, device))
        keep[:, :, r:r + rows] = hr >= thr
    return keep


class _Masked(torch.autograd.Function):
    """``x * keep * scale``, saving the bool mask only (what torch's dropout saves)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, keep: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x * keep * scale

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (keep,) = ctx.saved_tensors
        return g * keep * ctx.scale, None, None


def _apply(x: Tensor, p: float, seed: int, origin: Sequence[int], channels: bool) -> Tensor:
    if p >= 1:
        return x * 0
    keep = keyed_mask(tuple(x.shape), p, seed, origin, channels, x.device)
    out: Tensor = _Masked.apply(x, keep, 1.0 / (1.0 - p))
    return out


class KeyedDropout(nn.Module):
    """Dropout whose mask is keyed by coordinates ([Note: keyed dropout]): the one-process form of
    what a stage on sequential tiles runs. ``channels``: Dropout1d/2d/3d (whole channels)."""

    def __init__(self, p: float = 0.5, channels: bool = False) -> None:
        super().__init__()
        if not 0 <= p <= 1:
            raise NowdlError(f"KeyedDropout: p={p} must be in [0, 1]")
        self.p, self.channels = float(p), channels

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        return _apply(x, self.p, draw_seed(), (), self.channels)

    def extra_repr(self) -> str:
        return f"p={self.p}, channels={self.channels}"


def keyed_dropout(model: nn.Module) -> nn.Module:
    """``model`` with every Dropout/Dropout1d/2d/3d submodule replaced by a :class:`KeyedDropout`
    of the same ``p`` (in place; returned). ``F.dropout`` calls in ``forward`` stay torch's."""
    for m in list(model.modules()):
        for child, sub in list(m.named_children()):
            if type(sub) in KEYED_MODULES:
                k = KeyedDropout(float(sub.p), KEYED_MODULES[type(sub)])  # type: ignore[arg-type]
                k.train(sub.training)
                setattr(m, child, k)
    return model


# ----------------------------------------------------------------------------------------------
# in a stage's graph

@dataclass
class _Context:
    seeds: Mapping[str, int]
    origins: Mapping[str, Sequence[int]]


_ACTIVE: list[_Context] = []


class KeyedNode(nn.Module):
    """A stage graph's dropout node made keyed: ``p`` from the dropout module (live) or the call,
    its mode from ``mode`` (a module: live) or the call, its seed and window origin from
    :func:`keyed_run`."""

    def __init__(self, name: str, channels: bool, p: float | nn.Module, mode: bool | nn.Module) -> None:
        super().__init__()
        self.node, self.channels = name, channels
        self.src = [p, mode]  # a list: not submodules (their mode follows the model's own train()/eval())

    def live(self) -> tuple[float, bool]:
        """(p, whether it drops now)."""
        src, mode = self.src
        p = float(src.p) if isinstance(src, nn.Module) else float(src)  # type: ignore[arg-type]
        return p, bool(mode.training if isinstance(mode, nn.Module) else mode) and p > 0

    def forward(self, x: Tensor) -> Tensor:
        p, on = self.live()
        if not on:
            return x
        if not _ACTIVE or self.node not in _ACTIVE[-1].seeds:
            raise NowdlError(f"dropout node {self.node!r}: keyed dropout ran without a seed; run it inside "
                             "keyed_run (as spatial stages do)")
        ctx = _ACTIVE[-1]
        return _apply(x, p, ctx.seeds[self.node], ctx.origins.get(self.node, ()), self.channels)


def keyed_spec(gm: fx.GraphModule, node: fx.Node) -> tuple[bool, float | nn.Module, bool | nn.Module] | None:
    """(channels, p, mode) of a keyable dropout node (None: not one): see :class:`KeyedNode`."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if type(m) in KEYED_MODULES:
            return KEYED_MODULES[type(m)], m, m
        if isinstance(m, ModeAware) and m.op in _KEYED_ATEN and len(node.args) > 1 \
                and isinstance(node.args[1], (int, float)):
            return _KEYED_ATEN[m.op], float(node.args[1]), m
    if node.op == "call_function" and node.target in _KEYED_FNS:
        a = list(node.args) + [None] * 3
        p = node.kwargs.get("p", a[1] if a[1] is not None else 0.5)
        train = node.kwargs.get("training", a[2] if a[2] is not None else True)
        if isinstance(p, (int, float)) and isinstance(train, bool):
            return _KEYED_FNS[node.target], float(p), train
    return None


def keyed_nodes(gm: fx.GraphModule) -> list[KeyedNode]:
    """A :class:`KeyedNode` per keyable dropout node of ``gm``, in graph order."""
    specs = [(n.name, keyed_spec(gm, n)) for n in gm.graph.nodes]
    return [KeyedNode(name, *s) for name, s in specs if s is not None]


def keyed_graph(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[KeyedNode]]:
    """``gm`` with its dropout nodes keyed (a copy sharing ``gm``'s modules, node names kept) and
    those nodes in graph order; ``gm`` itself and ``[]`` if it has none."""
    keyed = keyed_nodes(gm)
    if not keyed:
        return gm, []
    graph = copy.deepcopy(gm.graph)
    new = fx.GraphModule(gm, graph)
    by_name = {n.name: n for n in graph.nodes}
    for k in keyed:
        node = by_name[k.node]
        target = f"_nowdl_keyed_{k.node}"
        new.add_submodule(target, k)
        x = node.kwargs.get("input", node.args[0] if node.args else None)
        node.op, node.target, node.args, node.kwargs = "call_module", target, (x,), {}
    new.recompile()
    return new, keyed


def draw_seeds(keyed: Sequence[KeyedNode], ranks: Sequence[int], group: dist.ProcessGroup | None,
               device: torch.device) -> dict[str, int]:
    """One seed per node that drops now, in graph order (:func:`draw_seed`); the tile group's
    first rank's seeds on every rank of the group."""
    names = [k.node for k in keyed if k.live()[1]]
    seeds = [draw_seed() for _ in names]
    if len(ranks) > 1 and names:
        t = torch.tensor(seeds, dtype=torch.int64, device=device)
        dist.broadcast(t, src=ranks[0], group=group)
        seeds = [int(v) for v in t.cpu()]
    return dict(zip(names, seeds, strict=True))


@contextlib.contextmanager
def keyed_run(seeds: Mapping[str, int], origins: Mapping[str, Sequence[int]]) -> Iterator[None]:
    """Keyed dropout nodes run inside use ``seeds`` and the window ``origins`` (per node)."""
    _ACTIVE.append(_Context(seeds, origins))
    try:
        yield
    finally:
        _ACTIVE.pop()
