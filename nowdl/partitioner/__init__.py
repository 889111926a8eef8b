"""The partitioner: the best split of a traced, profiled model into stages, tiles and copies.

``solve`` is the entry point for one configuration: it coarsens the graph, splits exactly where
that is cheap (``exact``) and otherwise solves the MILP (``milp``), with GEMS-MASTER pairing in
``master``; the DPs, the pairing and the MILP share the min-max chain DP in ``chain``.
``config`` holds the vocabulary every layer reads (``PlanRequest``, ``Candidate``, tile grids,
lever settings); ``costs`` turns a profile and a candidate into the Problem every solver reads;
``search`` tries configurations, chooses halo fusion and assembles the Plan; ``spatial`` says
which nodes may run on tiles; ``placement`` puts the plan's parts on a cluster's ranks;
``baselines`` holds torchgpipe's block partition and other simple splits to compare against.

Sub-packages import one way, lowest first (``SUBLAYERS`` in tests/test_layering.py checks it):
spatial, config, placement, chain, costs, master, exact, milp, baselines, solver, search.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.partitioner.costs.problem import NodeVectors, Partition, Problem, StageSpec, evaluate
    from nowdl.partitioner.exact.coarsen import coarsen, expand
    from nowdl.partitioner.exact.order_dp import solve_dp
    from nowdl.partitioner.milp.solve import available_solvers, solve_ilp
    from nowdl.partitioner.solver import solve

__all__ = [
    "NodeVectors", "StageSpec", "Problem", "Partition", "evaluate",
    "solve", "solve_ilp", "solve_dp", "coarsen", "expand", "available_solvers",
]

__getattr__ = lazy_exports(__name__, {
    "NodeVectors": "costs.problem", "Partition": "costs.problem", "Problem": "costs.problem",
    "StageSpec": "costs.problem", "evaluate": "costs.problem", "coarsen": "exact.coarsen",
    "expand": "exact.coarsen", "solve_dp": "exact.order_dp", "available_solvers": "milp.solve",
    "solve_ilp": "milp.solve", "solve": "solver",
})
