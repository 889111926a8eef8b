"""Halo fusion: one deeper halo exchange for a run of conv/pool/pointwise ops.

:func:`nowdl.runtime.spatial.tile_forward` exchanges a halo before EVERY conv and pool. For a
run of consecutive fusable ops (the old system's ``--halo-D2`` / ``--fused-layers``),
:func:`fused_forward` exchanges once, a window deep enough for the whole run, and recomputes
the overlap of the intermediates locally. Along each spatial dim, from the last op back::

    op j output region [o0, o1)  ->  op j input window W = [o0*s - lo, (o1 - 1)*s - lo + d*(k - 1) + 1)
                                     op j-1 output region = W clipped to [0, size of that tensor)

Outside the intermediate image the window is op j's padding (zeros, or -inf for max
pooling), added with ``F.pad``; inside it is recomputed by op j-1. The first windowed op runs
on its unclipped window as a window op (``nowdl.runtime.spatial.window_op``: it saves the tile and
the halo slabs, not the window, and overlaps the exchange with its interior). Pointwise ops keep
the region (they only ever see computed in-image values); those before the first windowed op
run on the exact tile before the fetch.

Exactness: every rank computes exactly its own output tile, and each value it recomputes in
the overlap equals the unsplit intermediate (same window, same padding). The unsplit loss is
the sum over output tiles, so each rank's backward through its recomputation gives exactly
its tile's share of the weight gradients (summed over ranks with ``sum_weight_grads``), and
the window gradient returned to the owners by ``fetch_window``'s backward and added there is
exactly its share of the input gradient: overlapping recomputation is never double-counted,
because each final output pixel is owned by one rank.

Stochastic dropout (training mode, p > 0) after the first windowed op is refused: ranks
recomputing the same intermediate pixel would drop it independently.

The geometry (which modules fuse, every op's window, :func:`chain_geometry`, which the planner
uses to price fusion) is pure and lives in :mod:`nowdl.geometry`; this module runs the chain.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from nowdl.geometry import (
    ChainStep,
    Span,
    chain_geometry,
    chain_steps,
    chain_windows,
    flatten_sequential,
    fusable,
)
from nowdl.runtime.spatial.exchange import Window, _check_tile, _windows
from nowdl.runtime.spatial.precision import opmath, probe_dtype
from nowdl.runtime.spatial.tiled_ops import _AVGPOOL_FN, _CONV_FN, _MAXPOOL_FN, _sum_pool
from nowdl.runtime.spatial.tiles import TileGrid
from nowdl.runtime.spatial.window_op import _window_op

__all__ = ["fusable", "fused_forward", "chain_geometry"]


# ------------------------------------------------------------------------------------------
# forward


def _fill(step: ChainStep) -> float:
    return -math.inf if step.kind == "max" else 0.0


def _apply(step: ChainStep, x: Tensor, win: Sequence[Span], out_region: Sequence[Span]) -> Tensor:
    """Run a windowed op unpadded on ``x`` (covering the unclipped window ``win``), giving the
    output over ``out_region``."""
    m: Any = step.module
    n = len(win)
    if any(b <= a for a, b in out_region):  # nothing to compute here; keep the graph connected
        ch = m.out_channels if step.kind == "conv" else x.shape[1]
        shape = (x.shape[0], ch) + tuple(b - a for a, b in out_region)
        return x.new_zeros(shape) + x.sum() * 0
    if step.kind == "conv":
        return _CONV_FN[n](x, m.weight, m.bias, step.s, 0, step.d, m.groups)
    if step.kind == "max":
        return _MAXPOOL_FN[n](x, step.k, step.s, 0, step.d)
    return _avg_divide(step, _sum_pool(x, step.k, step.s), win)


def _window_fn(step: ChainStep) -> Any:
    """``op(window, weight, bias)`` of a windowed step, unpadded (average pools: the sum)."""
    m: Any = step.module
    n = len(step.k)
    if step.kind == "conv":
        return lambda xw, w, b: _CONV_FN[n](xw, w, b, step.s, 0, step.d, m.groups)
    if step.kind == "max":
        return lambda xw, w, b: _MAXPOOL_FN[n](xw, step.k, step.s, 0, step.d)
    return lambda xw, w, b: _sum_pool(xw.to(opmath(xw.dtype)), step.k, step.s)  # bf16/fp16: summed in float32


def _avg_divide(step: ChainStep, total: Tensor, win: Sequence[Span]) -> Tensor:
    """An average pool's window sums divided by the count of pixels each averages."""
    m: Any = step.module
    n = len(win)
    div_override = getattr(m, "divisor_override", None)
    if div_override:
        return total / div_override
    incl = bool(m.count_include_pad)
    x = total
    mask = x.new_ones((1, 1) + tuple(b - a for a, b in win))
    for i in range(n):
        lo_b = -step.pad[i] if incl else 0
        hi_b = step.in_shape[i] + (step.pad[i] if incl else 0)
        idx = _arange(win[i], x)
        mi = ((idx >= lo_b) & (idx < hi_b)).to(x.dtype)
        mask = mask * mi.view((1, 1) + tuple(-1 if j == i else 1 for j in range(n)))
    return total / _sum_pool(mask, step.k, step.s)


