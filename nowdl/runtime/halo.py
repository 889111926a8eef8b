"""Exact tiled ops: halo exchange and the window geometry of conv, pool, upsample and norms.

Every rank of a tile group holds one tile of an ``(N, C, *spatial)`` tensor (see
:class:`nowdl.runtime.tiles.TileGrid`). An op with a spatial footprint computes the output
tile of its rank, whose bounds follow ``TileGrid`` over the OUTPUT spatial shape, from an
input *window*: the input rows/cols that output tile reads. Along one dim, for a conv with
kernel ``k``, stride ``s``, dilation ``d`` and zero padding ``lo`` before the image::

    output tile [o0, o1)   ->   input window [o0*s - lo, (o1 - 1)*s - lo + d*(k - 1) + 1)

    input  |  pad  | tile q-1 ........|  my tile .........| tile q+1 ....|  pad  |
                            [=========|===================|======)          window
                             ^ halo lo  (from q-1)        ^ halo hi (from q+1)

The window generally overlaps the neighbour tiles (the halo), may stick out of the image
(that part is the op's padding: zeros, or -inf for max pooling), and may differ per tile when
sizes are uneven or the stride is 2. For 2D square / 3D cube grids the window also overlaps
the diagonal neighbours (edges and corners)::

    +------+------+------+
    | q00  | q01  | q02  |      the window of tile q11 (dotted) takes a slab from each of
    |   ...|......|...   |      its 8 neighbours: 4 faces, 4 corners
    +---:--+------+--:---+
    | q10: | q11  | :q12 |
    +---:--+------+--:---+
    |   ...|......|...   |
    | q20  | q21  | q22  |
    +------+------+------+

:func:`fetch_window` is the primitive: every rank knows every rank's window (the geometry
is deterministic), so each rank sends each other rank exactly ``their window ∩ my tile``
and receives ``my window ∩ their tile`` (p2p ``isend``/``irecv`` with a per-call tag). Its
backward is the adjoint: the gradient of each received slab is sent back to its owner and
ADDED into the owner's input gradient (the halo gradients the old system dropped). The op
then runs unpadded on the window, so the output tile equals the same region of the unsplit
op's output.

Norms reduce their statistics over the tiles (differentiable all-reduce of per-channel sums
and centred sums of squares, counts from the actual uneven tiles), so training-mode
BatchNorm equals full-image BatchNorm, running statistics included.

Weight gradients: every rank computes its tile's contribution; :func:`sum_weight_grads`
all-reduces them with SUM over the tile group (never an average).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from nowdl.runtime.tiles import TileGrid

__all__ = [
    "Window",
    "fetch_window",
    "halo_exchange",
    "conv_tile",
    "conv_transpose_tile",
    "pool_tile",
    "upsample_tile",
    "batchnorm_tile",
    "groupnorm_tile",
    "instancenorm_tile",
    "tile_forward",
    "sum_weight_grads",
    "TileTooSmallError",
]

Window = tuple[tuple[int, int], ...]
"""Per spatial dim ``[start, stop)`` in full-image coordinates (may leave the image)."""

_CALLS: dict[tuple[int, ...], itertools.count[int]] = {}  # per tile group: tags line up on its ranks
_TAG_SPACE = 1 << 20


def _next_tag(grid: TileGrid) -> int:
    """A fresh odd tag for one exchange of ``grid``'s tile group (its backward uses tag + 1).

    Counted per tile group, not per process: a rank that also works in another group (a MASTER
    rank holding two stages) must not shift the tags its partners in this group expect.
    """
    return 2 * (next(_CALLS.setdefault(grid.ranks, itertools.count())) % _TAG_SPACE) + 1


class TileTooSmallError(ValueError):
    """A tile is too small for the halo or output split an op needs."""


# ------------------------------------------------------------------------------------------
# the exchange primitive


def _intersect(a: Window, b: Window) -> Window | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def _rel(box: Window, origin: Sequence[int]) -> tuple[slice, ...]:
    return (slice(None), slice(None)) + tuple(
        slice(lo - o, hi - o) for (lo, hi), o in zip(box, origin, strict=True)
    )


def _plan(grid: TileGrid, windows: Sequence[Window]) -> tuple[list[tuple[int, Window]], list[tuple[int, Window]], Window | None]:
    """(receive from, send to, local) boxes of this rank: lists of (tile index, box)."""
    me = grid.index
    owned = [grid.tile_bounds(grid.coords_of(q)) for q in range(len(grid.ranks))]
    recv: list[tuple[int, Window]] = []
    send: list[tuple[int, Window]] = []
    for q in range(len(grid.ranks)):
        if q == me:
            continue
        rb = _intersect(windows[me], owned[q])
        if rb is not None:
            recv.append((q, rb))
        sb = _intersect(windows[q], owned[me])
        if sb is not None:
            send.append((q, sb))
    return recv, send, _intersect(windows[me], owned[me])


def _exchange(x: Tensor, grid: TileGrid, plan: Any, group: dist.ProcessGroup | None, tag: int) -> list[Tensor]:
    """Send my slabs of the others' windows; receive the slabs of mine they own (in ``recv`` order)."""
    recv, send, _ = plan
    mine = [lo for lo, _ in grid.tile_bounds()]
    lead = tuple(x.shape[:2])
    reqs = []
    bufs: list[Tensor] = []
    for q, box in recv:
        buf = x.new_empty(lead + tuple(hi - lo for lo, hi in box))
        reqs.append(dist.irecv(buf, src=grid.ranks[q], group=group, tag=tag))
        bufs.append(buf)
    keep = []
    for q, box in send:
        t = x[_rel(box, mine)].contiguous()
        keep.append(t)
        reqs.append(dist.isend(t, dst=grid.ranks[q], group=group, tag=tag))
    for r in reqs:
        if r is not None:
            r.wait()
    return bufs


