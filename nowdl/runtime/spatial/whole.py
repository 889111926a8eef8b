"""Whole values on tiles: sizes of the whole image, pooling over every tile, pooled features back
to tiles ([Note: whole values on tiles] in ``nowdl/partitioner/spatial/whole_values.py``).

:func:`whole_view` stands in for a tile where a node reads a tensor's sizes; :func:`pool_tiles`
averages the whole image into bins that every rank of the tile group holds alike (one all-reduce
forward, one backward); :func:`upsample_whole` gives this rank's tile of an upsampled whole value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from nowdl.errors import NowdlError
from nowdl.geometry import ntuple
from nowdl.partitioner.spatial.whole_values import mean_dims
from nowdl.runtime.launch import comm
from nowdl.runtime.spatial.graph_ops import ATEN_UP, INTERP_ARGS, bind
from nowdl.runtime.spatial.norms import _group_slot
from nowdl.runtime.spatial.tiled_ops import _linear_index, _nearest_index, _upsample_sizes
from nowdl.runtime.spatial.tiles import TileGrid

__all__ = ["whole_view", "pool_tiles", "pool_node", "upsample_whole", "whole_upsample"]


def whole_view(tile: Tensor, grid: TileGrid) -> Tensor:
    """A meta tensor shaped like the whole image ``tile`` is part of: what size reads see."""
    return torch.empty((*tile.shape[:2], *grid.shape), dtype=tile.dtype, device="meta")


def _bins(length: int, bins: int, lo: int, hi: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """(membership of pixels [lo, hi) in each of ``bins`` adaptive-pooling bins of a ``length``
    axis, bin sizes): ATen's bins [floor(j L / b), ceil((j + 1) L / b))."""
    j = torch.arange(bins)
    start, end = (j * length) // bins, -((-(j + 1) * length) // bins)
    pix = torch.arange(lo, hi)
    member = (pix[None, :] >= start[:, None]) & (pix[None, :] < end[:, None])
    return member.to(dtype=dtype, device=device), (end - start).to(dtype=dtype, device=device)


def _along(x: Tensor, dim: int, m: Tensor) -> Tensor:
    """``x`` with its ``dim`` contracted against the columns of ``m`` (rows: the new ``dim``)."""
    return torch.matmul(x.movedim(dim, -1), m.T).movedim(-1, dim)


