"""Optimizers of a compiled model: by name (torch's defaults) or from a factory, and their state family."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn

from nowdl.errors import NowdlError

__all__ = ["OptimizerFactory", "OptimizerSpec", "OPTIMIZER_NAMES", "check_optimizer", "optimizer_kind", "build_optimizer",
           "OptimizerSlot"]

#: ``params -> torch.optim.Optimizer``, called on each rank's parameters
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
#: a name of :data:`OPTIMIZER_NAMES` (torch's defaults) or a factory
OptimizerSpec = str | OptimizerFactory

_NAMED_OPTIMIZERS: dict[str, OptimizerFactory] = {
    "adam": lambda ps: torch.optim.Adam(ps),
    "adamw": lambda ps: torch.optim.AdamW(ps),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
}
OPTIMIZER_NAMES = tuple(_NAMED_OPTIMIZERS)


def check_optimizer(optimizer: object) -> OptimizerSpec:
    """``optimizer`` if it is a name of OPTIMIZER_NAMES or a callable (else a NowdlError naming the fix)."""
    if isinstance(optimizer, str):
        if optimizer not in _NAMED_OPTIMIZERS:
            raise NowdlError(f"optimizer={optimizer!r} is not one of {', '.join(OPTIMIZER_NAMES)}: pass one of them "
                             "or a factory params -> torch.optim.Optimizer (e.g. lambda ps: torch.optim.AdamW(ps, lr=1e-3))")
        return optimizer
    if not callable(optimizer):
        raise NowdlError(f"optimizer={optimizer!r} is neither a name nor a callable: pass one of "
                         f"{', '.join(OPTIMIZER_NAMES)} or a factory params -> torch.optim.Optimizer")
    return cast(OptimizerFactory, optimizer)  # optimizer_kind's probe checks what it returns


def _built(optimizer: OptimizerFactory, params: list[nn.Parameter], what: str) -> torch.optim.Optimizer:
    try:
        opt = optimizer(params)
    except Exception as e:
        raise NowdlError(f"the optimizer factory failed on {what}: {type(e).__name__}: {e}") from None
    if not isinstance(opt, torch.optim.Optimizer):
        raise NowdlError(f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer: "
                         "make it return one, e.g. lambda ps: torch.optim.Adam(ps)")
    return opt


def optimizer_kind(optimizer: OptimizerSpec) -> str:
    """The optimizer-state family ("sgd", "momentum", "adam", "adamw") of a name or a factory."""
    if isinstance(optimizer, str):
        check_optimizer(optimizer)
        return optimizer
    probe = _built(optimizer, [nn.Parameter(torch.zeros(1))], "a probe parameter")
    if "adam" in type(probe).__name__.lower():
        return "adam"
    if any(g.get("momentum", 0) for g in probe.param_groups):
        return "momentum"
    return "sgd"


def build_optimizer(optimizer: OptimizerSpec, model: nn.Module) -> torch.optim.Optimizer | None:
    """The optimizer over ``model.parameters()``: a name (torch's defaults) or a factory's result."""
    params = list(model.parameters())
    if not params:
        return None
    if isinstance(optimizer, str):
        check_optimizer(optimizer)
        return _NAMED_OPTIMIZERS[optimizer](params)
    return _built(optimizer, params, "the model's parameters")


class OptimizerSlot:
    """``CompiledModel.optimizer``: built from ``options.optimizer`` over ``model.parameters()`` on
    first read, or whatever was assigned. Building the first optimizer imports torch._dynamo
    (about a second), which prediction never needs, so ``nowdl.compile`` leaves it to training."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        if self.slot not in obj.__dict__:
            obj.__dict__[self.slot] = build_optimizer(obj.options.optimizer, obj.model)
        return obj.__dict__[self.slot]

    def __set__(self, obj: Any, value: torch.optim.Optimizer | None) -> None:
        obj.__dict__[self.slot] = value
