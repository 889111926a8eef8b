"""Exact and near-exact splits by dynamic programming.

``order_dp`` splits one topological order; ``ideal_dp`` and ``downsets`` split over the DAG's
ideals; ``wait_search`` adds long-skip gradient waits, ``window_dp`` and ``wait_refine``
charge them in the anytime split's last step (the min-max DP and the lexicographic levels they
share with the MASTER pairing are ``partitioner.chain``); ``coarsen``, ``coarse_groups`` and ``coarse_dp`` shrink wide
graphs, ``coarse_check`` proves a coarse optimum for the whole graph; ``local_search`` improves
a heuristic split near its cuts.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.partitioner.exact.coarsen import expand
    from nowdl.partitioner.exact.order_dp import solve_dp

__all__ = ["solve_dp", "expand"]

__getattr__ = lazy_exports(__name__, {
    "solve_dp": "order_dp", "expand": "coarsen",
})
