"""The partitioning MILP (PuLP, solved by HiGHS or CBC).

``model`` builds it from ``terms``, with each stage's memory, time and work from
``load_rows``; ``stage_windows`` narrows every node's stage range;
``lp_bound`` bounds the bottleneck from below; ``run`` runs a model on a solver; ``solve``
solves the primary bottleneck and then the later lexicographic levels.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.partitioner.milp.solve import available_solvers, solve_ilp

__all__ = ["solve_ilp", "available_solvers"]

__getattr__ = lazy_exports(__name__, {
    "available_solvers": "solve", "solve_ilp": "solve",
})
