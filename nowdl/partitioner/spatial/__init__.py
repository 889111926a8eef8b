"""Spatial rules for planning: which nodes may run on tiles, their halos, and halo fusion.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.partitioner.spatial.halo_fusion import plan_fusion
    from nowdl.partitioner.spatial.tileable import SpatialRule, slice_grid, spatial_rules

__all__ = ["SpatialRule", "spatial_rules", "slice_grid", "plan_fusion"]

__getattr__ = lazy_exports(__name__, {
    "SpatialRule": "tileable", "slice_grid": "tileable", "spatial_rules": "tileable",
    "plan_fusion": "halo_fusion",
})
