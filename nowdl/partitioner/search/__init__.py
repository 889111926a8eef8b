"""The configuration search: which stages, tiles, replicas and copies to solve, and the Plan it emits.

The candidates themselves are ``partitioner.config``; ``model_space`` is what the model allows;
``bounds`` bounds each candidate so only those that can win are solved; ``search`` runs it;
``assemble`` builds the Plan; ``infeasible`` says, with figures, why nothing fits;
``halo_fusion`` chooses the runs of a spatial stage that exchange one deeper halo; ``levers`` chooses the stages that
recompute or offload; ``segments`` shortens a lever to a recomputed prefix of the stage where
that fits with less added time.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.partitioner.search.best_plan import SearchResult, search
    from nowdl.partitioner.search.halo_fusion import fusion

__all__ = ["search", "SearchResult", "fusion"]

__getattr__ = lazy_exports(__name__, {
    "SearchResult": "best_plan", "search": "best_plan", "fusion": "halo_fusion",
})
