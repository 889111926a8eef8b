"""A running job's state moved in memory from one plan's engine to another's, as a checkpoint would be.

[Note: in-memory reshard] A job re-planned while it runs ([Note: memory cap] in memory_cap.py)
goes on from the same weights, optimizer state and step on a new plan. Each rank takes what a
checkpoint of it would hold (``Trainer.snapshot``: the tensors it owns under the model's
original names, on the host), every rank gathers every rank's share, the old engine is dropped,
and the new engine reads what it holds from the gathered state by name (``Trainer.restore``, as
a resume from a checkpoint saved by another plan does). Nothing goes through the disk, so no
shared folder is needed; the whole model's state and optimizer state pass once through each
host's memory. The process keeps its RNG state, as an uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nowdl.runtime.training.checkpoint import CheckpointError

__all__ = ["HeldState", "gather_state", "release"]


class HeldState:
    """A whole job's checkpoint held in memory on every rank: what ``Trainer.restore`` reads
    (a ``state.StateSource``); reads are local."""

    def __init__(self, tensors: dict[str, torch.Tensor], record: dict[str, Any], world: int) -> None:
        self.tensors, self.record, self.world = tensors, record, world
        self.step = int(record.get("steps", 0))
        self.dir = Path("<the job's state in memory>")

    def index(self) -> Mapping[str, Any]:
        return self.tensors

    def read(self, wanted: Mapping[str, tuple[int, ...] | None], *, optional: frozenset[str] = frozenset()
             ) -> dict[str, torch.Tensor]:
        """The keys of ``wanted`` (a key in ``optional`` may be missing; the shapes must agree)."""
        out: dict[str, torch.Tensor] = {}
        for key, shape in wanted.items():
            t = self.tensors.get(key)
            if t is None:
                if key in optional:
                    continue
                raise CheckpointError(f"the re-planned engine needs {key!r}, which no rank of the old plan held: "
                                      "please report this with the two plans (nowdl run --log-dir keeps them)")
            if shape is not None and tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"the re-planned engine holds {key!r} with shape {list(shape)} but the old "
                                      f"plan had {list(t.shape)}: please report this with the two plans")
            out[key] = t
        return out


def gather_state(trainer: Any) -> HeldState:
    """Every rank's checkpoint share of ``trainer`` (a ``Trainer`` with its engine), on the host,
    gathered onto every rank (collective)."""
    tensors, record = trainer.snapshot()
    mine = {k: v.detach().to("cpu", copy=v.device.type != "cpu") for k, v in tensors.items()}
    world = int(trainer.world)
    if world == 1:
        return HeldState(mine, record, world)
    box: list[Any] = [None] * world
    dist.all_gather_object(box, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in box:
        merged.update(part)
    return HeldState(merged, record, world)


def release(cm: Any) -> None:
    """Free what a compiled model's old plan holds on its device once its state was gathered: the
    engine, the optimizer's state, and the model's tensors off the host (the model is not used
    again; the new plan runs a fresh copy)."""
    trainer = getattr(cm, "_trainer", None)
    if trainer is not None:
        if trainer.optimizer is not None:
            trainer.optimizer.state.clear()
        trainer.engine = trainer._evaluator = None
    for t in [*cm.model.parameters(), *cm.model.buffers()]:
        if t.device.type != "cpu":
            t.data = torch.empty(0, dtype=t.dtype)