def _assemble(x: Tensor, bufs: Sequence[Tensor], grid: TileGrid, window: Window, plan: Any, fill: float) -> Tensor:
    """The window from my tile and the received slabs; ``fill`` outside the image."""
    recv, _, local = plan
    origin = [lo for lo, _ in window]
    mine = [lo for lo, _ in grid.tile_bounds()]
    out = x.new_full(tuple(x.shape[:2]) + tuple(hi - lo for lo, hi in window), fill)
    if local is not None:
        out[_rel(local, origin)] = x[_rel(local, mine)]
    for (_, box), buf in zip(recv, bufs, strict=True):
        out[_rel(box, origin)] = buf
    return out


def _return_grads(grad: Tensor, x_shape: Sequence[int], grid: TileGrid, window: Window, plan: Any,
                  group: dist.ProcessGroup | None, tag: int) -> Tensor:
    """Adjoint of :func:`_exchange` + :func:`_assemble`: send each received slab's gradient to its
    owner, and add what comes back (gradients of the slabs I sent) into my tile's gradient."""
    recv, send, local = plan
    origin = [lo for lo, _ in window]
    mine = [lo for lo, _ in grid.tile_bounds()]
    lead = tuple(grad.shape[:2])
    gx = grad.new_zeros(tuple(x_shape))
    reqs = []
    bufs: list[tuple[Window, Tensor]] = []
    for q, box in send:  # I sent them this slab: its gradient comes back to me
        buf = grad.new_empty(lead + tuple(hi - lo for lo, hi in box))
        reqs.append(dist.irecv(buf, src=grid.ranks[q], group=group, tag=tag))
        bufs.append((box, buf))
    keep = []
    for q, box in recv:  # they own this slab of my window: send its gradient home
        t = grad[_rel(box, origin)].contiguous()
        keep.append(t)
        reqs.append(dist.isend(t, dst=grid.ranks[q], group=group, tag=tag))
    if local is not None:
        gx[_rel(local, mine)] += grad[_rel(local, origin)]
    for r in reqs:
        if r is not None:
            r.wait()
    for box, buf in bufs:
        gx[_rel(box, mine)] += buf
    return gx


class _FetchWindow(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        grid: TileGrid,
        windows: tuple[Window, ...],
        group: dist.ProcessGroup | None,
        fill: float,
        tag: int,
    ) -> Tensor:
        plan = _plan(grid, windows)
        ctx.grid, ctx.window, ctx.group, ctx.tag, ctx.plan = grid, windows[grid.index], group, tag, plan
        ctx.x_shape = tuple(x.shape)
        return _assemble(x, _exchange(x, grid, plan, group, tag), grid, windows[grid.index], plan, fill)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None, None]:  # type: ignore[override]
        gx = _return_grads(grad, ctx.x_shape, ctx.grid, ctx.window, ctx.plan, ctx.group, ctx.tag + 1)
        return gx, None, None, None, None, None


