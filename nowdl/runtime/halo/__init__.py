"""Exact tiled ops: halo exchange, tiled conv/pool/upsample, tile norms, and their dispatch.

Every rank of a tile group holds one tile of an ``(N, C, *spatial)`` tensor (see
:class:`nowdl.runtime.tiles.TileGrid`) and computes the matching tile of each op's output:

* :mod:`~nowdl.runtime.halo.exchange`: the primitive, :func:`fetch_window` (every rank gets
  the input window its output tile reads, from whichever ranks own it; the backward returns
  the window's gradient to them), and :func:`halo_exchange` (a fixed halo around the tile).
* :mod:`~nowdl.runtime.halo.window_op`: convs and pools on a window, the exchange overlapped by
  the interior compute (:func:`set_halo_overlap` turns that off).
* :mod:`~nowdl.runtime.halo.tiled_ops`: conv, transposed conv, max/avg pooling, upsampling.
* :mod:`~nowdl.runtime.halo.norms`: batch/group/instance norm with statistics over all tiles.
* :mod:`~nowdl.runtime.halo.dispatch`: :func:`tile_forward` (any supported module) and
  :func:`sum_weight_grads` (SUM the weight gradients over the tile group).

The pure window arithmetic (output sizes, paddings, :class:`TileTooSmallError`) lives in
:mod:`nowdl.geometry`, below the planner and the runtime. This package only re-exports.
"""

from nowdl.geometry import TileTooSmallError
from nowdl.runtime.halo.dispatch import sum_weight_grads, tile_forward
from nowdl.runtime.halo.exchange import Window, _intersect, fetch_window, halo_exchange
from nowdl.runtime.halo.norms import batchnorm_tile, groupnorm_tile, instancenorm_tile
from nowdl.runtime.halo.tiled_ops import conv_tile, conv_transpose_tile, pool_tile, upsample_tile
from nowdl.runtime.halo.window_op import halo_overlap, set_halo_overlap

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
    "set_halo_overlap",
    "halo_overlap",
    "sum_weight_grads",
    "TileTooSmallError",
    "_intersect",  # used by nowdl.runtime.engine
]
