"""The single-process reference that distributed exactness tests compare against."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def train_reference(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[Any, Any], torch.Tensor],
                    data: Callable[[int], tuple[torch.Tensor, torch.Tensor]], total: int, steps: int
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` optimizer steps, each over ``total`` micro-batches of ``data(step)`` with gradient
    accumulation of ``loss / total``: what one device computes for the same micro-batches.

    Returns the mean micro-batch loss of every step and the final state dict.
    """
    model.train()
    losses = []
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad(set_to_none=True)
        acc = 0.0
        for xc, yc in zip(x.chunk(total), y.chunk(total), strict=True):
            loss = loss_fn(model(xc), yc)
            (loss / total).backward()
            acc += float(loss.detach())
        opt.step()
        losses.append(acc / total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
