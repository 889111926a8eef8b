"""The vocabulary of a plan request, read by every layer of the partitioner: what the user pins
and asks for (``PlanRequest``), one configuration to solve (``Candidate``) and the enumeration of
candidates (``candidate``), the tile grids a candidate may use (``grids``), and the recompute and
offload settings (``lever_options``), and the memory a plan keeps back on each GPU (``reserve``).
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.partitioner.config.candidate import Candidate, PlanRequest

__all__ = ["PlanRequest", "Candidate"]

__getattr__ = lazy_exports(__name__, {"Candidate": "candidate", "PlanRequest": "candidate"})
