"""Coordinate-keyed dropout: a mask that every tile, margin and recomputation draws alike.

[Note: keyed dropout] On sequential tiles ([Note: sequential tiles] in
:mod:`nowdl.runtime.spatial.sequential`) a stage runs several times per micro-batch (statistics
passes, the forward, the recomputation in backward) on overlapping windows; torch's dropout
would draw a new mask each time. A *keyed* dropout draws no mask: whether element
``(n, c, i_1 .. i_k)`` is kept is a pure function of

* a 62-bit seed drawn once per micro-batch and dropout node (:func:`draw_seed`, one
  ``torch.randint`` from the CPU generator, the nodes in graph order; on several ranks the tile
  group's first rank's seeds are broadcast, so ranks seeded alike or not agree),
* the sample index ``n`` in the micro-batch, the channel ``c``,
* and the pixel's coordinates ``i_d`` on the WHOLE image at the node's resolution (a window's
  origin is added to its local coordinates),

hashed in int64 (a 32-bit integer hash whose products stay below 2**63, so CPU and GPU give the
same bits) and compared with ``p * 2**32``: kept with probability ``1 - p``, scaled by
``1 / (1 - p)``. Dropout1d/2d/3d (whole channels) key on ``(n, c)`` only. Any sub-tile, margin,
recomputation or neighbouring GPU therefore computes the same mask for the same pixel, and the
whole image run with the same keyed dropout and the same seeds is the same function.

The reference: one process running the same micro-batches with :class:`KeyedDropout` in place of
torch's dropout modules (:func:`keyed_dropout`), its CPU generator in the state the ranks' are in.
Each :class:`KeyedDropout` call in training draws its seed as the stage does. The masks have
torch's distribution (independent Bernoulli(1 - p) per element or channel) but are other numbers
than ``torch.nn.functional.dropout`` draws from the same seed.
"""

from __future__ import annotations

import contextlib
import copy
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
           "draw_seeds", "keyed_spec", "KEYED_MODULES"]

_M1, _M2, _LOW = 0x7FEB352D, 0x5BD1E995, 0xFFFFFFFF  # odd multipliers < 2**31: h * m < 2**63 for h < 2**32
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


def keyed_mask(shape: Sequence[int], p: float, seed: int, origin: Sequence[int] = (), channels: bool = False,
               device: torch.device | str = "cpu") -> Tensor:
    """The keep mask (bool) of an ``(N, C, *spatial)`` tensor whose spatial dims start at ``origin``
    on the whole image ([Note: keyed dropout]); ``channels``: one value per ``(n, c)``."""
    nd = len(shape)
    origin = tuple(origin) or (0,) * (nd - 2)
    if len(origin) != nd - 2:
        raise NowdlError(f"keyed dropout: origin {tuple(origin)} has {len(origin)} dims for a tensor of shape "
                         f"{tuple(shape)} ({nd - 2} spatial dims); give one start per spatial dim")
    h = torch.tensor([seed & 0x7FFFFFFF], dtype=torch.int64, device=device)
    h = _mix(_mix(h) ^ (seed >> 31))
    for d, size in enumerate(shape if not channels else shape[:2]):
        view = [1] * nd
        view[d] = int(size)
        start = origin[d - 2] if d >= 2 else 0
        h = _mix(h ^ (torch.arange(start, start + int(size), dtype=torch.int64, device=device).view(view) & _LOW))
    return h >= min(int(p * 2**32), 2**32)


def _apply(x: Tensor, p: float, seed: int, origin: Sequence[int], channels: bool) -> Tensor:
    if p >= 1:
        return x * 0
    keep = keyed_mask(tuple(x.shape), p, seed, origin, channels, x.device)
    return x * (keep.to(x.dtype) * (1.0 / (1.0 - p)))


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
            raise NowdlError(f"dropout node {self.node!r}: keyed dropout ran without a seed; run the stage through "
                             "SequentialTiles (keyed_run)")
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


def keyed_graph(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[KeyedNode]]:
    """``gm`` with its dropout nodes keyed (a copy sharing ``gm``'s modules, node names kept) and
    those nodes in graph order; ``gm`` itself and ``[]`` if it has none."""
    specs = [(n, keyed_spec(gm, n)) for n in gm.graph.nodes]
    if not any(s is not None for _, s in specs):
        return gm, []
    graph = copy.deepcopy(gm.graph)
    new = fx.GraphModule(gm, graph)
    keyed: list[KeyedNode] = []
    by_name = {n.name: n for n in graph.nodes}
    for old, s in specs:
        if s is None:
            continue
        node = by_name[old.name]
        k = KeyedNode(old.name, *s)
        target = f"_nowdl_keyed_{old.name}"
        new.add_submodule(target, k)
        x = node.kwargs.get("input", node.args[0] if node.args else None)
        node.op, node.target, node.args, node.kwargs = "call_module", target, (x,), {}
        keyed.append(k)
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
