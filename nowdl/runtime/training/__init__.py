"""Training: the trainer behind ``CompiledModel.train_step``, its state, checkpoints and metrics.

``trainer`` runs steps on the pipeline engine; ``state`` names weights and optimizer state by
the model's original names; ``checkpoint`` writes torch.distributed.checkpoint shards;
``metrics`` logs per-step loss, time and memory.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.runtime.training.checkpoint import Checkpoint, CheckpointError
    from nowdl.runtime.training.trainer import Trainer

__all__ = ["Trainer", "Checkpoint", "CheckpointError"]

__getattr__ = lazy_exports(__name__, {
    "Trainer": "trainer", "Checkpoint": "checkpoint", "CheckpointError": "checkpoint",
})
