"""Tile grids the search may try: spatial part counts up to the GPU count, sequential tiles per GPU.

[Note: search grids] A spatial stage of P parts cuts the image by ``slice_grid(slice, P)``; the
search tries every P from 2 to the GPU count whose grid cuts the input's spatial dims evenly into
tiles of at least ``MIN_TILE`` pixels (an 8192² image: the powers of two; a 3000² one: 2, 3, 4,
5, 6, 8, ...), and 2, 4, 8 and 16 always (uneven tiles differ by a pixel; too small ones are
kept out of the ops that cannot run on them, ``candidate_problem.too_small``). With ``tiles_per_gpu``
T a stage runs the grid ``slice_grid(slice, P x T)``, each GPU its T tiles one after another: the
P x T grid must refine the P grid (each P-tile is cut into the same sub-grid, the elementwise
quotient) and cut the image evenly; T is tried in powers of two up to ``MAX_TILES_PER_GPU``
while a tile keeps at least ``MIN_TILE`` pixels per cut dim. Without a known image (tests of
the enumeration alone) the part counts are the powers of two.
"""

from __future__ import annotations

from collections.abc import Sequence

from nowdl.partitioner.spatial.tileable import slice_grid

__all__ = ["grid_of", "part_counts", "tile_counts", "sub_grid", "cuts_evenly", "MIN_TILE", "MAX_TILES_PER_GPU"]

MIN_TILE = 16  # pixels per cut dim of the smallest tile tried (input resolution)
MAX_TILES_PER_GPU = 64
_ALWAYS = (2, 4, 8, 16)


def grid_of(slice_: str, parts: int, dims: int) -> tuple[int, ...] | None:
    """``slice_grid(slice_, parts, dims)``, or None when the method cannot make that many parts."""
    try:
        return slice_grid(slice_, parts, dims)
    except ValueError:
        return None


def cuts_evenly(image: Sequence[int] | None, grid: Sequence[int]) -> bool:
    """Every spatial dim of ``image`` splits into whole tiles of at least ``MIN_TILE`` pixels
    (True when the image is unknown)."""
    if image is None:
        return True
    g = [1] * (len(image) - len(grid)) + list(grid)[-len(image):]
    return all(n % t == 0 and (t == 1 or n // t >= MIN_TILE) for n, t in zip(image, g, strict=True))


def part_counts(gpus: int, slice_: str, image: Sequence[int] | None) -> list[int]:
    """Spatial part counts (>= 2, <= ``gpus``) to try: see [Note: search grids]. 2, 4, 8 and 16
    are always tried (tiles of uneven sizes, as before counts beyond 16 were searched)."""
    dims = len(image) if image else 2
    out = []
    for p in range(2, gpus + 1):
        g = grid_of(slice_, p, dims)
        if g is None:
            continue
        if p in _ALWAYS or (image is None and p & (p - 1) == 0) or (image is not None and cuts_evenly(image, g)):
            out.append(p)
    return out


def sub_grid(slice_: str, parts: int, tiles: int, dims: int) -> tuple[int, ...] | None:
    """The grid of tiles one GPU of a ``parts``-part stage runs in turn with ``tiles`` per GPU
    (the ``parts x tiles`` grid divided by the ``parts`` grid), or None when that grid does not
    refine the ``parts`` grid."""
    whole, mine = grid_of(slice_, parts * tiles, dims), grid_of(slice_, parts, dims)
    if whole is None or mine is None or any(w % p for w, p in zip(whole, mine, strict=True)):
        return None
    return tuple(w // p for w, p in zip(whole, mine, strict=True))


def tile_counts(parts: int, slice_: str, image: Sequence[int] | None) -> list[int]:
    """Tiles per GPU (> 1) to try with ``parts`` parts: powers of two whose grid refines the
    parts' grid and cuts the image evenly ([Note: search grids]); none for an unknown image."""
    if not image:
        return []
    dims = len(image)
    out = []
    t = 2
    while t <= MAX_TILES_PER_GPU:
        g = grid_of(slice_, parts * t, dims)
        if g is not None and any(n // gi < MIN_TILE for n, gi in zip(image, g, strict=True)):
            break  # tiles only get smaller from here
        if g is not None and sub_grid(slice_, parts, t, dims) is not None and cuts_evenly(image, g):
            out.append(t)
        t *= 2
    return out
