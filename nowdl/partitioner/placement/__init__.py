"""Placement: which global rank holds which part of a plan on a cluster of nodes (the traffic
between nodes it causes is a cost: ``partitioner.costs.traffic``).
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.partitioner.placement.layout import Layout, place

__all__ = ["Layout", "place"]

__getattr__ = lazy_exports(__name__, {
    "Layout": "layout", "place": "layout",
})
