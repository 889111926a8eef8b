"""A rank's training state under the model's original names: weights, optimizer, checkpoint keys.

[Note: one optimizer over the model] ``nowdl.compile`` builds the optimizer at once over the
*original* model's parameters, so a scheduler can wrap it before any step. When the engine is
set up, :func:`bind_optimizer` puts the stage modules' parameters in the place of the model's
ones they stand for (the same objects when tracing kept them, as fx does); the parameters of
stages other ranks hold stay in the optimizer with no gradient, which torch's optimizers skip:
they cost no optimizer state. Hyperparameters (``lr``, ``initial_lr`` of a scheduler) live in
``param_groups`` as usual.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from nowdl.codegen.stage import StageModule
from nowdl.errors import NowdlError

__all__ = ["state_names", "stage_tensors", "bind_optimizer", "optimizer_tensors", "optimizer_groups",
           "optimizer_snapshot", "load_optimizer_state", "StateSource"]


class StateSource(Protocol):
    """What a trainer restores from (``Trainer.restore``): a checkpoint on disk
    (``checkpoint.Checkpoint``), or a job's state held in memory (``reshard.HeldState``)."""

    record: dict[str, Any]  # the plan, steps and optimizer fields of a checkpoint's nowdl.json
    dir: Path
    step: int
    world: int

    def index(self) -> Mapping[str, Any]: ...

    def read(self, wanted: Mapping[str, tuple[int, ...] | None], *, optional: frozenset[str] = frozenset()
             ) -> dict[str, torch.Tensor]: ...


def state_names(model: nn.Module, stages: Sequence[StageModule]
                ) -> tuple[dict[str, list[str]], dict[str, torch.Tensor], list[str]]:
    """What ``model.state_dict()`` holds beyond the stages' own names, so that ``state_dict()``
    returns the same keys as the model's (and no tensor a graph holds that is not model state,
    such as the constants torch.export lifts out of ``forward``).

    Returns ``(aliases, unused, order)``: for a stage tensor's original name, the other keys under
    which the model's state dict holds the same tensor (a module registered twice, as DynUNet's
    ``skip_layers``); copies of the entries no stage uses (parameters the forward never touches);
    and the model's key order. Call before the stages move to their device (tensor identity).
    """
    names: dict[int, list[str]] = {}
    full = model.state_dict(keep_vars=True)
    for key, t in full.items():
        names.setdefault(id(t), []).append(key)
    aliases: dict[str, list[str]] = {}
    owned: set[str] = set()
    for st in stages:
        local: dict[str, torch.Tensor] = dict(st.module.named_parameters())
        local.update(dict(st.module.named_buffers()))
        for name, orig in st.param_names.items():
            same = names.get(id(local[name]), [])
            owned.add(orig)
            owned.update(same)
            others = [k for k in same if k != orig]
            if others:
                aliases[orig] = others
    unused = {k: t.detach().cpu().clone() for k, t in full.items() if k not in owned}
    return aliases, unused, list(full)