class _WindowOp(torch.autograd.Function):
    """``op(window)`` that saves only the tile and the received halo slabs, not the window.

    A conv or pool on the fetched window would save the window: a second copy of the tile (the
    op before usually saved the tile already) plus the halo. This function rebuilds the window
    in backward from what it saved (a copy, no communication). Convolutions then run ATen's
    ``convolution_backward`` on it (no recomputation); other ops are recomputed on the window
    (pooling: cheap).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, grid: TileGrid,
        windows: tuple[Window, ...], group: dist.ProcessGroup | None, fill: float, tag: int,
        op: Callable[..., Tensor], conv: tuple[Any, ...] | None,
    ) -> Tensor:
        plan = _plan(grid, windows)
        bufs = _exchange(x, grid, plan, group, tag)
        win = windows[grid.index]
        xw = _assemble(x, bufs, grid, win, plan, fill)
        y = op(xw, weight, bias)
        ctx.grid, ctx.window, ctx.group, ctx.tag, ctx.plan, ctx.fill = grid, win, group, tag, plan, fill
        ctx.op, ctx.conv, ctx.nbufs, ctx.has_bias = op, conv, len(bufs), bias is not None
        ctx.bias_shape = tuple(bias.shape) if bias is not None else None
        ctx.save_for_backward(x, weight, *bufs)
        return y

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, weight, *bufs = ctx.saved_tensors
        xw = _assemble(x, bufs, ctx.grid, ctx.window, ctx.plan, ctx.fill)
        gw = gb = None
        if ctx.conv is not None:
            stride, dilation, groups = ctx.conv
            n = xw.dim() - 2
            mask = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]), bool(ctx.needs_input_grad[2])]
            gxw, gw, gb = torch.ops.aten.convolution_backward(
                gy.contiguous(), xw, weight, list(ctx.bias_shape) if ctx.has_bias else None, list(stride), [0] * n,
                list(dilation), False, [0] * n, groups, mask)
        elif not ctx.needs_input_grad[0]:
            gxw = None
        else:
            with torch.enable_grad():
                xr = xw.detach().requires_grad_(True)
                (gxw,) = torch.autograd.grad(ctx.op(xr, weight, None), xr, gy)
        # no input gradient (the input is data): every rank of the group skips the exchange alike
        gx = None if gxw is None else _return_grads(gxw, x.shape, ctx.grid, ctx.window, ctx.plan, ctx.group,
                                                    ctx.tag + 1)
        return gx, gw, gb, None, None, None, None, None, None, None


def _window_op(x_tile: Tensor, grid: TileGrid, windows: Sequence[Window], group: dist.ProcessGroup | None,
               op: Callable[..., Tensor], *, weight: Tensor | None = None, bias: Tensor | None = None,
               fill: float = 0.0, conv: tuple[Any, ...] | None = None) -> Tensor:
    """``op(window, weight, bias)`` over this rank's fetched window, saving no window copy."""
    _check_tile(x_tile, grid, "window op")
    out: Tensor = _WindowOp.apply(x_tile, weight, bias, grid, tuple(tuple(w) for w in windows), group, float(fill),
                                  _next_tag(grid), op, conv)
    return out


def _check_tile(x: Tensor, grid: TileGrid, op: str) -> None:
    if x.dim() != grid.ndim + 2 or tuple(x.shape[2:]) != grid.tile_shape():
        raise ValueError(
            f"{op}: input tile of shape {tuple(x.shape)} on rank {grid.rank} does not match tile "
            f"{grid.coords} of spatial shape {grid.tile_shape()} (image {grid.shape} cut {grid.grid}); "
            f"pass the tile this rank owns, (N, C, *spatial)"
        )


def fetch_window(
    x_tile: Tensor,
    grid: TileGrid,
    windows: Sequence[Window],
    group: dist.ProcessGroup | None = None,
    fill: float = 0.0,
) -> Tensor:
    """Gather this rank's input window from whichever ranks own it (autograd-aware).

    Args:
        x_tile: this rank's tile ``(N, C, *tile)``.
        grid: the tile geometry of ``x_tile``.
        windows: the window of EVERY tile, in rank (row-major) order; each is per-dim
            ``[start, stop)`` in full-image coordinates and may leave the image.
        group: the tile group (``None``: the world).
        fill: value of the window outside the image (the op's padding).

    Returns:
        ``(N, C, *window sizes)``: the input over this rank's window. Collective: every rank
        of the group must call it with the same ``windows``. The backward sends the window's
        gradient back to the owners and adds it into their input gradients.
    """
    _check_tile(x_tile, grid, "fetch_window")
    if len(windows) != len(grid.ranks):
        raise ValueError(f"fetch_window: got {len(windows)} windows for {len(grid.ranks)} tiles")
    tag = _next_tag(grid)
    out: Tensor = _FetchWindow.apply(x_tile, grid, tuple(tuple(w) for w in windows), group, float(fill), tag)
    return out


