"""The configuration search: which stages, tiles, replicas and copies to solve, and the Plan it emits.

``config`` holds what the user pins and the candidates; ``model_space`` what the model allows;
``bounds`` bounds each candidate so only those that can win are solved; ``search`` runs it;
``assemble`` builds the Plan; ``infeasible`` says, with figures, why nothing fits;
``lever_options`` checks the recompute/offload settings and ``levers`` chooses the stages that
recompute or offload; ``segments`` shortens a lever to a recomputed prefix of the stage where
that fits with less added time.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.partitioner.search.best_plan import SearchResult, search
    from nowdl.partitioner.search.config import Candidate, PlanRequest

__all__ = ["PlanRequest", "Candidate", "search", "SearchResult"]

__getattr__ = lazy_exports(__name__, {
    "Candidate": "config", "PlanRequest": "config", "SearchResult": "best_plan", "search": "best_plan",
})
