"""The single-process reference that distributed exactness tests compare against."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["train_reference"]


def train_reference(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[Any, Any], torch.Tensor],
                    data: Callable[[int], tuple[torch.Tensor, torch.Tensor]], total: int, steps: int
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` optimizer steps, each over ``total`` micro-batches of ``data(step)`` with gradient
    accumulation of ``loss / total``: what one device computes for the same micro-batches.

    Runs on one thread, as the ranks of ``helpers.distributed.run_workers`` do (OMP_NUM_THREADS=1): a
    kernel's reduction order depends on its thread count, and some cases amplify that rounding
    (SENet2d's 3 Adam steps in float64: step 1's loss differs by 9e-5 between 1 and 2 threads of
    the same single process).

    Returns the mean micro-batch loss of every step and the final state dict.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(model, opt, loss_fn, data, total, steps)
    finally:
        torch.set_num_threads(threads)


def _train(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[[Any, Any], torch.Tensor],
           data: Callable[[int], tuple[torch.Tensor, torch.Tensor]], total: int, steps: int
           ) -> tuple[list[float], dict[str, torch.Tensor]]:
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
