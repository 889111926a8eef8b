"""Graph partitioning: the ILP, its DP fallback, spatial rules, configuration search, Plan."""

from nowdl.partitioner.coarsen import coarsen, expand
from nowdl.partitioner.dp import solve_dp
from nowdl.partitioner.ilp import available_solvers, solve_ilp
from nowdl.partitioner.plan import Plan
from nowdl.partitioner.problem import NodeVectors, Partition, Problem, StageSpec, evaluate
from nowdl.partitioner.solve import solve

__all__ = [
    "NodeVectors", "StageSpec", "Problem", "Partition", "evaluate", "Plan",
    "solve", "solve_ilp", "solve_dp", "coarsen", "expand", "available_solvers",
]
