"""Placement: which global rank holds which part of a plan on a cluster of nodes, and the traffic between nodes.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.partitioner.placement.layout import Layout, place
    from nowdl.partitioner.placement.traffic import format_node_map

__all__ = ["Layout", "place", "format_node_map"]

__getattr__ = lazy_exports(__name__, {
    "Layout": "layout", "place": "layout", "format_node_map": "traffic",
})
