"""Which rank writes what of a window when each keeps its own output tile (no gather)."""

from __future__ import annotations

import torch

from nowdl.runtime.predict.shares import tile_piece
from nowdl.runtime.predict.windows import Window
from nowdl.runtime.spatial.tiles import TileGrid


def _grid(shape: tuple[int, int], grid: tuple[int, int], coords: tuple[int, int]) -> TileGrid:
    return TileGrid(shape, grid, coords, tuple(range(grid[0] * grid[1])))


def test_tiles_on_chunk_edges_write_their_own_part() -> None:
    w = Window(read=((0, 512), (0, 256)), core=((0, 512), (0, 256)))
    for r, rows in ((0, (0, 256)), (1, (256, 512))):
        g = _grid((512, 256), (2, 1), (r, 0))
        tile = torch.arange(256 * 256, dtype=torch.float32).reshape(1, 1, 256, 256) + r
        share, piece = tile_piece((g, None), tile, w.core, (256, 256), w, (1, 1))
        assert share == (rows, (0, 256))
        assert piece is not None and torch.equal(piece, tile[0])


def test_a_window_margin_is_cut_from_the_tile() -> None:
    # input rows 0..640 read, rows 0..512 written (the rest is the next window's margin); tiles of 320 rows
    w = Window(read=((0, 640), (0, 256)), core=((0, 512), (0, 256)))
    g0, g1 = _grid((640, 256), (2, 1), (0, 0)), _grid((640, 256), (2, 1), (1, 0))
    t = torch.zeros(1, 2, 320, 256)
    assert tile_piece((g0, None), t, w.core, (256, 256), w, (1, 1)) == (None, None)  # 320 is not a chunk edge
    w2 = Window(read=((0, 768), (0, 256)), core=((0, 512), (0, 256)))
    g0, g1 = _grid((768, 256), (3, 1), (0, 0)), _grid((768, 256), (3, 1), (2, 0))
    share, piece = tile_piece((g0, None), torch.ones(1, 2, 256, 256), w2.core, (256, 256), w2, (1, 1))
    assert share == ((0, 256), (0, 256)) and piece is not None and piece.shape == (2, 256, 256)
    share, piece = tile_piece((g1, None), torch.ones(1, 2, 256, 256), w2.core, (256, 256), w2, (1, 1))
    assert share == () and piece is None  # the third tile holds only the margin


def test_no_grid_means_the_output_is_whole() -> None:
    w = Window(read=((0, 64), (0, 64)), core=((0, 64), (0, 64)))
    assert tile_piece(None, torch.zeros(1, 1, 64, 64), w.core, (64, 64), w, (1, 1)) == (None, None)
