"""Graph partitioning: the ILP, its DP fallback, spatial rules, configuration search, Plan."""

from nowdl.partitioner.problem import NodeVectors, Partition, Problem, StageSpec, evaluate

__all__ = ["NodeVectors", "StageSpec", "Problem", "Partition", "evaluate"]
