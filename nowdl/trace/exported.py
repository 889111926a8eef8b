"""Turn a torch.export graph into the form nowdl plans: modules back, guards out, train/eval live.

[Note: exported graphs] ``torch.export`` flattens the model into ATen calls whose arguments
are frozen at trace time: ``aten.batch_norm(..., training=True)`` and ``aten.dropout(...,
train=True)`` ignore ``model.eval()``, ``aten.upsample_nearest2d`` carries the traced output
size, and a ``_guards_fn`` module asserts the traced input shape. nowdl therefore:

1. drops the shape guards and ``aten._assert_*`` checks (a pipeline stage or an image tile
   sees other shapes than the whole model did);
2. lifts every call of a standard ``torch.nn`` module with no children (Conv, BatchNorm,
   ReLU, Dropout, Upsample, ...) back to one ``call_module`` node on the model's own module,
   found through each node's ``nn_module_stack``, when its ATen nodes form one contiguous run
   with one input and one output: the graph then follows ``train()``/``eval()``, keeps the
   parameters under their original names, and its convolutions can run on image tiles;
3. makes the ATen dropout and batch-norm calls left over (functional calls in the model's
   own code) follow the graph's train/eval mode, and ``x.to(device)`` calls keep only their
   dtype (a stage may run on another device than the one the model was exported on);
4. points every remaining parameter and buffer at the model's own tensor of the same name,
   so the graph trains the model itself, as an fx graph does.

In-place ATen ops are made out-of-place afterwards by :mod:`nowdl.trace.functional`, as for fx.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx as fx
from torch import nn

__all__ = ["normalize_exported", "ModeAware", "is_standard_leaf"]

log = logging.getLogger(__name__)

_aten = torch.ops.aten
# ATen calls whose train flag (argument index) should follow the graph's mode
_MODE_ARGS: dict[Any, int] = {
    _aten.dropout.default: 2,
    _aten.feature_dropout.default: 2,
    _aten.alpha_dropout.default: 2,
    _aten.feature_alpha_dropout.default: 2,
    _aten.batch_norm.default: 5,
}


class ModeAware(nn.Module):
    """Calls an ATen op with its train flag set from ``self.training`` (see [Note: exported graphs])."""

    def __init__(self, op: Any, flag_index: int) -> None:
        super().__init__()
        self.op = op
        self.flag_index = flag_index

    def forward(self, *args: Any) -> Any:
        a = list(args)
        a[self.flag_index] = self.training
        return self.op(*a)

    def extra_repr(self) -> str:
        return f"{self.op}, flag={self.flag_index}"


def _drop_guards(gm: fx.GraphModule) -> int:
    dropped = 0
    for n in list(gm.graph.nodes):
        guard = n.op == "call_module" and str(n.target).startswith("_guards")
        check = n.op == "call_function" and "_assert" in str(getattr(n.target, "__name__", n.target))
        if (guard or check) and not n.users:
            gm.graph.erase_node(n)
            dropped += 1
    return dropped


def _innermost(n: fx.Node) -> tuple[str, str, str] | None:
    """(stack key, module path, type name) of the innermost module a node was traced in."""
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return None
    key, (path, type_name) = list(stack.items())[-1]
    return str(key), str(path), str(type_name)


def is_standard_leaf(mod: nn.Module) -> bool:
    """A module of ``torch.nn`` itself with no children (Conv2d, BatchNorm3d, ReLU, ...)."""
    return type(mod).__module__.startswith("torch.nn.modules") and next(mod.children(), None) is None


def _runs(gm: fx.GraphModule) -> list[tuple[str, list[fx.Node]]]:
    """Maximal contiguous runs of call nodes traced inside the same call of one module."""
    runs: list[tuple[str, list[fx.Node]]] = []
    cur_key: str | None = None
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            continue
        inner = _innermost(n) if n.op in ("call_function", "call_method") else None
        key = inner[0] if inner else None
        if key is not None and key == cur_key:
            runs[-1][1].append(n)
        elif key is not None:
            runs.append((inner[1], [n]))  # type: ignore[index]
        cur_key = key
    return runs


def _lift(gm: fx.GraphModule, model: nn.Module, path: str, run: list[fx.Node]) -> bool:
    """Replace one run by ``call_module(path)`` when it is one call on one input."""
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        return False
    if not is_standard_leaf(mod):
        return False
    members = set(run)
    inputs: list[fx.Node] = []
    own = path + "."
    for n in run:
        for a in n.all_input_nodes:
            if a in members:
                continue
            if a.op == "get_attr":
                if not str(a.target).startswith(own):
                    return False
            elif a not in inputs:
                inputs.append(a)
    outs = [n for n in run if any(u not in members for u in n.users)]
    if len(inputs) != 1 or len(outs) != 1:
        return False
    gm.add_submodule(path, mod)  # creates the parent containers a parameter-free module lacks
    with gm.graph.inserting_before(run[0]):
        new = gm.graph.call_module(path, (inputs[0],))
    new.meta = dict(outs[0].meta)
    new.meta["nn_module_stack"] = dict(run[0].meta.get("nn_module_stack") or {})
    outs[0].replace_all_uses_with(new)
    for n in reversed(run):
        gm.graph.erase_node(n)
    return True


def _untie_device(gm: fx.GraphModule) -> int:
    """``aten.to.device(x, <trace device>, dtype)`` becomes ``aten.to.dtype(x, dtype)``: a stage may
    run on another device than the one the model was exported on."""
    count = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is _aten.to.device and len(n.args) >= 3:
            n.target = _aten.to.dtype
            n.args = (n.args[0], *n.args[2:])
            count += 1
    return count


def _follow_mode(gm: fx.GraphModule) -> int:
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _MODE_ARGS or n.kwargs:
            continue
        idx = _MODE_ARGS[n.target]
        if len(n.args) <= idx or n.args[idx] is not True:
            continue
        if n.target is _aten.batch_norm.default and n.args[3] is None:
            continue  # no running statistics: batch statistics in eval mode too
        name = f"_nowdl_mode_{count}"
        gm.add_submodule(name, ModeAware(n.target, idx))
        n.op, n.target = "call_module", name
        count += 1
    return count


def _adopt(gm: fx.GraphModule, model: nn.Module) -> int:
    """Point gm's parameters and buffers at the model's tensors of the same name."""
    mine = dict(model.named_parameters(remove_duplicate=False))
    bufs = dict(model.named_buffers(remove_duplicate=False))
    count = 0
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        src = mine.get(name, bufs.get(name))
        if src is None or src is t or src.shape != t.shape or src.dtype != t.dtype:
            continue
        owner, _, leaf = name.rpartition(".")
        mod = gm.get_submodule(owner) if owner else gm
        if leaf in mod._parameters and isinstance(src, nn.Parameter):
            mod._parameters[leaf] = src
        elif leaf in mod._buffers:
            mod._buffers[leaf] = src
        else:
            continue
        count += 1
    return count


def normalize_exported(gm: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """Apply the steps of [Note: exported graphs] to ``ep.module()``'s graph.

    Args:
        gm: the GraphModule ``torch.export.export(...).module()`` returned.
        model: the exported model (its modules and tensors are adopted by ``gm``).

    Returns:
        A plain GraphModule of the normalized graph (``ep.module()``'s own class refuses
        ``train()`` and ``eval()``).
    """
    dropped = _drop_guards(gm)
    lifted = sum(_lift(gm, model, path, run) for path, run in _runs(gm))
    for n in list(gm.graph.nodes):
        if n.op == "get_attr" and not n.users:
            gm.graph.erase_node(n)
    moded = _follow_mode(gm)
    _untie_device(gm)
    gm.graph.lint()
    # a plain GraphModule (ep.module()'s class refuses train() and eval()), compiled as it is made;
    # adopting the model's tensors changes attributes, not the graph
    gm = fx.GraphModule(gm, gm.graph, class_name=type(model).__name__)
    adopted = _adopt(gm, model)
    log.info("export graph: %d guards dropped, %d module calls lifted, %d ops follow train/eval, "
             "%d tensors shared with the model", dropped, lifted, moded, adopted)
    return gm
