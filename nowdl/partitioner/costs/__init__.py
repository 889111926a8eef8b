"""The cost model: a profile and a configuration as a partitioning Problem of plain numbers.

``problem`` holds the Problem and its Partition; ``costmodel`` builds it and predicts the step;
``structure`` is what every solver needs (order, stage ranges, loads); ``held_tensors`` and
``skip_waits`` are the boundary tensors a stage holds at its peak; ``memory_breakdown`` splits a
stage's peak by term; ``no_idle`` is the rule that every stage gets work; ``levers`` is what
recomputing a stage or offloading its activations to host memory costs and saves;
``tile_overhead`` is the spatial runtime's own work per tiled op.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.partitioner.costs.problem import NodeVectors, Partition, Problem, StageSpec, evaluate

__all__ = ["NodeVectors", "StageSpec", "Problem", "Partition", "evaluate"]

__getattr__ = lazy_exports(__name__, {
    "NodeVectors": "problem", "Partition": "problem", "Problem": "problem", "StageSpec": "problem",
    "evaluate": "problem",
})
