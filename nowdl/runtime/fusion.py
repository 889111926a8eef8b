"""Halo fusion: one deeper halo exchange for a run of conv/pool/pointwise ops.

:func:`nowdl.runtime.halo.tile_forward` exchanges a halo before EVERY conv and pool. For a
run of consecutive fusable ops (the old system's ``--halo-D2`` / ``--fused-layers``),
:func:`fused_forward` exchanges once, a window deep enough for the whole run, and recomputes
the overlap of the intermediates locally. Along each spatial dim, from the last op back::

    op j output region [o0, o1)  ->  op j input window W = [o0*s - lo, (o1 - 1)*s - lo + d*(k - 1) + 1)
                                     op j-1 output region = W clipped to [0, size of that tensor)

Outside the intermediate image the window is op j's padding (zeros, or -inf for max
pooling), added with ``F.pad``; inside it is recomputed by op j-1. The first windowed op's
unclipped window is fetched with :func:`nowdl.runtime.halo.fetch_window`. Pointwise ops keep
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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from nowdl.runtime.halo import (
    _CONV_FN,
    _MAXPOOL_FN,
    _POINTWISE,
    TileTooSmallError,
    _check_tile,
    _conv_pads,
    _pool_out,
    _sum_pool,
    _tup,
    _windows,
    fetch_window,
)
from nowdl.runtime.tiles import TileGrid

__all__ = ["fusable", "fused_forward", "chain_geometry"]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_MAXPOOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
_AVGPOOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
_NDIM: dict[type, int] = {t: i + 1 for ts in (_CONVS, _MAXPOOLS, _AVGPOOLS) for i, t in enumerate(ts)}

Span = tuple[int, int]
"""``[start, stop)`` along one dim, in the coordinates of one (intermediate) image."""


def _stochastic(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p > 0


def fusable(module: nn.Module) -> bool:
    """Whether ``module`` can sit inside a fused run (:func:`fused_forward`).

    True for Conv1d/2d/3d with zero padding, MaxPool (without indices), AvgPool and the
    pointwise modules of :mod:`nowdl.runtime.halo`; an ``nn.Sequential`` when all its children
    are. False for norms (statistics need exact tiles), upsampling, transposed convs, and
    dropout in training mode (it is fine at the start of a run, before the first conv/pool,
    which :func:`fused_forward` accepts).
    """
    if isinstance(module, nn.Sequential):
        return all(fusable(m) for m in module)
    if isinstance(module, _CONVS):
        return module.padding_mode == "zeros"
    if isinstance(module, _MAXPOOLS):
        return not module.return_indices
    if isinstance(module, _AVGPOOLS):
        return True
    if _stochastic(module):
        return False
    return isinstance(module, _POINTWISE)


# ------------------------------------------------------------------------------------------
# geometry


@dataclass(frozen=True)
class _Step:
    """One op of a fused run: its kind and window parameters, its full in/out spatial shapes."""

    module: nn.Module
    kind: str  # "conv" | "max" | "avg" | "point"
    k: tuple[int, ...]
    s: tuple[int, ...]
    d: tuple[int, ...]
    lo: tuple[int, ...]  # padding before the image, per dim
    pad: tuple[int, ...]  # avg pool: symmetric padding (the divisor's bounds)
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    @property
    def windowed(self) -> bool:
        return self.kind != "point"


def _flatten(modules: Iterable[nn.Module]) -> list[nn.Module]:
    out: list[nn.Module] = []
    for m in modules:
        out.extend(_flatten(m) if isinstance(m, nn.Sequential) else [m])
    return out


def _name(j: int, m: nn.Module) -> str:
    return f"#{j} {type(m).__name__}"


def _steps(modules: Sequence[nn.Module], shape: Sequence[int], grid: Sequence[int], where: str) -> list[_Step]:
    """The run's ops with every intermediate full spatial shape; validates the chain."""
    n = len(shape)
    cur = tuple(int(v) for v in shape)
    steps: list[_Step] = []
    seen_windowed = False
    for j, m in enumerate(modules):
        name = _name(j, m)
        ones = (1,) * n
        nd = _NDIM.get(type(m)) or next((v for t, v in _NDIM.items() if isinstance(m, t)), n)
        if nd != n:
            raise ValueError(
                f"{where}: {name} works on {nd} spatial dims but the tiles have {n} "
                f"(image {tuple(shape)}); use a {n}D op or tile a {nd}D tensor"
            )
        if isinstance(m, _CONVS):
            if m.padding_mode != "zeros":
                raise NotImplementedError(
                    f"{where}: {name}(padding_mode={m.padding_mode!r}) is not fusable (only 'zeros'); "
                    f"end the fused run before it"
                )
            k, s, d = _tup(m.kernel_size, n), _tup(m.stride, n), _tup(m.dilation, n)
            pads = _conv_pads(m, n, k, d)
            out = tuple((cur[i] + pads[i][0] + pads[i][1] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(n))
            step = _Step(m, "conv", k, s, d, tuple(p[0] for p in pads), ones, cur, out)
        elif isinstance(m, _MAXPOOLS + _AVGPOOLS):
            is_max = isinstance(m, _MAXPOOLS)
            if is_max and m.return_indices:
                raise NotImplementedError(f"{where}: {name}(return_indices=True) is not fusable (indices are tile-local)")
            k = _tup(m.kernel_size, n)
            s = _tup(m.stride if m.stride not in (None, (), []) else m.kernel_size, n)
            p = _tup(m.padding, n)
            d = _tup(getattr(m, "dilation", 1), n) if is_max else ones
            out = tuple(_pool_out(cur[i], k[i], s[i], p[i], d[i], bool(m.ceil_mode)) for i in range(n))
            step = _Step(m, "max" if is_max else "avg", k, s, d, p, p, cur, out)
        elif isinstance(m, _POINTWISE):
            if _stochastic(m) and seen_windowed:
                raise NotImplementedError(
                    f"{where}: {name}(p={getattr(m, 'p', None)}) in training mode after the first conv/pool "
                    f"of a fused run would drop overlapping pixels differently on each rank; end the fused "
                    f"run before it, move it before the first conv/pool, or put it in eval mode"
                )
            step = _Step(m, "point", ones, ones, ones, (0,) * n, (0,) * n, cur, cur)
        else:
            raise NotImplementedError(
                f"{where}: {name} is not fusable (conv, max/avg pool and pointwise ops are; norms, "
                f"upsampling and transposed convs need exact tiles); end the fused run before it "
                f"and run it with tile_forward"
            )
        for i in range(n):
            if step.out_shape[i] < int(grid[i]):
                raise TileTooSmallError(
                    f"{where}: {name} turns spatial dim {i} of size {cur[i]} into {step.out_shape[i]}, which "
                    f"cannot be cut into {grid[i]} tiles (run input {tuple(shape)}); use fewer parts or "
                    f"end the spatial region before this op"
                )
        seen_windowed = seen_windowed or step.windowed
        steps.append(step)
        cur = step.out_shape
    return steps


def _clip(w: Span, size: int) -> Span:
    a = min(max(w[0], 0), size)
    return a, max(a, min(w[1], size))


def _walk(steps: Sequence[_Step], i: int, out: Span) -> list[tuple[Span, Span]]:
    """Per step along dim ``i``: (unclipped input window, clipped input region) for the final
    output region ``out``. An empty output region gives an empty window."""
    res: list[tuple[Span, Span]] = [((0, 0), (0, 0))] * len(steps)
    o0, o1 = out
    for j in range(len(steps) - 1, -1, -1):
        st = steps[j]
        if not st.windowed:
            w = (o0, o1)
        elif o1 <= o0:
            w = (o0 * st.s[i] - st.lo[i],) * 2
        else:
            w = (o0 * st.s[i] - st.lo[i], (o1 - 1) * st.s[i] - st.lo[i] + st.d[i] * (st.k[i] - 1) + 1)
        r = _clip(w, st.in_shape[i])
        res[j] = (w, r)
        o0, o1 = r
    return res


def _plans(steps: Sequence[_Step], out_grid: TileGrid) -> list[list[list[tuple[Span, Span]]]]:
    """``plans[dim][coord][step]``: every tile's windows and regions, per dim."""
    return [
        [_walk(steps, i, out_grid.bounds(i, c)) for c in range(out_grid.grid[i])]
        for i in range(out_grid.ndim)
    ]


# ------------------------------------------------------------------------------------------
# forward


def _fill(step: _Step) -> float:
    return -math.inf if step.kind == "max" else 0.0


def _apply(step: _Step, x: Tensor, win: Sequence[Span], out_region: Sequence[Span]) -> Tensor:
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
    total = _sum_pool(x, step.k, step.s)
    div_override = getattr(m, "divisor_override", None)
    if div_override:
        return total / div_override
    incl = bool(m.count_include_pad)
    mask = x.new_ones((1, 1) + tuple(x.shape[2:]))
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

    Equivalent to applying :func:`nowdl.runtime.halo.tile_forward` to each module in turn:
    returns this rank's output tile and the output grid. Collective over the tile group when
    the chain has a conv or pool (every rank must call it with the same chain); nested
    ``nn.Sequential`` are flattened. Sum the weight gradients with ``sum_weight_grads``.

    Raises:
        NotImplementedError: a module is not fusable (see :func:`fusable`).
        TileTooSmallError: an intermediate spatial size is smaller than the grid.
    """
    mods = _flatten(modules)
    _check_tile(x_tile, grid, "fused_forward")
    steps = _steps(mods, grid.shape, grid.grid, "fused_forward")
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
    plans = _plans(steps, out_grid)
    wins = _windows(grid, lambda i, c: plans[i][c][first][0])
    x = fetch_window(x, grid, wins, group, fill=_fill(steps[first]))
    mine = [plans[i][out_grid.coords[i]] for i in range(grid.ndim)]
    for j in range(first, len(steps)):
        st = steps[j]
        if not st.windowed:
            x = st.module(x)
            continue
        win = [p[j][0] for p in mine]
        if j > first:
            x = _pad_to(x, [p[j][1] for p in mine], win, _fill(st))
        out_region = [p[j + 1][1] for p in mine] if j + 1 < len(steps) else list(out_grid.tile_bounds())
        x = _apply(st, x, win, out_region)
    return x, out_grid


# ------------------------------------------------------------------------------------------
# cost-model geometry


def chain_geometry(modules: Sequence[nn.Module], shape: Sequence[int], grid: Sequence[int]) -> dict[str, Any]:
    """What fusing ``modules`` costs on a ``shape`` image cut into ``grid`` tiles (pure).

    ``grid`` may be shorter than ``shape`` (leading dims uncut). Returns:

    * ``halo``: per spatial dim ``(lo, hi)``, the deepest part of the fused window fetched from
      other tiles (in-image, beyond the tile), over all tiles; ``(0, 0)`` along uncut dims.
    * ``exchanges_unfused``: exchanges of the unfused chain (one per conv/pool).
    * ``exchanges_fused``: 1 (0 for a pointwise-only chain).
    * ``extra_fraction``: for the worst (usually an interior) tile, output elements of the
      chain's conv/pool ops computed beyond its exact output tiles, over those exact tiles'
      elements (spatial only; 0 for a single windowed op).

    Raises the same errors as :func:`fused_forward`.
    """
    shp = tuple(int(v) for v in shape)
    gd = (1,) * (len(shp) - len(grid)) + tuple(int(g) for g in grid)
    tg = TileGrid(shp, gd, (0,) * len(shp), tuple(range(math.prod(gd))))
    steps = _steps(_flatten(modules), shp, gd, "chain_geometry")
    windowed = [j for j, st in enumerate(steps) if st.windowed]
    n = len(shp)
    if not windowed:
        return {"halo": ((0, 0),) * n, "exchanges_unfused": 0, "exchanges_fused": 0, "extra_fraction": 0.0}
    plans = _plans(steps, tg.with_shape(steps[-1].out_shape))
    first = windowed[0]
    halo: list[tuple[int, int]] = []
    for i in range(n):
        lo = hi = 0
        for c in range(gd[i]):
            t0, t1 = tg.bounds(i, c)
            r0, r1 = plans[i][c][first][1]  # the in-image part of the fetched window
            lo, hi = max(lo, t0 - r0), max(hi, r1 - t1)
        halo.append((lo, hi))
    extra = 0.0
    for cs in tg.all_coords():
        computed = exact = 0
        for j in windowed:
            og = tg.with_shape(steps[j].out_shape)
            exact += math.prod(b - a for a, b in og.tile_bounds(cs))
            if j + 1 < len(steps):
                computed += math.prod(plans[i][cs[i]][j + 1][1][1] - plans[i][cs[i]][j + 1][1][0] for i in range(n))
            else:
                computed += math.prod(b - a for a, b in og.tile_bounds(cs))
        if exact:
            extra = max(extra, computed / exact - 1.0)
    return {
        "halo": tuple(halo),
        "exchanges_unfused": len(windowed),
        "exchanges_fused": 1,
        "extra_fraction": extra,
    }
