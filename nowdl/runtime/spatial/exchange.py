"""Halo exchange: each rank fetches the input window its output tile reads (autograd-aware).

Every rank of a tile group holds one tile of an ``(N, C, *spatial)`` tensor (see
:class:`nowdl.runtime.spatial.tiles.TileGrid`). An op with a spatial footprint computes the output
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
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nowdl.geometry import TileTooSmallError
from nowdl.runtime.launch import comm
from nowdl.runtime.spatial.tiles import TileGrid

__all__ = ["Window", "fetch_window", "halo_exchange", "TileTooSmallError"]

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


# ------------------------------------------------------------------------------------------
# the exchange primitive


def intersect(a: Window, b: Window) -> Window | None:
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
        rb = intersect(windows[me], owned[q])
        if rb is not None:
            recv.append((q, rb))
        sb = intersect(windows[q], owned[me])
        if sb is not None:
            send.append((q, sb))
    return recv, send, intersect(windows[me], owned[me])


class Pending:
    """Posted non-blocking sends and receives: :meth:`wait` completes them all.

    ``bufs`` are the receive buffers (in plan order); ``keep`` holds the sent slabs until the
    sends complete. Between posting and waiting the caller may compute anything that does not
    read ``bufs`` (gloo and NCCL progress the transfers in the background).
    """

    def __init__(self, reqs: list[Any], bufs: list[Any], keep: list[Tensor]) -> None:
        self.reqs, self.bufs, self.keep = reqs, bufs, keep

    def wait(self) -> None:
        for r in self.reqs:
            if r is not None:
                r.wait()
        self.reqs, self.keep = [], []


def _post_exchange(x: Tensor, grid: TileGrid, plan: Any, group: dist.ProcessGroup | None, tag: int) -> Pending:
    """Post the sends of my slabs of the others' windows and the receives of the slabs of mine
    they own (``Pending.bufs`` in ``recv`` order); returns before they complete."""
    recv, send, _ = plan
    mine = [lo for lo, _ in grid.tile_bounds()]
    lead = tuple(x.shape[:2])
    reqs = []
    bufs: list[Tensor] = []
    for q, box in recv:
        buf = x.new_empty(lead + tuple(hi - lo for lo, hi in box))
        reqs.append(comm.irecv(buf, src=grid.ranks[q], group=group, tag=tag))
        bufs.append(buf)
    keep = []
    for q, box in send:
        t = x[_rel(box, mine)].contiguous()
        keep.append(t)
        reqs.append(comm.isend(t, dst=grid.ranks[q], group=group, tag=tag))
    return Pending(reqs, bufs, keep)


def _exchange(x: Tensor, grid: TileGrid, plan: Any, group: dist.ProcessGroup | None, tag: int) -> list[Tensor]:
    """Send my slabs of the others' windows; receive the slabs of mine they own (in ``recv`` order)."""
    pending = _post_exchange(x, grid, plan, group, tag)
    pending.wait()
    return pending.bufs


def _assemble(x: Tensor, bufs: Sequence[Tensor], grid: TileGrid, window: Window, plan: Any, fill: float) -> Tensor:
    """The window from my tile and the received slabs; ``fill`` outside the image."""
    return _put_received(_local_window(x, grid, window, plan, fill), bufs, window, plan)


def _local_window(x: Tensor, grid: TileGrid, window: Window, plan: Any, fill: float) -> Tensor:
    """The window with my tile's part copied in and ``fill`` everywhere else (halo not yet in)."""
    local = plan[2]
    origin = [lo for lo, _ in window]
    mine = [lo for lo, _ in grid.tile_bounds()]
    out = x.new_full(tuple(x.shape[:2]) + tuple(hi - lo for lo, hi in window), fill)
    if local is not None:
        out[_rel(local, origin)] = x[_rel(local, mine)]
    return out


def _put_received(out: Tensor, bufs: Sequence[Tensor], window: Window, plan: Any) -> Tensor:
    """Copy the received slabs into the window ``out`` (in place); returns it."""
    origin = [lo for lo, _ in window]
    for (_, box), buf in zip(plan[0], bufs, strict=True):
        out[_rel(box, origin)] = buf
    return out