def stage_tensors(stage: StageModule, keys: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """``(original name, tensor, is parameter)`` of a stage's parameters and buffers.

    ``keys`` (the model's state-dict keys) drops graph constants that are not model state.
    """
    params = dict(stage.module.named_parameters())
    buffers = dict(stage.module.named_buffers())
    for name, orig in stage.param_names.items():
        if keys is not None and orig not in keys:
            continue
        if name in params:
            yield orig, params[name], True
        elif name in buffers:
            yield orig, buffers[name], False


def bind_optimizer(opt: torch.optim.Optimizer, model: nn.Module, stages: Sequence[StageModule]) -> None:
    """Make ``opt`` (built over ``model.parameters()``) step the stage parameters in their place.

    Raises:
        NowdlError: a stage parameter the optimizer does not hold (it was built over other
            parameters than the compiled model's).
    """
    by_name = dict(model.named_parameters(remove_duplicate=False))
    swap: dict[int, nn.Parameter] = {}
    for st in stages:
        for orig, t, is_param in stage_tensors(st):
            if not is_param:
                continue
            old = by_name.get(orig)
            if old is None:
                raise NowdlError(f"stage {st.index} holds parameter {orig!r}, which the model does not have: "
                                 "the optimizer cannot step it (was the model changed after nowdl.compile?)")
            if old is not t:
                swap[id(old)] = t  # type: ignore[assignment]
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    for st in stages:
        for orig, t, is_param in stage_tensors(st):
            if is_param and id(t) not in held and id(by_name[orig]) not in held:
                raise NowdlError(f"parameter {orig!r} (stage {st.index}) is not in the optimizer: build the optimizer "
                                 "over all of model.parameters() (nowdl.compile(..., optimizer=factory) does)")
    if not swap:
        return
    for group in opt.param_groups:
        group["params"] = [swap.get(id(p), p) for p in group["params"]]
    for old_id, new in swap.items():
        for p in list(opt.state):
            if id(p) == old_id:
                opt.state[new] = opt.state.pop(p)


def optimizer_tensors(opt: torch.optim.Optimizer, named: dict[str, nn.Parameter]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``optim/<name>/<key>`` tensors of the parameters in ``named``, and the keys that were Python
    numbers (saved as float64 scalars, restored as numbers)."""
    out: dict[str, torch.Tensor] = {}
    scalars: set[str] = set()
    for name, p in named.items():
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{name}/{key}"] = value.detach()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"optim/{name}/{key}"] = torch.tensor(float(value), dtype=torch.float64)
                scalars.add(key)
            else:
                raise NowdlError(f"optimizer state {key!r} of {name!r} is a {type(value).__name__}: nowdl checkpoints "
                                 "hold tensors and numbers only (use a torch.optim optimizer)")
    return out, sorted(scalars)


def optimizer_groups(opt: torch.optim.Optimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    """The param groups' hyperparameters as JSON, with parameter names instead of tensors."""
    groups = []
    for g in opt.param_groups:
        entry: dict[str, Any] = {"params": [names.get(id(p), "") for p in g["params"]]}
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, tuple):
                v = list(v)
            if v is None or isinstance(v, (bool, int, float, str, list)):
                entry[k] = v
        groups.append(entry)
    return groups


def optimizer_snapshot(opt: torch.optim.Optimizer, model: nn.Module, held: dict[str, nn.Parameter], owned: set[str]
                       ) -> tuple[dict[str, torch.Tensor], list[str], list[dict[str, Any]]]:
    """A checkpoint's optimizer part: the ``optim/`` tensors of the ``held`` parameters named in
    ``owned``, the keys that were numbers, and the groups' hyperparameters by parameter name."""
    tensors, scalars = optimizer_tensors(opt, {k: v for k, v in held.items() if k in owned})
    names = {id(p): n for n, p in model.named_parameters()}
    names.update({id(p): n for n, p in held.items()})
    return tensors, scalars, optimizer_groups(opt, names)


def load_optimizer_state(opt: torch.optim.Optimizer, named: dict[str, nn.Parameter], tensors: dict[str, torch.Tensor],
                         scalars: Sequence[str], groups: list[dict[str, Any]] | None, where: str) -> None:
    """Put ``optim/<name>/<key>`` tensors into ``opt.state`` and the saved hyperparameters into its groups."""
    for name, p in named.items():
        prefix = f"optim/{name}/"
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not state:
            continue
        for key, value in state.items():
            if key in scalars:
                state[key] = float(value.item())  # type: ignore[assignment]
            elif key != "step":
                state[key] = value.to(device=p.device)
        opt.state[p] = state
    if groups is None:
        return
    if len(groups) != len(opt.param_groups):
        raise NowdlError(f"checkpoint {where} has {len(groups)} optimizer param group(s) but the optimizer has "
                         f"{len(opt.param_groups)}: build the optimizer the way the checkpoint's run did")
    for saved, group in zip(groups, opt.param_groups, strict=True):
        for k, v in saved.items():
            if k == "params":
                continue
            if k in group and isinstance(group[k], tuple) and isinstance(v, list):
                v = tuple(v)
            if k in group and isinstance(group[k], torch.Tensor):
                group[k].fill_(v)
            else:
                group[k] = v
