"""Optimizers of a compiled model: by name (torch's defaults) or from a factory, and their state family."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from nowdl.errors import NowdlError

__all__ = ["optimizer_kind", "build_optimizer"]


def optimizer_kind(optimizer: Any) -> str:
    """The optimizer-state family ("sgd", "momentum", "adam") of a name or a factory."""
    if isinstance(optimizer, str):
        return optimizer
    if not callable(optimizer):
        raise NowdlError(f"optimizer must be a name ('sgd', 'momentum', 'adam') or a callable "
                         f"params -> torch.optim.Optimizer, got {type(optimizer).__name__}")
    probe = optimizer([nn.Parameter(torch.zeros(1))])
    if not isinstance(probe, torch.optim.Optimizer):
        raise NowdlError(f"the optimizer factory returned {type(probe).__name__}, not a torch.optim.Optimizer")
    name = type(probe).__name__.lower()
    if "adam" in name:
        return "adam"
    if any(g.get("momentum", 0) for g in probe.param_groups):
        return "momentum"
    return "sgd"


_NAMED_OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps),
    "adamw": lambda ps: torch.optim.AdamW(ps),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
}


def build_optimizer(optimizer: Any, model: nn.Module) -> torch.optim.Optimizer | None:
    """The optimizer over ``model.parameters()``: a name (torch's defaults) or a factory's result."""
    params = list(model.parameters())
    if not params:
        return None
    if isinstance(optimizer, str):
        if optimizer not in _NAMED_OPTIMIZERS:
            raise NowdlError(f"unknown optimizer {optimizer!r}: use one of {', '.join(_NAMED_OPTIMIZERS)} or a factory "
                             "params -> torch.optim.Optimizer")
        return _NAMED_OPTIMIZERS[optimizer](params)
    try:
        opt = optimizer(params)
    except Exception as e:
        raise NowdlError(f"the optimizer factory failed on the model's parameters: {type(e).__name__}: {e}") from None
    if not isinstance(opt, torch.optim.Optimizer):
        raise NowdlError(f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
    return opt
