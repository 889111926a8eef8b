"""Tracing: an nn.Module becomes a checked torch.fx graph the planner can cut anywhere.

:func:`trace` tries torch.fx, then torch.export (``exported`` turns its graph back into the
module-level form). ``check`` runs the graph against the model on the example inputs;
``functional`` removes in-place writes so every cut between stages keeps its meaning;
``deadcode`` drops values nothing uses; ``where`` names the user's source line of an error.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.trace.tracer import Traced, check_inputs, fingerprint, trace

__all__ = ["Traced", "trace", "fingerprint", "check_inputs"]

__getattr__ = lazy_exports(__name__, {
    "Traced": "tracer", "check_inputs": "tracer", "fingerprint": "tracer", "trace": "tracer",
})
