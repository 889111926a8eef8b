"""Gradient sync and the optimizer step of one rank: bucketed all-reduce, fp16 loss scaling, the loss mean.

[Note: gradient sync] During this rank's last gradient action of a stage in a step (its last
backward; zero bubble: its last ``W``), each parameter's gradient is final as soon as it is
accumulated: it joins a bucket, and every full bucket (``BUCKET_BYTES``) is flattened and
all-reduced (SUM, never an average) asynchronously over every rank holding a copy of the stage
(MASTER mirror, data-parallel copies, tiles), overlapping the rest of that backward and
whatever the rank runs next; what is left goes out when the action ends. The optimizer steps
once every bucket has arrived.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nowdl.codegen.stage import StageModule
from nowdl.errors import NonFiniteError
from nowdl.runtime.launch import comm, faults
from nowdl.runtime.launch.group import wait
from nowdl.runtime.launch.where import current_step
from nowdl.runtime.pipeline.ranks import Placement

__all__ = ["GradSync", "Buckets", "Bucket", "BUCKET_BYTES"]

log = logging.getLogger("nowdl.runtime.pipeline.engine")

BUCKET_BYTES = 1 << 20
"""Gradients of at least this many bytes go out in one all-reduce as soon as they are final."""

Bucket = tuple[int, Any, torch.Tensor, list[nn.Parameter]]  # stage, work, flat buffer, its parameters


class Buckets:
    """Buckets of one stage's final gradients, each all-reduced (SUM, async) once full.

    :meth:`ready` is called with each parameter whose gradient just became final: by a
    post-accumulate-grad hook during the last backward (autograd runs a leaf's accumulation
    once per backward, its uses summed), or by the zero-bubble ``W`` (``run_weight_grads``).
    Every rank of the group runs the same graph, so the buckets are the same everywhere.
    """

    def __init__(self, stage: int, params: list[nn.Parameter], group: Any, device: torch.device,
                 cap: int) -> None:
        self.stage, self.params, self.group, self.device, self.cap = stage, params, group, device, cap
        self.todo = {id(p) for p in params}
        self.cur: list[nn.Parameter] = []
        self.size = 0
        self.launched: list[Bucket] = []
        self.hooks = [p.register_post_accumulate_grad_hook(self.ready) for p in params if p.requires_grad]

    def ready(self, p: torch.Tensor) -> None:
        if id(p) not in self.todo:
            return
        self.todo.discard(id(p))
        self.cur.append(p)  # type: ignore[arg-type]
        self.size += p.numel() * p.element_size()
        if self.size >= self.cap:
            self._launch()

    def _launch(self) -> None:
        if not self.cur:
            return
        for p in self.cur:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in self.cur])  # type: ignore[union-attr]
        work = comm.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.launched.append((self.stage, work, flat, self.cur))
        self.cur, self.size = [], 0

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for p in self.params:  # the rest, in parameter order (no gradient: zeros)
            if id(p) in self.todo:
                self.todo.discard(id(p))
                self.cur.append(p)
        self._launch()


class GradSync:
    """Gradient sync and the optimizer step of one rank.

    Args:
        place: where every copy of every stage runs.
        stages: this rank's stage modules by index.
        groups: per held stage, the process group of every rank holding a copy (None: only here).
        params: this rank's parameters (each once).
        optimizer: steps ``params``; None: no step.
        device: where the gradients live.
        timeout_s: how long a collective may wait.
        scaling: fp16 loss scaling (skip the step on every rank when any overflows).
        has_loss: a loss function is given (else the mean loss is NaN).
        m: micro-batches per replica.
    """

    def __init__(self, place: Placement, stages: dict[int, StageModule], groups: dict[int, Any],
                 params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None, device: torch.device,
                 timeout_s: float, *, scaling: bool, has_loss: bool, m: int) -> None:
        self.place, self.stages, self.groups = place, stages, groups
        self.params, self.optimizer, self.device, self.timeout_s = params, optimizer, device, timeout_s
        self.scaling, self.has_loss, self.m = scaling, has_loss, m
        self.loss_scale = 2.0**16 if scaling else 1.0
        self._good_steps = 0

    def zero_grad(self) -> None:
        """Drop the previous step's gradients."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def sync_initial_weights(self) -> None:
        """Every copy of a stage starts from the lowest rank's weights (they must be equal)."""
        for s, g in self.groups.items():
            if g is None:
                continue
            src = self.place.group_ranks(s)[0]
            for t in list(self.stages[s].module.parameters()) + list(self.stages[s].module.buffers()):
                with torch.no_grad():
                    comm.broadcast(t.data, src=src, group=g)

    def open_buckets(self, stage: int) -> Buckets | None:
        """Before this rank's last gradient action of ``stage`` in a step: reduce its gradients in
        buckets as they become final ([Note: gradient sync]); None when no other rank holds it."""
        g = self.groups.get(stage)
        if g is None:
            return None
        return Buckets(stage, list(self.stages[stage].module.parameters()), g, self.device, BUCKET_BYTES)

    def close_buckets(self, b: Buckets) -> list[Bucket]:
        """After that action: launch what is left (parameters without a gradient as zeros)."""
        b.close()
        return b.launched

    def finish(self, pending: list[Bucket]) -> None:
        """Wait for the launched buckets and copy the summed gradients back into ``.grad``."""
        for stage, work, flat, params in pending:
            wait(work, timeout_s=self.timeout_s, what=f"gradient all-reduce of stage {stage}", peer=None)
            offset = 0
            for p in params:
                n = p.numel()
                g = p.grad
                if g is not None:  # set by Buckets._launch
                    g.copy_(flat[offset:offset + n].view_as(g))
                offset += n

    def step(self) -> None:
        """Optimizer step; with fp16 loss scaling, every rank agrees to skip on an overflow."""
        if self.optimizer is None and not self.scaling:
            return
        if self.scaling:
            bad = torch.tensor([0.0], device=self.device)
            for p in self.params:
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    bad.fill_(1.0)
                    break
            if dist.is_initialized() and dist.get_world_size() > 1:
                comm.all_reduce(bad, op=dist.ReduceOp.MAX)
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
            faults.point("train.optimizer")
            self.optimizer.step()

    def mean_loss(self, local_sum: float) -> float:
        """The mean loss over the global batch from this rank's sum (NaN without a loss)."""
        return self._agree(local_sum, 0.0)[0]

    def _agree(self, local_sum: float, bad: float) -> tuple[float, float]:
        """(mean loss over the global batch, ranks with a non-finite loss or gradient): one all-reduce."""
        total = self.place.dp * self.place.replicas * self.m
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([local_sum if self.has_loss else 0.0, bad], dtype=torch.float64, device=self.device)
            comm.all_reduce(t, op=dist.ReduceOp.SUM)
            local_sum, bad = float(t[0].item()), float(t[1].item())
        return (local_sum / total if self.has_loss else float("nan")), bad

    def check_and_step(self, local_sum: float, *, skip_nonfinite: bool = False) -> tuple[float, bool]:
        """[Note: non-finite steps] Step only when every rank's loss and gradients are finite.

        One all-reduce carries the loss sum (for the mean every rank returns) and the count of
        ranks whose loss or gradients hold a NaN or an infinity, before the optimizer steps: a bad
        step never changes the weights. Then every rank raises :class:`NonFiniteError` (naming the
        step and, on the ranks that saw it, what was not finite), or with ``skip_nonfinite`` skips
        the step on every rank and says so. fp16 loss scaling keeps its own overflow skip. The
        mean loss and whether the step ran."""
        grads = [p.grad for p in self.params if p.grad is not None]
        bad_grad = bool(grads) and not self.scaling and not bool(
            torch.stack(torch._foreach_norm(grads)).isfinite().all())  # one host sync for every gradient
        bad_loss = self.has_loss and not math.isfinite(local_sum)
        mean, bad = self._agree(local_sum, float(bad_grad or bad_loss))
        if bad:
            self.zero_grad()
            at = current_step()
            me = dist.get_rank() if dist.is_initialized() else 0
            what = f" (rank {me}: {'its loss' if bad_loss else 'a gradient'} is not finite)" if bad_grad or bad_loss else ""
            msg = (f"step {at if at is not None else '?'}: the loss or a gradient is NaN or infinite on {int(bad)} "
                   f"rank(s){what}; the optimizer did not step, so the weights are those of the step before")
            if not skip_nonfinite:
                raise NonFiniteError(msg + ": the run stops and saves no checkpoint; look for NaN or nodata in the "
                                     "input or a learning rate too high, or pass --skip-nonfinite to skip such batches "
                                     "and count them")
            log.warning("%s: skipped (--skip-nonfinite)", msg)
            return mean, False
        self.step()
        return mean, True
