"""Tile geometry of a spatial stage: which part of the image each rank of a tile group holds.

A spatial stage cuts the spatial dims of an ``(N, C, *spatial)`` tensor into a grid of tiles
(``nowdl.partitioner.spatial.tileable.slice_grid`` gives the grid, e.g. square P=4 -> ``(2, 2)``). The
group's ranks are laid out over the grid in row-major order::

    grid (2, 3), ranks (r0..r5)          rows split 17 -> 9 + 8, cols 23 -> 8 + 8 + 7

        cols [0,8)  [8,16)  [16,23)
    rows +-------+-------+-------+
    [0,9)|  r0   |  r1   |  r2   |      tile (0, 1) is rank r1; its neighbour at offsets
         +-------+-------+-------+      (+1, +1) (the corner below right) is r5
    [9,17)| r3   |  r4   |  r5   |
         +-------+-------+-------+

Sizes that do not divide give tiles that differ by at most one pixel (the first ``size % n``
tiles are one larger); this is never an error. A grid with more tiles than pixels along a
dim gives empty tiles there; the ops in :mod:`nowdl.runtime.spatial` refuse that with a clear
message.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nowdl.geometry import split_bounds  # re-exported: it lives with the other pure geometry
from nowdl.runtime.launch import comm

__all__ = ["TileGrid", "TiledInput", "split_bounds", "group_ranks"]


def group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks of ``group`` (the whole world for ``None``), in group-rank order."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


@dataclass(frozen=True)
class TileGrid:
    """One rank's view of a tiled ``(N, C, *spatial)`` tensor.

    Attributes:
        shape: the full (unsplit) spatial shape, e.g. ``(H, W)`` or ``(D, H, W)``.
        grid: the number of tiles along each spatial dim (same length as ``shape``).
        coords: this rank's tile coordinates in ``grid``.
        ranks: the global ranks of the tile group, row-major over ``grid``.
    """

    shape: tuple[int, ...]
    grid: tuple[int, ...]
    coords: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.shape)
        if len(self.grid) != n or len(self.coords) != n:
            raise ValueError(
                f"TileGrid: shape {self.shape}, grid {self.grid} and coords {self.coords} must "
                f"have one entry per spatial dim"
            )
        if any(g < 1 for g in self.grid):
            raise ValueError(f"TileGrid: grid {self.grid} needs at least one tile per dim")
        if math.prod(self.grid) != len(self.ranks):
            raise ValueError(
                f"TileGrid: grid {self.grid} has {math.prod(self.grid)} tiles but the group has "
                f"{len(self.ranks)} ranks {self.ranks}; use a grid whose product is the group size"
            )
        if any(not 0 <= c < g for c, g in zip(self.coords, self.grid, strict=True)):
            raise ValueError(f"TileGrid: coords {self.coords} lie outside grid {self.grid}")

    # ----------------------------------------------------------------------------------------
    # construction

    @classmethod
    def for_rank(
        cls,
        shape: Sequence[int],
        grid: Sequence[int],
        rank: int | None = None,
        ranks: Sequence[int] | None = None,
    ) -> TileGrid:
        """The grid seen by global ``rank`` (default: this process) among ``ranks``.

        ``ranks`` defaults to ``0 .. prod(grid) - 1``. ``grid`` may be shorter than ``shape``
        (leading spatial dims are then not cut), as :func:`slice_grid` returns for 2D methods.
        """
        shape_t = tuple(int(s) for s in shape)
        grid_t = tuple(int(g) for g in grid)
        if len(grid_t) > len(shape_t):
            raise ValueError(f"TileGrid.for_rank: grid {grid_t} has more dims than shape {shape_t}")
        grid_t = (1,) * (len(shape_t) - len(grid_t)) + grid_t
        ranks_t = tuple(range(math.prod(grid_t))) if ranks is None else tuple(int(r) for r in ranks)
        if rank is None:
            rank = dist.get_rank()
        if rank not in ranks_t:
            raise ValueError(f"TileGrid.for_rank: rank {rank} is not in the tile group {ranks_t}")
        index = ranks_t.index(rank)
        return cls(shape_t, grid_t, _unravel(index, grid_t), ranks_t)

    def with_shape(self, shape: Sequence[int]) -> TileGrid:
        """The same grid and coordinates over another full spatial shape (an op's output)."""
        return TileGrid(tuple(int(s) for s in shape), self.grid, self.coords, self.ranks)

    # ----------------------------------------------------------------------------------------
    # geometry

    @property
    def ndim(self) -> int:
        """Number of spatial dims."""
        return len(self.shape)

    @property
    def index(self) -> int:
        """This tile's row-major index (its position in ``ranks``)."""
        return _ravel(self.coords, self.grid)

    @property
    def rank(self) -> int:
        """This tile's global rank."""
        return self.ranks[self.index]

    def bounds(self, dim: int, coord: int | None = None) -> tuple[int, int]:
        """``[start, stop)`` along spatial ``dim`` of this tile (or of tile ``coord`` there)."""
        c = self.coords[dim] if coord is None else coord
        return split_bounds(self.shape[dim], self.grid[dim], c)

    def tile_bounds(self, coords: Sequence[int] | None = None) -> tuple[tuple[int, int], ...]:
        """Per-dim ``[start, stop)`` of this tile, or of the tile at ``coords``."""
        cs = self.coords if coords is None else tuple(coords)
        return tuple(self.bounds(d, cs[d]) for d in range(self.ndim))

    def tile_shape(self, coords: Sequence[int] | None = None) -> tuple[int, ...]:
        """Spatial size of this tile (or of the tile at ``coords``)."""
        return tuple(b - a for a, b in self.tile_bounds(coords))

    def all_coords(self) -> Iterator[tuple[int, ...]]:
        """Every tile's coordinates in row-major (rank) order."""
        for i in range(len(self.ranks)):
            yield _unravel(i, self.grid)

    def coords_of(self, index: int) -> tuple[int, ...]:
        """Coordinates of the tile with row-major ``index``."""
        return _unravel(index, self.grid)

    def neighbour(self, offsets: Sequence[int]) -> int | None:
        """Global rank of the tile at ``coords + offsets`` (corners included), or ``None``.

        ``None`` means the offset leaves the grid (this tile touches the image boundary there).
        """
        if len(offsets) != self.ndim:
            raise ValueError(f"neighbour offsets {tuple(offsets)} need one entry per spatial dim ({self.ndim})")
        cs = tuple(c + int(o) for c, o in zip(self.coords, offsets, strict=True))
        if any(not 0 <= c < g for c, g in zip(cs, self.grid, strict=True)):
            return None
        return self.ranks[_ravel(cs, self.grid)]

    # ----------------------------------------------------------------------------------------
    # data

    def split(self, full: Tensor) -> Tensor:
        """This rank's tile of a full ``(N, C, *spatial)`` tensor (a view)."""
        self._check_full(full, "split")
        idx = (slice(None), slice(None)) + tuple(slice(a, b) for a, b in self.tile_bounds())
        return full[idx]

    def gather(self, tile: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
        """The full tensor from every rank's tile (all-gather of uneven tiles: pad, then trim).

        Differentiable: every rank gets the whole tensor, and the backward returns this rank's
        region of the incoming gradient. That is the exact gradient when the ranks continue
        with the same (replicated) computation on the gathered tensor, as at the end of a
        spatial region; do not sum the replicated loss over the ranks. One tile is the tensor.
        """
        if len(self.ranks) == 1:
            return tile
        return _Gather.apply(tile, self, group)

    def _check_full(self, full: Tensor, what: str) -> None:
        if tuple(full.shape[2:]) != self.shape:
            raise ValueError(
                f"TileGrid.{what}: tensor of shape {tuple(full.shape)} does not have the grid's "
                f"spatial shape {self.shape} after (N, C)"
            )


def _ravel(coords: Sequence[int], grid: Sequence[int]) -> int:
    i = 0
    for c, g in zip(coords, grid, strict=True):
        i = i * g + c
    return i


def _unravel(index: int, grid: Sequence[int]) -> tuple[int, ...]:
    out: list[int] = []
    for g in reversed(grid):
        index, c = divmod(index, g)
        out.append(c)
    return tuple(reversed(out))


def _gather_full(tile: Tensor, grid: TileGrid, group: dist.ProcessGroup | None) -> Tensor:
    exp = grid.tile_shape()
    if tuple(tile.shape[2:]) != exp:
        raise ValueError(
            f"TileGrid.gather: tile of shape {tuple(tile.shape)} on rank {grid.rank} should have "
            f"spatial shape {exp} (tile {grid.coords} of {grid.shape} cut {grid.grid})"
        )
    big = tuple(math.ceil(s / g) for s, g in zip(grid.shape, grid.grid, strict=True))
    padded = tile.new_zeros(tuple(tile.shape[:2]) + big)
    padded[(slice(None), slice(None)) + tuple(slice(0, s) for s in exp)] = tile
    parts = [torch.empty_like(padded) for _ in grid.ranks]
    comm.all_gather(parts, padded.contiguous(), group=group)
    full = tile.new_empty(tuple(tile.shape[:2]) + grid.shape)
    for i, part in enumerate(parts):
        b = grid.tile_bounds(grid.coords_of(i))
        src = (slice(None), slice(None)) + tuple(slice(0, hi - lo) for lo, hi in b)
        dst = (slice(None), slice(None)) + tuple(slice(lo, hi) for lo, hi in b)
        full[dst] = part[src]
    return full


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, tile: Tensor, grid: TileGrid,
                group: dist.ProcessGroup | None) -> Tensor:
        ctx.grid = grid  # type: ignore[attr-defined]
        return _gather_full(tile, grid, group)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
        grid: TileGrid = ctx.grid  # type: ignore[attr-defined]
        return grid.split(grad).contiguous(), None, None


class TiledInput:
    """A global batch that each rank reads only its own tile of (images too large to load whole).

    Pass it to ``train_step``/``eval_step`` instead of a tensor. ``read(index)`` gets a tuple of
    slices over ``(N, C, *spatial)`` and returns that region as a tensor; the engine asks for the
    micro-batch rows and the tile its spatial stage owns (the whole image only on ranks of a
    non-spatial stage that takes the input). Anything sliceable works: a numpy memmap, a zarr or
    h5py array, or a function that reads a region of a whole-slide image::

        x = TiledInput.from_array(np.load("slides.npy", mmap_mode="r"))   # (N, C, H, W) on disk
        cm.train_step(x, y)

    Args:
        shape: the full batch shape ``(N, C, *spatial)``.
        read: ``read(index) -> Tensor`` for a tuple of ``slice`` objects, one per dim.
        dtype: the dtype of what ``read`` returns (for planning; default float32).
    """

    def __init__(self, shape: Sequence[int], read: Callable[[tuple[slice, ...]], Tensor],
                 dtype: torch.dtype = torch.float32) -> None:
        self.shape = torch.Size(int(s) for s in shape)
        if len(self.shape) < 3:
            raise ValueError(f"TiledInput: shape {tuple(self.shape)} must be (N, C, *spatial)")
        self._read = read
        self.dtype = dtype
        self._rows = (0, self.shape[0])

    @classmethod
    def from_array(cls, array: Any, dtype: torch.dtype = torch.float32) -> TiledInput:
        """Wrap anything indexable by a tuple of slices (numpy, memmap, zarr, h5py, a tensor)."""
        def read(idx: tuple[slice, ...]) -> Tensor:
            v = array[idx]
            return v.to(dtype) if isinstance(v, Tensor) else torch.tensor(v, dtype=dtype)  # a copy: read-only is fine

        return cls(tuple(array.shape), read, dtype)

    def dim(self) -> int:
        return len(self.shape)

    def rows(self, start: int, stop: int) -> TiledInput:
        """Samples ``[start, stop)`` of this batch (nothing is read)."""
        out = TiledInput(self.shape, self._read, self.dtype)
        lo = self._rows[0] + start
        out._rows = (lo, self._rows[0] + stop)
        out.shape = torch.Size((stop - start,) + tuple(self.shape[1:]))
        return out

    def read(self, bounds: Sequence[tuple[int, int]] | None = None) -> Tensor:
        """The region ``bounds`` (per spatial dim ``[start, stop)``; None: the whole image)."""
        sp = [(0, s) for s in self.shape[2:]] if bounds is None else list(bounds)
        idx = (slice(*self._rows), slice(None)) + tuple(slice(a, b) for a, b in sp)
        t = self._read(idx)
        want = (self.shape[0], self.shape[1]) + tuple(b - a for a, b in sp)
        if tuple(t.shape) != want:
            raise ValueError(f"TiledInput.read returned shape {tuple(t.shape)} for index {idx}, expected {want}")
        return t

    def meta(self) -> Tensor:
        """A meta tensor of this shape and dtype (for tracing and planning; holds no data)."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")
