"""The pipeline engine: one rank runs its schedule of forward and backward actions.

``engine`` composes the parts below and dispatches each action by kind; ``runner`` runs a
forward, backward or weight-gradient action; ``transfers`` sends and receives the tensors that
cross stages; ``grad_sync`` all-reduces gradients and steps the optimizer; ``rank_view`` holds
what one rank runs of the plan; ``micro_batches`` cuts a global batch; ``output_roots`` keeps
the autograd edge of a stage's outputs until their backward; ``deferred_wgrad`` splits a
backward for zero bubble; ``recompute`` reruns a stage's forward in its backward instead of
keeping its activations (``segment``: only some of its nodes'), ``offload`` keeps them in host
memory; ``ranks`` maps plan parts to global ranks.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.runtime.pipeline.engine import PipelineEngine
    from nowdl.runtime.pipeline.ranks import Placement

__all__ = ["PipelineEngine", "Placement"]

__getattr__ = lazy_exports(__name__, {
    "PipelineEngine": "engine", "Placement": "ranks",
})
