"""Gradient sync and the optimizer step of one rank: bucketed all-reduce, fp16 loss scaling, the loss mean.

[Note: gradient sync] After this rank's last backward of a stage, that stage's gradients are
flattened into one bucket and all-reduced (SUM) asynchronously over every rank holding a copy of
the stage (MASTER mirror and data-parallel copies), overlapping the rest of the backward; the
optimizer steps once every bucket has arrived.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nowdl.codegen.stage import StageModule
from nowdl.runtime.launch import wait
from nowdl.runtime.placement import Placement

__all__ = ["GradSync"]

log = logging.getLogger("nowdl.runtime.engine")


class GradSync:
    """The gradient part of :class:`~nowdl.runtime.engine.PipelineEngine` (a mixin)."""

    place: Placement
    stages: dict[int, StageModule]
    m: int
    device: torch.device
    timeout_s: float
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer | None
    loss_fn: Any
    loss_scale: float
    _scaling: bool
    _good_steps: int
    _groups: dict[int, Any]

    def _sync_initial_weights(self) -> None:
        """Every copy of a stage starts from the lowest rank's weights (they must be equal)."""
        for s, g in self._groups.items():
            if g is None:
                continue
            src = self.place.group_ranks(s)[0]
            for t in list(self.stages[s].module.parameters()) + list(self.stages[s].module.buffers()):
                with torch.no_grad():
                    dist.broadcast(t.data, src=src, group=g)

    def _launch_sync(self, stage: int) -> tuple[int, Any, torch.Tensor] | None:
        """Start the all-reduce (SUM) of one stage's gradients as one flat bucket, asynchronously.

        Called right after this rank's last backward of the stage, so it overlaps the backward
        of any other stage this rank holds (MASTER) and the remaining sends.
        """
        g = self._groups.get(stage)
        if g is None:
            return None
        grads: list[torch.Tensor] = []
        for p in self.stages[stage].module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.reshape(-1))
        flat = torch.cat(grads) if grads else torch.zeros(0, device=self.device)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=g, async_op=True)
        return stage, work, flat

    def _finish_sync(self, pending: list[tuple[int, Any, torch.Tensor]]) -> None:
        for stage, work, flat in pending:
            wait(work, timeout_s=self.timeout_s, what=f"gradient all-reduce of stage {stage}", peer=None)
            offset = 0
            for p in self.stages[stage].module.parameters():
                n = p.numel()
                if p.grad is not None:  # set by _launch_sync
                    p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n

    def _step(self) -> None:
        """Optimizer step; with fp16 loss scaling, every rank agrees to skip on an overflow."""
        if self.optimizer is None and not self._scaling:
            return
        if self._scaling:
            bad = torch.tensor([0.0], device=self.device)
            for p in self.params:
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    bad.fill_(1.0)
                    break
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item() > 0:
                self.loss_scale /= 2.0
                self._good_steps = 0
                log.warning("fp16 overflow: step skipped on every rank, loss scale now %g", self.loss_scale)
                return
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(self.loss_scale)
            self._good_steps += 1
            if self._good_steps % 2000 == 0:
                self.loss_scale *= 2.0
        if self.optimizer is not None:
            self.optimizer.step()

    def _mean_loss(self, local_sum: float) -> float:
        if self.loss_fn is None:
            return float("nan")
        total = self.place.dp * self.place.replicas * self.m
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return local_sum / total
        t = torch.tensor([local_sum], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item()) / total
