"""Spatial rules for planning: which nodes may run on tiles, their halos, and the
ops whose result depends on the whole image.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.partitioner.spatial.tileable import SpatialRule, slice_grid, spatial_rules
    from nowdl.partitioner.spatial.whole_image import whole_image_ops, why_whole
    from nowdl.partitioner.spatial.whole_values import pooled_groups

__all__ = ["SpatialRule", "spatial_rules", "slice_grid", "whole_image_ops", "why_whole", "pooled_groups"]

__getattr__ = lazy_exports(__name__, {
    "SpatialRule": "tileable", "slice_grid": "tileable", "spatial_rules": "tileable",
    "whole_image_ops": "whole_image", "why_whole": "whole_image", "pooled_groups": "whole_values",
})
