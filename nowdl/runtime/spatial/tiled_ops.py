"""Tiled conv, transposed conv, pooling and upsampling: each rank computes its output tile.

Each op works out every tile's input window from its kernel, stride, dilation and padding
(or, for upsampling, from ATen's source-index arithmetic), fetches this rank's window with
:mod:`nowdl.runtime.spatial.exchange` and runs the op unpadded on it, so the output tile equals
the same region of the unsplit op's output (see :mod:`nowdl.runtime.spatial.exchange` for the
window picture). The weight gradients are this tile's share; sum them with
:func:`nowdl.runtime.spatial.dispatch.sum_weight_grads`. Under autocast each op runs in the
dtype the unsplit op would: [Note: tiles under autocast] in :mod:`nowdl.runtime.spatial.precision`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from nowdl.geometry import TileTooSmallError, conv_pads, ntuple, pool_out_size
from nowdl.runtime.spatial.exchange import Window, _check_tile, _windows, fetch_window
from nowdl.runtime.spatial.precision import (
    REDUCED,
    autocast_off,
    conv_operands,
    opmath,
    probe_dtype,
)
from nowdl.runtime.spatial.tiles import TileGrid
from nowdl.runtime.spatial.window_op import _window_op

__all__ = ["conv_tile", "conv_transpose_tile", "pool_tile", "upsample_tile"]


# ------------------------------------------------------------------------------------------
# window geometry


def _out_grid(grid: TileGrid, out_shape: Sequence[int], op: str) -> TileGrid:
    og = grid.with_shape(out_shape)
    for d in range(grid.ndim):
        if out_shape[d] < grid.grid[d]:
            raise TileTooSmallError(
                f"{op}: output size {out_shape[d]} along spatial dim {d} cannot be cut into "
                f"{grid.grid[d]} tiles (input {grid.shape}); use fewer parts or end the spatial "
                f"region before this op"
            )
    return og


def _strided_windows(grid: TileGrid, og: TileGrid, k: Sequence[int], s: Sequence[int],
                     d: Sequence[int], lo: Sequence[int]) -> tuple[Window, ...]:
    def per_dim(i: int, c: int) -> tuple[int, int]:
        o0, o1 = og.bounds(i, c)
        return o0 * s[i] - lo[i], (o1 - 1) * s[i] - lo[i] + d[i] * (k[i] - 1) + 1

    return _windows(grid, per_dim)


_CONV_FN: dict[int, Callable[..., Tensor]] = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONVT_FN: dict[int, Callable[..., Tensor]] = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def conv_tile(
    x_tile: Tensor, conv: nn.Module, grid: TileGrid, group: dist.ProcessGroup | None = None
) -> tuple[Tensor, TileGrid]:
    """This rank's output tile of ``conv`` (nn.Conv1d/2d/3d, any kernel, stride, dilation, groups,
    zero padding incl. 'same'/'valid') and the output's grid; the tile equals that region of
    ``conv(full)``."""
    op = type(conv).__name__
    if not isinstance(conv, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        raise TypeError(f"conv_tile: {op} is not nn.Conv1d/2d/3d")
    n = grid.ndim
    if len(conv.kernel_size) != n:
        raise ValueError(f"conv_tile: {op} has {len(conv.kernel_size)} spatial dims, the grid {n}")
    if conv.padding_mode != "zeros":
        raise NotImplementedError(
            f"conv_tile: {op}(padding_mode={conv.padding_mode!r}) is not tiled (only 'zeros'); "
            f"end the spatial region before it or use zero padding"
        )
    _check_tile(x_tile, grid, f"conv_tile({op})")
    k, s, d = ntuple(conv.kernel_size, n), ntuple(conv.stride, n), ntuple(conv.dilation, n)
    pads = conv_pads(conv, n, k, d)
    out_shape = [(grid.shape[i] + pads[i][0] + pads[i][1] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(n)]
    og = _out_grid(grid, out_shape, f"conv_tile({op})")
    wins = _strided_windows(grid, og, k, s, d, [p[0] for p in pads])
    fn = _CONV_FN[n]
    groups = conv.groups
    y = _window_op(x_tile, grid, wins, group, lambda xw, w, b: fn(xw, w, b, s, 0, d, groups), (k, s, d),
                   weight=conv.weight, bias=conv.bias, conv=(s, d, groups))
    return y, og


def conv_transpose_tile(
    x_tile: Tensor, conv: nn.Module, grid: TileGrid, group: dist.ProcessGroup | None = None
) -> tuple[Tensor, TileGrid]:
    """This rank's output tile of ``conv`` (nn.ConvTranspose1d/2d/3d, stride, dilation, padding,
    output_padding, groups) and the output's grid; the tile equals that region of ``conv(full)``."""
    op = type(conv).__name__
    if not isinstance(conv, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        raise TypeError(f"conv_transpose_tile: {op} is not nn.ConvTranspose1d/2d/3d")
    n = grid.ndim
    _check_tile(x_tile, grid, f"conv_transpose_tile({op})")
    if conv.padding_mode != "zeros":
        raise NotImplementedError(f"conv_transpose_tile: {op}(padding_mode={conv.padding_mode!r}) is not tiled")
    k, s, d = ntuple(conv.kernel_size, n), ntuple(conv.stride, n), ntuple(conv.dilation, n)
    p, op_ = ntuple(conv.padding, n), ntuple(conv.output_padding, n)
    out_shape = [(grid.shape[i] - 1) * s[i] - 2 * p[i] + d[i] * (k[i] - 1) + op_[i] + 1 for i in range(n)]
    og = _out_grid(grid, out_shape, f"conv_transpose_tile({op})")

    def per_dim(i: int, c: int) -> tuple[int, int]:
        # input i feeds outputs i*s - p + j*d, j in [0, k)
        o0, o1 = og.bounds(i, c)
        a = max(0, -((-(o0 + p[i] - d[i] * (k[i] - 1))) // s[i]))
        b = min(grid.shape[i], (o1 - 1 + p[i]) // s[i] + 1)
        return a, max(a, b)

    wins = _windows(grid, per_dim)
    x_tile, weight, bias = conv_operands(x_tile, conv.weight, conv.bias)
    assert weight is not None
    with autocast_off(x_tile):
        return _conv_transpose_window(x_tile, conv, weight, bias, grid, og, wins, group, (s, d, p)), og


def _conv_transpose_window(x_tile: Tensor, conv: nn.modules.conv._ConvTransposeNd, weight: Tensor, bias: Tensor | None, grid: TileGrid,
                           og: TileGrid, wins: tuple[Window, ...], group: dist.ProcessGroup | None,
                           geom: tuple[Sequence[int], Sequence[int], Sequence[int]]) -> Tensor:
    """The transposed conv's output tile from the fetched window (operands in one dtype)."""
    s, d, p = geom
    n = grid.ndim
    xw = fetch_window(x_tile, grid, wins, group)
    mine = og.tile_bounds()
    win = wins[grid.index]
    if any(b <= a for a, b in win):  # only bias (or nothing) reaches this output tile
        shape = tuple(xw.shape[:1]) + (conv.out_channels,) + tuple(b - a for a, b in mine)
        y = xw.new_zeros(shape) + xw.sum() * 0  # keep the exchange in the graph: its backward is collective
    else:
        y = _CONVT_FN[n](xw, weight, None, s, 0, 0, conv.groups, d)
        pad: list[int] = []
        for i in reversed(range(n)):  # F.pad lists the last dim first; negative pads crop
            ys = win[i][0] * s[i] - p[i]
            ye = ys + y.shape[2 + i]
            pad += [ys - mine[i][0], mine[i][1] - ye]
        y = F.pad(y, pad)
    if bias is not None:
        y = y + bias.view((1, -1) + (1,) * n)
    return y


def _sum_pool(x: Tensor, k: Sequence[int], s: Sequence[int]) -> Tensor:
    n = x.dim() - 2
    if n == 1:
        return F.avg_pool2d(x.unsqueeze(2), (1, k[0]), (1, s[0]), divisor_override=1).squeeze(2)
    if n == 2:
        return F.avg_pool2d(x, tuple(k), tuple(s), divisor_override=1)
    return F.avg_pool3d(x, tuple(k), tuple(s), divisor_override=1)


_MAXPOOL_FN: dict[int, Callable[..., Tensor]] = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVGPOOL_FN: dict[int, Callable[..., Tensor]] = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def pool_tile(
    x_tile: Tensor, pool: nn.Module, grid: TileGrid, group: dist.ProcessGroup | None = None
) -> tuple[Tensor, TileGrid]:
    """This rank's output tile of MaxPool/AvgPool (kernel, stride, padding, dilation for max,
    ceil_mode, count_include_pad, divisor_override) and the output's grid; the tile equals that
    region of ``pool(full)``."""
    op = type(pool).__name__
    n = grid.ndim
    is_max = isinstance(pool, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d))
    if not is_max and not isinstance(pool, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        raise TypeError(f"pool_tile: {op} is not MaxPool1d/2d/3d or AvgPool1d/2d/3d")
    _check_tile(x_tile, grid, f"pool_tile({op})")
    k = ntuple(pool.kernel_size, n)
    s = ntuple(pool.stride if pool.stride not in (None, (), []) else pool.kernel_size, n)
    p = ntuple(pool.padding, n)
    d = ntuple(getattr(pool, "dilation", 1), n) if is_max else (1,) * n
    if is_max and pool.return_indices:
        raise NotImplementedError(f"pool_tile: {op}(return_indices=True) is not tiled (indices are tile-local)")
    ceil = bool(pool.ceil_mode)
    out_shape = [pool_out_size(grid.shape[i], k[i], s[i], p[i], d[i], ceil) for i in range(n)]
    og = _out_grid(grid, out_shape, f"pool_tile({op})")
    wins = _strided_windows(grid, og, k, s, d, p)
    if is_max:
        mp = _MAXPOOL_FN[n]
        x_tile = x_tile.to(probe_dtype(x_tile, f"max{n}", lambda t: mp(t, 1), n))
        return _window_op(x_tile, grid, wins, group, lambda xw, w, b: mp(xw, k, s, 0, d), (k, s, d),
                          fill=-math.inf), og
    out_dtype = probe_dtype(x_tile, f"avg{n}", lambda t: _AVGPOOL_FN[n](t, 1), n)
    x_tile = x_tile.to(out_dtype)
    acc = opmath(out_dtype)  # the sums in float32 for bf16/fp16, rounded once after the division
    total = _window_op(x_tile, grid, wins, group, lambda xw, w, b: _sum_pool(xw.to(acc), k, s), (k, s, d))
    div_override = getattr(pool, "divisor_override", None)
    if div_override:
        return (total / div_override).to(out_dtype), og
    win = wins[grid.index]
    lo_b = [-p[i] if pool.count_include_pad else 0 for i in range(n)]
    hi_b = [grid.shape[i] + (p[i] if pool.count_include_pad else 0) for i in range(n)]
    mask = total.new_ones((1, 1) + tuple(hi - lo for lo, hi in win))
    for i in range(n):
        idx = torch.arange(win[i][0], win[i][1], device=x_tile.device)
        m = ((idx >= lo_b[i]) & (idx < hi_b[i])).to(total.dtype)
        mask = mask * m.view((1, 1) + tuple(-1 if j == i else 1 for j in range(n)))
    return (total / _sum_pool(mask, k, s)).to(out_dtype), og


def _upsample_sizes(up: nn.Upsample, grid: TileGrid) -> tuple[list[int], list[float | None]]:
    n = grid.ndim
    if up.size is not None:
        return list(ntuple(up.size, n)), [None] * n
    sf = up.scale_factor
    sfs = [float(v) for v in sf] if isinstance(sf, (tuple, list)) else [float(sf)] * n  # type: ignore[arg-type]
    out = [int(math.floor(grid.shape[i] * sfs[i])) for i in range(n)]
    if up.recompute_scale_factor:
        return out, [None] * n
    return out, list(sfs)


def _scale32(in_size: int, out_size: int, sf: float | None) -> Tensor:
    if sf is not None and sf > 0:
        return torch.tensor(1.0 / sf, dtype=torch.float32)
    return torch.tensor(in_size, dtype=torch.float32) / torch.tensor(out_size, dtype=torch.float32)


def _nearest_index(in_size: int, out_size: int, sf: float | None, exact: bool) -> Tensor:
    """Source index of every output index, as ATen's CPU nearest kernels compute it."""
    o = torch.arange(out_size)
    if out_size == in_size:
        return o
    if out_size == 2 * in_size and not exact:
        return o // 2
    of = o.to(torch.float32) + (0.5 if exact else 0.0)
    return torch.clamp(torch.floor(of * _scale32(in_size, out_size, sf)).long(), max=in_size - 1)


def _linear_index(in_size: int, out_size: int, sf: float | None, align: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(i0, i1, lambda1) of every output index, as ATen's linear interpolation computes them."""
    dt = torch.float64 if dtype == torch.float64 else torch.float32
    o = torch.arange(out_size, dtype=dt)
    if align:
        scale = torch.tensor((in_size - 1) / (out_size - 1) if out_size > 1 else 0.0, dtype=dt)
        src = o * scale
    else:
        if sf is not None and sf > 0:
            scale = torch.tensor(1.0 / sf, dtype=dt)
        else:
            scale = torch.tensor(in_size, dtype=dt) / torch.tensor(out_size, dtype=dt)
        src = torch.clamp(scale * (o + 0.5) - 0.5, min=0)
    i0 = src.long()
    i1 = i0 + (i0 < in_size - 1).long()
    lam = torch.clamp(src - i0.to(dt), 0, 1)
    return i0, i1, lam


def upsample_tile(
    x_tile: Tensor, up: nn.Module, grid: TileGrid, group: dist.ProcessGroup | None = None
) -> tuple[Tensor, TileGrid]:
    """This rank's output tile of ``nn.Upsample`` (nearest, nearest-exact, (bi/tri)linear with
    align_corners True or False, size or scale_factor) and the output's grid; the tile equals
    that region of ``up(full)``."""
    if not isinstance(up, nn.Upsample):
        raise TypeError(f"upsample_tile: {type(up).__name__} is not nn.Upsample")
    mode = up.mode
    n = grid.ndim
    linear = {1: "linear", 2: "bilinear", 3: "trilinear"}[n]
    if mode not in ("nearest", "nearest-exact", linear):
        raise NotImplementedError(
            f"upsample_tile: Upsample(mode={mode!r}) on {n} spatial dims is not tiled "
            f"(nearest, nearest-exact and {linear} are); end the spatial region before it"
        )
    _check_tile(x_tile, grid, f"upsample_tile({mode})")
    out_dtype = probe_dtype(x_tile, f"up{mode}{n}", lambda t: F.interpolate(t, scale_factor=2, mode=mode), n)
    x_tile = x_tile.to(out_dtype)
    out_shape, sfs = _upsample_sizes(up, grid)
    og = _out_grid(grid, out_shape, f"upsample_tile({mode})")
    # per dim: full-length source indices (and weights), sliced per tile
    maps: list[tuple[Tensor, Tensor, Tensor | None]] = []
    for i in range(n):
        if mode in ("nearest", "nearest-exact"):
            idx = _nearest_index(grid.shape[i], out_shape[i], sfs[i], mode == "nearest-exact")
            maps.append((idx, idx, None))
        else:
            maps.append(_linear_index(grid.shape[i], out_shape[i], sfs[i], bool(up.align_corners), x_tile.dtype))

    def per_dim(i: int, c: int) -> tuple[int, int]:
        o0, o1 = og.bounds(i, c)
        return int(maps[i][0][o0:o1].min()), int(maps[i][1][o0:o1].max()) + 1

    wins = _windows(grid, per_dim)
    y = fetch_window(x_tile, grid, wins, group)  # no name keeps the window once the first dim is done
    if out_dtype in REDUCED and mode in ("linear", linear):
        y = y.float()  # interpolate in float32
    win = wins[grid.index]
    for i in range(n):
        o0, o1 = og.bounds(i, grid.coords[i])
        i0 = (maps[i][0][o0:o1] - win[i][0]).to(x_tile.device)
        lam = maps[i][2]
        if lam is None:
            y = y.index_select(2 + i, i0)
        else:
            i1 = (maps[i][1][o0:o1] - win[i][0]).to(x_tile.device)
            l1 = lam[o0:o1].to(device=x_tile.device, dtype=y.dtype)
            shape = tuple(-1 if j == i else 1 for j in range(n))
            l1 = l1.view((1, 1) + shape)
            # x0 * (1 - l1) + x1 * l1, ATen's rounding, in place: two tensors of the output's size
            # live at once, not the four the expression holds
            lo = y.index_select(2 + i, i0).mul_(1 - l1)
            y = lo.add_(y.index_select(2 + i, i1).mul_(l1))
    return y.to(out_dtype), og
