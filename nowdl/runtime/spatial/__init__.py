"""Spatial parallelism at run time: a stage runs on image tiles, exactly.

``tiles`` says which part of the image each rank holds; ``exchange`` fetches the halo a tile's
output reads (autograd-aware); ``tiled_ops`` and ``window_op`` run convs, pools and upsampling on
a tile; ``norms`` runs BatchNorm/GroupNorm/InstanceNorm over the whole image; ``dispatch``
picks the tiled form of a module; ``fusion`` exchanges one deeper halo for a run of ops;
``stage`` runs a stage's fx graph on tiles; ``sequential`` runs a stage as T sub-tiles one after
another per rank (``tiles_per_gpu``), each the whole stage on a window whose margin ``reach``
measures, its norms with the whole image's statistics (``statistics``); ``precision`` picks each tiled op's dtype under autocast; ``graph_ops`` maps
functional pools and interpolation to modules; ``dropout`` keys dropout masks by image coordinates.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.runtime.spatial.dispatch import sum_weight_grads, tile_forward
    from nowdl.runtime.spatial.exchange import (
        TileTooSmallError,
        Window,
        fetch_window,
        halo_exchange,
    )
    from nowdl.runtime.spatial.norms import batchnorm_tile, groupnorm_tile, instancenorm_tile
    from nowdl.runtime.spatial.tiles import TiledInput, TileGrid
    from nowdl.runtime.spatial.window_op import halo_overlap, set_halo_overlap

__all__ = ["Window", "fetch_window", "halo_exchange", "TileTooSmallError", "batchnorm_tile", "groupnorm_tile", "instancenorm_tile", "tile_forward", "sum_weight_grads", "set_halo_overlap", "halo_overlap", "TileGrid", "TiledInput"]

__getattr__ = lazy_exports(__name__, {
    "TileTooSmallError": "exchange", "Window": "exchange", "fetch_window": "exchange",
    "halo_exchange": "exchange", "batchnorm_tile": "norms",
    "groupnorm_tile": "norms", "instancenorm_tile": "norms", "sum_weight_grads": "dispatch",
    "tile_forward": "dispatch", "halo_overlap": "window_op", "set_halo_overlap": "window_op",
    "TileGrid": "tiles", "TiledInput": "tiles",
})