def _arange(span: Span, like: Tensor) -> Tensor:
    return torch.arange(span[0], span[1], device=like.device)


def _pad_to(x: Tensor, region: Sequence[Span], win: Sequence[Span], fill: float) -> Tensor:
    """``x`` (covering ``region``) padded with ``fill`` up to the window ``win``."""
    pad: list[int] = []
    for (r0, r1), (w0, w1) in zip(reversed(region), reversed(win), strict=True):  # F.pad: last dim first
        pad += [w1 - w0, 0] if r1 <= r0 else [r0 - w0, w1 - r1]
    return F.pad(x, pad, value=fill) if any(pad) else x


def fused_forward(
    modules: Sequence[nn.Module],
    x_tile: Tensor,
    grid: TileGrid,
    group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, TileGrid]:
    """Run a chain of fusable ops on a tile with ONE halo exchange (one backward exchange).

    Equivalent to applying :func:`nowdl.runtime.spatial.tile_forward` to each module in turn:
    returns this rank's output tile and the output grid. Collective over the tile group when
    the chain has a conv or pool (every rank must call it with the same chain); nested
    ``nn.Sequential`` are flattened. Sum the weight gradients with ``sum_weight_grads``.

    Raises:
        NotImplementedError: a module is not fusable (see :func:`fusable`).
        TileTooSmallError: an intermediate spatial size is smaller than the grid.
    """
    mods = flatten_sequential(modules)
    _check_tile(x_tile, grid, "fused_forward")
    steps = chain_steps(mods, grid.shape, grid.grid, "fused_forward")
    out_grid = grid.with_shape(steps[-1].out_shape if steps else grid.shape)
    first = next((j for j, st in enumerate(steps) if st.windowed), None)
    if first is None:  # pointwise only: no exchange needed
        x = x_tile
        for m in mods:
            x = m(x)
        return x, out_grid
    x = x_tile
    for m in mods[:first]:  # pointwise on the exact tile: never on padding
        x = m(x)
    plans = chain_windows(steps, out_grid.shape, out_grid.grid)
    wins = _windows(grid, lambda i, c: plans[i][c][first][0])
    mine = [plans[i][out_grid.coords[i]] for i in range(grid.ndim)]
    for j in range(first, len(steps)):
        st = steps[j]
        if not st.windowed:
            x = st.module(x)
            continue
        win = [p[j][0] for p in mine]
        out_region = [p[j + 1][1] for p in mine] if j + 1 < len(steps) else list(out_grid.tile_bounds())
        if j == first:
            x = _window_step(st, x, grid, wins, group, win, out_region)
            continue
        region = [p[j][1] for p in mine]
        if any(b <= a for a, b in region) or any(b <= a for a, b in out_region):
            x = _apply(st, _pad_to(x, region, win, _fill(st)), win, out_region)
            continue
        # padding the recomputed region as a window op: the op saves ``x`` (its producer saved it
        # already), not a padded copy; the "exchange" of a one-tile grid is the padding only
        local = TileGrid(tuple(b - a for a, b in region), (1,) * len(region), (0,) * len(region), (_me(),))
        shifted = (tuple((w0 - r0, w1 - r0) for (w0, w1), (r0, _) in zip(win, region, strict=True)),)
        x = _window_step(st, x, local, shifted, None, win, out_region)
    return x, out_grid


def _me() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _window_step(st: ChainStep, x: Tensor, grid: TileGrid, wins: Sequence[Window], group: dist.ProcessGroup | None,
              win: Sequence[Span], out_region: Sequence[Span]) -> Tensor:
    """A windowed op of the chain as a window op over ``wins`` of ``grid``: the first on the deep
    window it fetches (saves the tile and the halo slabs, not the window; overlaps the
    exchange: [Note: halo overlap]), later ones on their padded region (a one-tile grid)."""
    m: Any = st.module
    empty = any(b <= a for a, b in out_region)
    if empty:  # this rank computes nothing of the chain: keep the exchange in the graph
        ch = m.out_channels if st.kind == "conv" else x.shape[1]
        shape = (x.shape[0], ch) + tuple(b - a for a, b in out_region)
        return _window_op(x, grid, wins, group, lambda xw, w, b: xw.new_zeros(shape) + xw.sum() * 0, None,
                          fill=_fill(st))
    geom = (st.k, st.s, st.d)
    if st.kind == "conv":
        return _window_op(x, grid, wins, group, _window_fn(st), geom, weight=m.weight, bias=m.bias,
                          conv=(tuple(st.s), tuple(st.d), m.groups))
    n = len(st.k)
    pool_fn = _MAXPOOL_FN[n] if st.kind == "max" else _AVGPOOL_FN[n]
    x = x.to(probe_dtype(x, f"{st.kind}{n}", lambda t: pool_fn(t, 1), n))  # [Note: tiles under autocast]
    y = _window_op(x, grid, wins, group, _window_fn(st), geom, fill=_fill(st))
    return y if st.kind == "max" else _avg_divide(st, y, win).to(x.dtype)
