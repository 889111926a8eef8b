"""Which part of a window's output each rank writes: whole chunks, from the gathered output or from
its own tile."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from nowdl.geometry import split_bounds
from nowdl.runtime.predict.windows import Window
from nowdl.runtime.spatial.tiles import TileGrid

__all__ = ["chunk_share", "window_piece", "tile_piece"]


def chunk_share(core: Sequence[tuple[int, int]], chunks: Sequence[int], part: int, parts: int
           ) -> tuple[tuple[int, int], ...] | None:
    """This writer's whole-chunk share of ``core`` (split along the dim with the most chunks)."""
    counts = [(math.ceil(b / c) - a // c) for (a, b), c in zip(core, chunks, strict=True)]
    d = max(range(len(core)), key=lambda i: counts[i])
    lo_c, hi_c = split_bounds(counts[d], parts, part)
    if lo_c >= hi_c:
        return None
    a, b = core[d]
    first = a // chunks[d]
    lo, hi = max(a, (first + lo_c) * chunks[d]), min(b, (first + hi_c) * chunks[d])
    return tuple((lo, hi) if i == d else core[i] for i in range(len(core)))


def window_piece(share: tuple[tuple[int, int], ...] | None, out: torch.Tensor | None, w: Window, scale: Sequence[int]
           ) -> torch.Tensor | None:
    """This rank's ``share`` (output pixels) of the window output ``out`` ``(1, C, *window)``, on the host
    (copied here, on the thread that made ``out``, so a device's stream order holds)."""
    if out is None or share is None:
        return None
    rel = tuple(slice(a - r0 // f, b - r0 // f) for (a, b), (r0, _), f in zip(share, w.read, scale, strict=True))
    return out[0][(slice(None), *rel)].cpu()


def tile_piece(grid: tuple[TileGrid, Any] | None, out: torch.Tensor | None, core: Sequence[tuple[int, int]],
                chunks: Sequence[int], w: Window, scale: Sequence[int]
                ) -> tuple[tuple[tuple[int, int], ...] | None, torch.Tensor | None]:
    """This rank's part of ``core`` (output pixels) cut from its own output tile, with no gather, when every
    rank's tile meets ``core`` in a box whose edges are ``core``'s or whole chunks (so no two ranks write one
    chunk); ``(None, None)`` otherwise, or when the output is not tiled. Every rank of the grid decides alike.
    A rank whose tile misses ``core`` gets ``((), None)``."""
    if grid is None or out is None:
        return None, None
    g = grid[0]
    origin = tuple(r0 // f for (r0, _), f in zip(w.read, scale, strict=True))
    mine: tuple[tuple[int, int], ...] | None = None
    for i in range(len(g.ranks)):
        tb = g.tile_bounds(g.coords_of(i))
        box = tuple((max(lo + o, a), min(hi + o, b)) for (lo, hi), o, (a, b) in zip(tb, origin, core, strict=True))
        if any(lo >= hi for lo, hi in box):
            continue
        for (lo, hi), (a, b), ch in zip(box, core, chunks, strict=True):
            if any(e not in (a, b) and e % ch for e in (lo, hi)):
                return None, None
        if i == g.index:
            mine = box
    if mine is None:
        return (), None
    lo_t = tuple(lo + o for (lo, _), o in zip(g.tile_bounds(), origin, strict=True))
    rel = tuple(slice(a - t, b - t) for (a, b), t in zip(mine, lo_t, strict=True))
    return mine, out[0][(slice(None), *rel)].cpu()
