"""GEMS-MASTER pairing: rank r holds stage r of one replica and stage K-1-r of the mirrored one.

``pair_loads`` gives each rank's pair load; ``pairing`` searches splits by exact half-steps;
``exact`` proves them with a pair DP and a Lagrangian bound.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.partitioner.master.pairing import master_split

__all__ = ["master_split"]

__getattr__ = lazy_exports(__name__, {
    "master_split": "pairing",
})