def _sum_slots(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """The sum over the group of every rank's ``t``, the same bits on every rank: each rank's
    share in its own slot of a zero buffer, one all-reduce, then one sum in slot order."""
    slot, size = _group_slot(group)
    buf = t.new_zeros((size, *t.shape))
    buf[slot] = t
    comm.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return buf.sum(0)


class _PoolTiles(torch.autograd.Function):
    """Adaptive average pooling of the whole image from its tiles: per-bin sums of this tile,
    summed over the group, over the bins' sizes. Backward: the group's summed gradient (each
    rank holds its tile's share), spread over this tile's pixels of each bin."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, grid: TileGrid, bins: tuple[int, ...],  # type: ignore[override]
                group: dist.ProcessGroup | None) -> Tensor:
        acc = x.dtype if x.dtype == torch.float64 else torch.float32
        members, sizes = [], []
        part = x.to(acc)
        for i, b in enumerate(bins):
            lo, hi = grid.bounds(i)
            m, s = _bins(grid.shape[i], b, lo, hi, acc, x.device)
            members.append(m)
            sizes.append(s)
            part = part.sum(2 + i, keepdim=True) if b == 1 else _along(part, 2 + i, m)
        count_t = sizes[0]  # the bins' pixel counts, (b0, b1, ...)
        for s in sizes[1:]:
            count_t = count_t[..., None] * s
        y = _sum_slots(part, group) / count_t
        ctx.grid, ctx.group, ctx.members, ctx.count, ctx.dtype = grid, group, members, count_t, x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        g = _sum_slots(gy.to(ctx.count.dtype), ctx.group) / ctx.count
        for i, m in enumerate(ctx.members):
            g = _along(g, 2 + i, m.T)
        return g.to(ctx.dtype), None, None, None


def pool_tiles(x: Tensor, grid: TileGrid, bins: Sequence[int], group: dist.ProcessGroup | None,
               what: str) -> Tensor:
    """Adaptive average pooling of the whole image (``bins`` per spatial dim) from this rank's
    tile: the same tensor on every rank of ``group``."""
    if len(bins) != grid.ndim:
        raise NowdlError(f"node {what!r} pools into {list(bins)} bins over a tile of {grid.ndim} spatial dims: "
                         "it must pool every spatial dim; re-plan with the spatial region ending before it")
    y: Tensor = _PoolTiles.apply(x, grid, tuple(int(b) for b in bins), group)
    return y


def upsample_whole(x: Tensor, up: nn.Upsample, grid_of: Callable[[Sequence[int]], TileGrid]) -> tuple[Tensor, TileGrid]:
    """This rank's tile of ``up(x)`` for a whole (untiled) ``x``, and the output's grid
    (``grid_of`` of its spatial shape): the index maps of ``upsample_tile``, one dim at a time."""
    n = x.dim() - 2
    one = TileGrid(tuple(int(s) for s in x.shape[2:]), (1,) * n, (0,) * n, (0,))
    out_shape, sfs = _upsample_sizes(up, one)
    og = grid_of(out_shape)
    mode = str(up.mode)
    y = x
    for i in range(n):
        o0, o1 = og.bounds(i)
        if mode in ("nearest", "nearest-exact"):
            idx = _nearest_index(one.shape[i], out_shape[i], sfs[i], mode == "nearest-exact")[o0:o1]
            y = y.index_select(2 + i, idx.to(x.device))
            continue
        i0, i1, lam = _linear_index(one.shape[i], out_shape[i], sfs[i], bool(up.align_corners), x.dtype)
        l1 = lam[o0:o1].to(device=x.device, dtype=y.dtype).view((1, 1) + tuple(-1 if j == i else 1 for j in range(n)))
        y = (y.index_select(2 + i, i0[o0:o1].to(x.device)) * (1 - l1)
             + y.index_select(2 + i, i1[o0:o1].to(x.device)) * l1)
    return y, og


def pool_node(gm: fx.GraphModule, node: fx.Node, args: Any, kwargs: dict[str, Any], grid: TileGrid,
              group: dist.ProcessGroup | None) -> Tensor:
    """Run a pooled node (adaptive average pooling, or a mean over the spatial dims) on a tile."""
    x, n = args[0], grid.ndim
    dims = mean_dims(node)
    keep = True
    if node.op == "call_module":
        size: Any = gm.get_submodule(str(node.target)).output_size
    elif dims is not None:
        if sorted(d % x.dim() for d in dims) != list(range(2, x.dim())):
            raise NowdlError(f"node {node.name!r} takes a mean over dims {dims} of a {x.dim()}-dim tile: on tiles only "
                             "a mean over every spatial dim is reduced; re-plan with the spatial region ending before it")
        size, keep = 1, bool(kwargs.get("keepdim", args[2] if len(args) > 2 else False))
    else:
        size = kwargs.get("output_size", args[1] if len(args) > 1 else None)
    y = pool_tiles(x, grid, ntuple(size, n), group, node.name)
    return y if keep else y.reshape(y.shape[:2])


def whole_upsample(gm: fx.GraphModule, node: fx.Node, args: Any, kwargs: dict[str, Any]) -> nn.Upsample | None:
    """The nn.Upsample a node computes (module, F.interpolate or ATen upsampling), else None."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        return m if isinstance(m, nn.Upsample) else None
    if node.op == "call_function" and node.target is F.interpolate:
        opts = bind(args[1:], kwargs, INTERP_ARGS)
        opts.pop("antialias", None)
        return nn.Upsample(**opts)
    if node.op == "call_function" and node.target in ATEN_UP:
        mode = ATEN_UP[node.target]
        rest = list(args[1:]) + [None] * 3
        align = None if mode == "nearest" else bool(rest[1])
        scales = rest[1] if mode == "nearest" else rest[2]
        if rest[0]:
            return nn.Upsample(size=tuple(int(v) for v in rest[0]), mode=mode, align_corners=align)
        return nn.Upsample(scale_factor=tuple(float(v) for v in scales), mode=mode, align_corners=align)
    return None