def _windows(grid: TileGrid, per_dim: Callable[[int, int], tuple[int, int]]) -> tuple[Window, ...]:
    """Every tile's window from ``per_dim(dim, coord) -> [start, stop)``."""
    cache = [[per_dim(d, c) for c in range(grid.grid[d])] for d in range(grid.ndim)]
    return tuple(tuple(cache[d][cs[d]] for d in range(grid.ndim)) for cs in grid.all_coords())


def halo_exchange(
    x_tile: Tensor,
    grid: TileGrid,
    halo: Sequence[tuple[int, int]],
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """The tile padded by ``halo[d] = (lo, hi)`` pixels per spatial dim, from the neighbours.

    Faces, edges and corners come from the neighbouring tiles; where the tile touches the
    image boundary the pad is zero (the op's zero padding). The backward adds the halo's
    gradient into the neighbours' input gradients.

    Raises:
        TileTooSmallError: a halo is wider than the neighbouring tile it must come from.
    """
    _check_tile(x_tile, grid, "halo_exchange")
    h = [(int(a), int(b)) for a, b in halo]
    if len(h) != grid.ndim:
        raise ValueError(f"halo_exchange: halo {tuple(halo)} needs one (lo, hi) per spatial dim ({grid.ndim})")
    for d in range(grid.ndim):
        lo, hi = h[d]
        if lo < 0 or hi < 0:
            raise ValueError(f"halo_exchange: halo {h[d]} along dim {d} must be >= 0")
        for c in range(grid.grid[d]):
            size = grid.bounds(d, c)[1] - grid.bounds(d, c)[0]
            need = max(lo if c < grid.grid[d] - 1 else 0, hi if c > 0 else 0)
            if need > size:
                raise TileTooSmallError(
                    f"halo_exchange: halo {h[d]} along spatial dim {d} is wider than tile {c} "
                    f"({size} px of {grid.shape[d]} cut into {grid.grid[d]}); the tile too small for "
                    f"this halo: use fewer parts along that dim or a larger image"
                )
    wins = _windows(grid, lambda d, c: (grid.bounds(d, c)[0] - h[d][0], grid.bounds(d, c)[1] + h[d][1]))
    return fetch_window(x_tile, grid, wins, group)


# ------------------------------------------------------------------------------------------
# window geometry


def _tup(v: Any, n: int) -> tuple[int, ...]:
    if isinstance(v, (tuple, list)):
        if len(v) != n:
            raise ValueError(f"expected {n} values, got {tuple(v)}")
        return tuple(int(x) for x in v)
    return (int(v),) * n


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


def _conv_pads(conv: nn.Module, n: int, k: Sequence[int], d: Sequence[int]) -> list[tuple[int, int]]:
    p = conv.padding
    if p == "valid":
        return [(0, 0)] * n
    if p == "same":
        out = []
        for i in range(n):
            total = d[i] * (k[i] - 1)
            out.append((total // 2, total - total // 2))
        return out
    return [(q, q) for q in _tup(p, n)]


def _conv(x_tile: Tensor, conv: nn.Module, grid: TileGrid, group: dist.ProcessGroup | None) -> tuple[Tensor, TileGrid]:
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
    k, s, d = _tup(conv.kernel_size, n), _tup(conv.stride, n), _tup(conv.dilation, n)
    pads = _conv_pads(conv, n, k, d)
    out_shape = [(grid.shape[i] + pads[i][0] + pads[i][1] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(n)]
    og = _out_grid(grid, out_shape, f"conv_tile({op})")
    wins = _strided_windows(grid, og, k, s, d, [p[0] for p in pads])
    fn = _CONV_FN[n]
    groups = conv.groups
    y = _window_op(x_tile, grid, wins, group, lambda xw, w, b: fn(xw, w, b, s, 0, d, groups),
                   weight=conv.weight, bias=conv.bias, conv=(s, d, groups))
    return y, og


def conv_tile(x_tile: Tensor, conv: nn.Module, grid: TileGrid, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's output tile of ``conv`` (nn.Conv1d/2d/3d, any kernel, stride, dilation,
    groups, zero padding incl. 'same'/'valid'); equals that region of ``conv(full)``."""
    return _conv(x_tile, conv, grid, group)[0]


def _conv_transpose(x_tile: Tensor, conv: nn.Module, grid: TileGrid, group: dist.ProcessGroup | None) -> tuple[Tensor, TileGrid]:
    op = type(conv).__name__
    if not isinstance(conv, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        raise TypeError(f"conv_transpose_tile: {op} is not nn.ConvTranspose1d/2d/3d")
    n = grid.ndim
    _check_tile(x_tile, grid, f"conv_transpose_tile({op})")
    if conv.padding_mode != "zeros":
        raise NotImplementedError(f"conv_transpose_tile: {op}(padding_mode={conv.padding_mode!r}) is not tiled")
    k, s, d = _tup(conv.kernel_size, n), _tup(conv.stride, n), _tup(conv.dilation, n)
    p, op_ = _tup(conv.padding, n), _tup(conv.output_padding, n)
    out_shape = [(grid.shape[i] - 1) * s[i] - 2 * p[i] + d[i] * (k[i] - 1) + op_[i] + 1 for i in range(n)]
    og = _out_grid(grid, out_shape, f"conv_transpose_tile({op})")

    def per_dim(i: int, c: int) -> tuple[int, int]:
        # input i feeds outputs i*s - p + j*d, j in [0, k)
        o0, o1 = og.bounds(i, c)
        a = max(0, -((-(o0 + p[i] - d[i] * (k[i] - 1))) // s[i]))
        b = min(grid.shape[i], (o1 - 1 + p[i]) // s[i] + 1)
        return a, max(a, b)

    wins = _windows(grid, per_dim)
    xw = fetch_window(x_tile, grid, wins, group)
    mine = og.tile_bounds()
    win = wins[grid.index]
    if any(b <= a for a, b in win):  # only bias (or nothing) reaches this output tile
        shape = tuple(xw.shape[:1]) + (conv.out_channels,) + tuple(b - a for a, b in mine)
        y = xw.new_zeros(shape) + xw.sum() * 0  # keep the exchange in the graph: its backward is collective
    else:
        y = _CONVT_FN[n](xw, conv.weight, None, s, 0, 0, conv.groups, d)
        pad: list[int] = []
        for i in reversed(range(n)):  # F.pad lists the last dim first; negative pads crop
            ys = win[i][0] * s[i] - p[i]
            ye = ys + y.shape[2 + i]
            pad += [ys - mine[i][0], mine[i][1] - ye]
        y = F.pad(y, pad)
    if conv.bias is not None:
        y = y + conv.bias.view((1, -1) + (1,) * n)
    return y, og


def conv_transpose_tile(x_tile: Tensor, conv: nn.Module, grid: TileGrid, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's output tile of ``conv`` (nn.ConvTranspose1d/2d/3d, stride, dilation,
    padding, output_padding, groups); equals that region of ``conv(full)``."""
    return _conv_transpose(x_tile, conv, grid, group)[0]


def _pool_out(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    num = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil else 0)
    out = num // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


def _sum_pool(x: Tensor, k: Sequence[int], s: Sequence[int]) -> Tensor:
    n = x.dim() - 2
    if n == 1:
        return F.avg_pool2d(x.unsqueeze(2), (1, k[0]), (1, s[0]), divisor_override=1).squeeze(2)
    if n == 2:
        return F.avg_pool2d(x, tuple(k), tuple(s), divisor_override=1)
    return F.avg_pool3d(x, tuple(k), tuple(s), divisor_override=1)


_MAXPOOL_FN: dict[int, Callable[..., Tensor]] = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def _pool(x_tile: Tensor, pool: nn.Module, grid: TileGrid, group: dist.ProcessGroup | None) -> tuple[Tensor, TileGrid]:
    op = type(pool).__name__
    n = grid.ndim
    is_max = isinstance(pool, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d))
    if not is_max and not isinstance(pool, (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        raise TypeError(f"pool_tile: {op} is not MaxPool1d/2d/3d or AvgPool1d/2d/3d")
    _check_tile(x_tile, grid, f"pool_tile({op})")
    k = _tup(pool.kernel_size, n)
    s = _tup(pool.stride if pool.stride not in (None, (), []) else pool.kernel_size, n)
    p = _tup(pool.padding, n)
    d = _tup(getattr(pool, "dilation", 1), n) if is_max else (1,) * n
    if is_max and pool.return_indices:
        raise NotImplementedError(f"pool_tile: {op}(return_indices=True) is not tiled (indices are tile-local)")
    ceil = bool(pool.ceil_mode)
    out_shape = [_pool_out(grid.shape[i], k[i], s[i], p[i], d[i], ceil) for i in range(n)]
    og = _out_grid(grid, out_shape, f"pool_tile({op})")
    wins = _strided_windows(grid, og, k, s, d, p)
    if is_max:
        mp = _MAXPOOL_FN[n]
        return _window_op(x_tile, grid, wins, group, lambda xw, w, b: mp(xw, k, s, 0, d), fill=-math.inf), og
    total = _window_op(x_tile, grid, wins, group, lambda xw, w, b: _sum_pool(xw, k, s))
    div_override = getattr(pool, "divisor_override", None)
    if div_override:
        return total / div_override, og
    win = wins[grid.index]
    lo_b = [-p[i] if pool.count_include_pad else 0 for i in range(n)]
    hi_b = [grid.shape[i] + (p[i] if pool.count_include_pad else 0) for i in range(n)]
    mask = x_tile.new_ones((1, 1) + tuple(hi - lo for lo, hi in win))
    for i in range(n):
        idx = torch.arange(win[i][0], win[i][1], device=x_tile.device)
        m = ((idx >= lo_b[i]) & (idx < hi_b[i])).to(x_tile.dtype)
        mask = mask * m.view((1, 1) + tuple(-1 if j == i else 1 for j in range(n)))
    return total / _sum_pool(mask, k, s), og


def pool_tile(x_tile: Tensor, pool: nn.Module, grid: TileGrid, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's output tile of MaxPool/AvgPool (kernel, stride, padding, dilation for max,
    ceil_mode, count_include_pad, divisor_override); equals that region of ``pool(full)``."""
    return _pool(x_tile, pool, grid, group)[0]


def _upsample_sizes(up: nn.Upsample, grid: TileGrid) -> tuple[list[int], list[float | None]]:
    n = grid.ndim
    if up.size is not None:
        return list(_tup(up.size, n)), [None] * n
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


def _upsample(x_tile: Tensor, up: nn.Module, grid: TileGrid, group: dist.ProcessGroup | None) -> tuple[Tensor, TileGrid]:
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
    xw = fetch_window(x_tile, grid, wins, group)
    y = xw
    win = wins[grid.index]
    for i in range(n):
        o0, o1 = og.bounds(i, grid.coords[i])
        i0 = (maps[i][0][o0:o1] - win[i][0]).to(x_tile.device)
        lam = maps[i][2]
        if lam is None:
            y = y.index_select(2 + i, i0)
        else:
            i1 = (maps[i][1][o0:o1] - win[i][0]).to(x_tile.device)
            l1 = lam[o0:o1].to(device=x_tile.device, dtype=x_tile.dtype)
            shape = tuple(-1 if j == i else 1 for j in range(n))
            l1 = l1.view((1, 1) + shape)
            y = y.index_select(2 + i, i0) * (1 - l1) + y.index_select(2 + i, i1) * l1
    return y, og


def upsample_tile(x_tile: Tensor, up: nn.Module, grid: TileGrid, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's output tile of ``nn.Upsample`` (nearest, nearest-exact, (bi/tri)linear with
    align_corners True or False, size or scale_factor); equals that region of ``up(full)``."""
    return _upsample(x_tile, up, grid, group)[0]


# ------------------------------------------------------------------------------------------
# norms: statistics reduced over the tiles


class _TileNorm(torch.autograd.Function):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` with statistics over ``dims`` of EVERY tile.

    Sums and centred sums of squares are all-reduced over the tile group (counts from the real,
    uneven tiles). Like ATen's norms it saves only the input and the per-channel statistics, not
    the normalised tensor; its backward all-reduces the two per-channel sums it needs.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, dims: list[int],  # type: ignore[override]
                group: dist.ProcessGroup | None, eps: float, stats: list[tuple[Tensor, Tensor, Tensor]]) -> Tensor:
        local_n = math.prod(x.shape[i] for i in dims)
        s = x.sum(dim=dims, keepdim=True)
        packed = torch.cat([s.reshape(-1), s.new_full((1,), float(local_n))])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        count = packed[-1]
        mean = packed[:-1].reshape(s.shape) / count
        y = x - mean
        sq = (y * y).sum(dim=dims, keepdim=True).reshape(-1)
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
        var = sq.reshape(s.shape) / count
        rstd = torch.rsqrt(var + eps)
        y.mul_(rstd)
        if weight is not None:
            y.mul_(weight)
        if bias is not None:
            y.add_(bias)
        stats.append((mean, var, count))
        ctx.dims, ctx.group, ctx.count = dims, group, float(count)
        ctx.has_weight = weight is not None
        ctx.bias_shape = tuple(bias.shape) if bias is not None else None
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, weight, mean, rstd = ctx.saved_tensors
        dims = ctx.dims
        xhat = (x - mean) * rstd
        gw = (gy * xhat).sum_to_size(weight.shape) if ctx.has_weight and ctx.needs_input_grad[1] else None
        gb = gy.sum_to_size(ctx.bias_shape) if ctx.bias_shape is not None and ctx.needs_input_grad[2] else None
        gx = None
        if ctx.needs_input_grad[0]:
            gxhat = gy * weight if ctx.has_weight else gy
            a = gxhat.sum(dim=dims, keepdim=True)
            b = (gxhat * xhat).sum(dim=dims, keepdim=True)
            packed = torch.cat([a.reshape(-1), b.reshape(-1)])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=ctx.group)
            a_all = packed[: a.numel()].reshape(a.shape) / ctx.count
            b_all = packed[a.numel():].reshape(b.shape) / ctx.count
            gx = (gxhat - a_all - xhat * b_all) * rstd
        return gx, gw, gb, None, None, None, None


def _tile_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, dims: list[int],
               group: dist.ProcessGroup | None, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(normalised x, mean, biased var, count); weight and bias broadcast against ``x``."""
    stats: list[tuple[Tensor, Tensor, Tensor]] = []
    y: Tensor = _TileNorm.apply(x, weight, bias, dims, group, float(eps), stats)
    mean, var, count = stats[0]
    return y, mean, var, count


def _bcast(p: Tensor | None, nd: int) -> Tensor | None:
    """A per-channel parameter viewed as (1, C, 1, ...) for an ``nd``-dim tensor."""
    return None if p is None else p.view((1, -1) + (1,) * (nd - 2))


def _update_running(rm: Tensor, rv: Tensor, mean: Tensor, var: Tensor, count: Tensor, factor: float) -> None:
    with torch.no_grad():
        unbiased = var * (count / (count - 1)) if float(count) > 1 else var
        rm.mul_(1 - factor).add_(mean.to(rm.dtype), alpha=factor)
        rv.mul_(1 - factor).add_(unbiased.to(rv.dtype), alpha=factor)


def batchnorm_tile(x_tile: Tensor, bn: nn.Module, group: dist.ProcessGroup | None = None) -> Tensor:
    """Full-image BatchNorm on a tile: training statistics are reduced over ALL tiles.

    Output, input gradient and (summed) affine gradients equal BatchNorm of the unsplit
    tensor; running statistics are updated as the full-image BatchNorm would (unbiased
    variance with the full count, momentum or cumulative average).
    """
    if not isinstance(bn, nn.modules.batchnorm._BatchNorm):
        raise TypeError(f"batchnorm_tile: {type(bn).__name__} is not a BatchNorm module")
    if x_tile.shape[1] != bn.num_features:
        raise ValueError(f"batchnorm_tile: input has {x_tile.shape[1]} channels, {type(bn).__name__} {bn.num_features}")
    use_batch = bn.training or bn.running_mean is None
    if not use_batch:  # eval with running stats: a pointwise op
        return F.batch_norm(x_tile, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
    dims = [0] + list(range(2, x_tile.dim()))
    nd = x_tile.dim()
    y, mean, var, count = _tile_norm(x_tile, _bcast(bn.weight, nd), _bcast(bn.bias, nd), dims, group, bn.eps)
    if bn.training and bn.track_running_stats and bn.running_mean is not None:
        assert bn.running_var is not None and bn.num_batches_tracked is not None
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else float(bn.momentum)
        _update_running(bn.running_mean, bn.running_var, mean.reshape(-1), var.reshape(-1), count, factor)
    return y


def groupnorm_tile(x_tile: Tensor, gn: nn.Module, group: dist.ProcessGroup | None = None) -> Tensor:
    """Full-image GroupNorm on a tile (per-sample, per-group statistics over all tiles)."""
    if not isinstance(gn, nn.GroupNorm):
        raise TypeError(f"groupnorm_tile: {type(gn).__name__} is not nn.GroupNorm")
    n, c = x_tile.shape[:2]
    g = gn.num_groups
    sp = tuple(x_tile.shape[2:])
    xr = x_tile.reshape((n, g, c // g) + sp)
    shape = (1, g, c // g) + (1,) * len(sp)
    w = None if gn.weight is None else gn.weight.view(shape)
    b = None if gn.bias is None else gn.bias.view(shape)
    y, _, _, _ = _tile_norm(xr, w, b, list(range(2, xr.dim())), group, gn.eps)
    return y.reshape(x_tile.shape)


def instancenorm_tile(x_tile: Tensor, inorm: nn.Module, group: dist.ProcessGroup | None = None) -> Tensor:
    """Full-image InstanceNorm on a tile (per-sample, per-channel statistics over all tiles;
    running statistics, when tracked, updated as F.instance_norm does)."""
    if not isinstance(inorm, nn.modules.instancenorm._InstanceNorm):
        raise TypeError(f"instancenorm_tile: {type(inorm).__name__} is not an InstanceNorm module")
    use_batch = inorm.training or not inorm.track_running_stats
    if not use_batch:
        return F.instance_norm(x_tile, inorm.running_mean, inorm.running_var, inorm.weight, inorm.bias,
                               False, 0.0, inorm.eps)
    dims = list(range(2, x_tile.dim()))
    nd = x_tile.dim()
    w, b = (_bcast(inorm.weight, nd), _bcast(inorm.bias, nd)) if inorm.affine else (None, None)
    y, mean, var, count = _tile_norm(x_tile, w, b, dims, group, inorm.eps)
    if inorm.training and inorm.track_running_stats and inorm.running_mean is not None:
        assert inorm.running_var is not None
        unbiased = var * (count / (count - 1)) if float(count) > 1 else var
        with torch.no_grad():
            m = float(inorm.momentum) if inorm.momentum is not None else 0.1
            inorm.running_mean.mul_(1 - m).add_(mean.reshape(mean.shape[:2]).mean(0), alpha=m)
            inorm.running_var.mul_(1 - m).add_(unbiased.reshape(var.shape[:2]).mean(0), alpha=m)
    return y


# ------------------------------------------------------------------------------------------
# dispatch and weight gradients

_POINTWISE: tuple[type, ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Identity,
    nn.PReLU, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
)


def tile_forward(
    module: nn.Module, x_tile: Tensor, grid: TileGrid, group: dist.ProcessGroup | None = None
) -> tuple[Tensor, TileGrid]:
    """Run a supported module (or an nn.Sequential of them) on a tile; return the output
    tile and its grid. Raises NotImplementedError naming the module otherwise."""
    if isinstance(module, nn.Sequential):
        for m in module:
            x_tile, grid = tile_forward(m, x_tile, grid, group)
        return x_tile, grid
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return _conv(x_tile, module, grid, group)
    if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return _conv_transpose(x_tile, module, grid, group)
    if isinstance(module, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        return _pool(x_tile, module, grid, group)
    if isinstance(module, nn.Upsample):
        return _upsample(x_tile, module, grid, group)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return batchnorm_tile(x_tile, module, group), grid
    if isinstance(module, nn.GroupNorm):
        return groupnorm_tile(x_tile, module, group), grid
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return instancenorm_tile(x_tile, module, group), grid
    if isinstance(module, _POINTWISE):
        return module(x_tile), grid
    raise NotImplementedError(
        f"tile_forward: {type(module).__name__} is not tiled; end the spatial region before it "
        f"(gather the tiles with TileGrid.gather)"
    )


def sum_weight_grads(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """All-reduce (SUM, never average) every parameter gradient of ``module`` over the tiles.

    Each rank's ``.grad`` holds its tile's contribution; afterwards every rank holds the
    gradient of the unsplit op. Parameters that require grad but have none get a zero
    gradient first, so that every rank takes part in the same collective.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for ps in by_dtype.values():
        grads = [p.grad for p in ps if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