def _sub_window(x: Tensor, bufs: Sequence[Tensor], grid: TileGrid, window: Window, plan: Any, fill: float,
                span: Sequence[tuple[int, int]], local: bool = True) -> Tensor:
    """The part ``span`` (per dim ``[a, b)`` from the window's start) of the assembled window,
    from my tile ``x`` and the received slabs (``local=False``: ``fill`` where my tile is)."""
    origin = [lo for lo, _ in window]
    sub: Window = tuple((o + a, o + b) for o, (a, b) in zip(origin, span, strict=True))
    start = [lo for lo, _ in sub]
    out = x.new_full(tuple(x.shape[:2]) + tuple(b - a for a, b in span), fill)
    pieces = [(box, buf, [lo for lo, _ in box]) for (_, box), buf in zip(plan[0], bufs, strict=True)]
    if local and plan[2] is not None:
        pieces.append((plan[2], x, [lo for lo, _ in grid.tile_bounds()]))
    for box, src, src_start in pieces:
        part = intersect(box, sub)
        if part is not None:
            out[_rel(part, start)] = src[_rel(part, src_start)]
    return out


def _post_return(grad: Tensor, x_shape: Sequence[int], grid: TileGrid, window: Window, plan: Any,
                 group: dist.ProcessGroup | None, tag: int, own: bool = False) -> tuple[Tensor, Pending]:
    """First half of :func:`_return_grads`: post the sends of each received slab's gradient to its
    owner and the receives of my sent slabs' gradients; add the local part. Finish with
    :func:`_finish_return` (in between, compute what does not need the returned gradients).

    ``own``: ``grad`` is the caller's fresh tensor, free to change; when the window covers my whole
    tile the tile's gradient is then a view of it (no tile-sized buffer at the backward peak).
    """
    recv, send, local = plan
    origin = [lo for lo, _ in window]
    mine = [lo for lo, _ in grid.tile_bounds()]
    if own and local == grid.tile_bounds():
        gx = grad[_rel(local, origin)]
        local = None
    else:
        gx = grad.new_zeros(tuple(x_shape))
    pending = _post_slabs([grad[_rel(box, origin)].contiguous() for _, box in recv], grad, grid, plan, group, tag)
    if local is not None:
        gx[_rel(local, mine)] += grad[_rel(local, origin)]
    return gx, pending


def _post_slabs(slabs: Sequence[Tensor], like: Tensor, grid: TileGrid, plan: Any, group: dist.ProcessGroup | None,
                tag: int) -> Pending:
    """Post the return of the gradients ``slabs`` of the received slabs (``plan`` ``recv`` order,
    contiguous) to their owners, and the receives of my sent slabs' gradients (``Pending.bufs``:
    (box, buffer) pairs for :func:`_finish_return`; dtype, device, batch and channels of ``like``)."""
    recv, send, _ = plan
    reqs = []
    bufs: list[tuple[Window, Tensor]] = []
    for q, box in send:  # I sent them this slab: its gradient comes back to me
        buf = like.new_empty(tuple(like.shape[:2]) + tuple(hi - lo for lo, hi in box))
        reqs.append(comm.irecv(buf, src=grid.ranks[q], group=group, tag=tag))
        bufs.append((box, buf))
    for (q, _), t in zip(recv, slabs, strict=True):  # they own this slab of my window: send its gradient home
        reqs.append(comm.isend(t, dst=grid.ranks[q], group=group, tag=tag))
    return Pending(reqs, bufs, list(slabs))


def _finish_return(gx: Tensor, pending: Pending, grid: TileGrid) -> Tensor:
    """Second half of :func:`_return_grads`: wait, then add the returned gradients into ``gx``."""
    pending.wait()
    mine = [lo for lo, _ in grid.tile_bounds()]
    for box, buf in pending.bufs:
        gx[_rel(box, mine)] += buf
    return gx


def _return_grads(grad: Tensor, x_shape: Sequence[int], grid: TileGrid, window: Window, plan: Any,
                  group: dist.ProcessGroup | None, tag: int, own: bool = False) -> Tensor:
    """Adjoint of :func:`_exchange` + :func:`_assemble`: send each received slab's gradient to its
    owner, and add what comes back (gradients of the slabs I sent) into my tile's gradient."""
    gx, pending = _post_return(grad, x_shape, grid, window, plan, group, tag, own)
    return _finish_return(gx, pending, grid)


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
    owned = [grid.tile_bounds(grid.coords_of(q)) for q in range(len(grid.ranks))]
    if all(tuple(w) == o for w, o in zip(windows, owned, strict=True)):
        return x_tile  # every window is its own tile (a stride-2 upsampling, say): no exchange, no copy
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

