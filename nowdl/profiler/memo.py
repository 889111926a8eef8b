"""Reuse the costs of a node identical to one already profiled (estimate mode).

[Note: node memo] ResNets repeat one block dozens of times and AmoebaNet one cell: most nodes
are the same op (a standard ``torch.nn`` module of the same configuration, or the same
function) on inputs of the same shapes, strides, dtypes and gradient flags. On fake tensors
such a node's times, FLOPs and workspace are a function of exactly that, so the walk runs
it once and afterwards only makes its outputs (fresh fake tensors of the recorded
layout) and replays what it saved: each saved tensor is recorded as "input i", "output j"
or "a tensor of its own of N bytes", which the storage ledger then attributes exactly as a
real run would. Nodes whose output aliases an input (views), in-place nodes, custom modules
(their ``repr`` does not pin down what they compute) and measure mode are never memoised.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node
from torch.fx.node import map_arg
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from nowdl.profiler.memory import storage_key, storage_nbytes

__all__ = ["Entry", "memo_key", "make_entry", "replay", "input_tensors"]


@dataclass(frozen=True)
class _Layout:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class Entry:
    """What one run of a node gave, in a form that can be replayed for an identical node."""

    fwd_s: float
    bwd_s: float
    flops: int
    workspace: int
    spec: TreeSpec
    leaves: tuple[Any, ...]  # _Layout for a tensor output, else the constant
    saved: tuple[tuple[str, int], ...]  # ("in", i), ("out", j) or ("own", nbytes)
    requires_grad: bool
    fwd_workspace: int = 0  # the forward's share of ``workspace``
    alloc: Any = None  # the run's RawLog ([Note: allocation log] in profiler/alloc/log.py)


def _hashable(x: Any) -> Hashable:
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return x  # type: ignore[no-any-return]


def _standard(mod: torch.nn.Module) -> bool:
    return type(mod).__module__.startswith("torch.nn.modules") and next(mod.children(), None) is None


def input_tensors(node: Node, value: Callable[[Node], Any]) -> list[torch.Tensor]:
    """The node's input tensors in a fixed order (the order ``make_entry``'s indices refer to)."""
    flat, _ = tree_flatten(map_arg((node.args, node.kwargs), value))
    return [t for t in flat if isinstance(t, torch.Tensor)]


def memo_key(node: Node, mod: torch.nn.Module | None, value: Callable[[Node], Any],
             requires_grad: Callable[[Node], bool], extra: Hashable) -> Hashable | None:
    """A key equal for nodes whose runs on fake tensors are identical, or None (never memoise)."""
    if node.op == "call_module":
        if mod is None or not _standard(mod):
            return None
        head: Hashable = (type(mod), repr(mod), mod.training,
                          tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                                for n, t in [*mod.named_parameters(), *mod.named_buffers()]))
    elif node.op in ("call_function", "call_method"):
        head = (node.op, _hashable(node.target))
    else:
        return None
    groups: dict[int, int] = {}

    def leaf(n: Node) -> Any:
        flat, spec = tree_flatten(value(n))
        out: list[Hashable] = []
        for t in flat:
            if isinstance(t, torch.Tensor):
                k = storage_key(t)
                out.append(("T", tuple(t.shape), tuple(t.stride()), t.dtype, requires_grad(n),
                            groups.setdefault(k, len(groups))))
            else:
                out.append(_hashable(t))
        return (tuple(out), str(spec))

    args = map_arg((node.args, node.kwargs), leaf)
    flat, spec = tree_flatten(args)
    return (head, tuple(_hashable(a) for a in flat), str(spec), extra)


def make_entry(flops: int, workspace: int, out: Any, inputs: list[torch.Tensor], saved: list[torch.Tensor],
               static: set[int]) -> Entry | None:
    """Record one run (times are added once known); None when the node cannot be replayed
    (its output aliases an input, a parameter or another output)."""
    in_at: dict[int, int] = {}
    for i, t in enumerate(inputs):
        in_at.setdefault(storage_key(t), i)
    flat, spec = tree_flatten(out)
    leaves: list[Any] = []
    out_at: dict[int, int] = {}
    rg = False
    for j, t in enumerate(flat):
        if isinstance(t, torch.Tensor):
            k = storage_key(t)
            if k in in_at or k in static or k in out_at:
                return None
            out_at[k] = j
            rg = rg or t.requires_grad
            leaves.append(_Layout(tuple(t.shape), tuple(t.stride()), t.dtype, t.device))
        else:
            leaves.append(t)
    kinds: list[tuple[str, int]] = []
    own: set[int] = set()
    for t in saved:
        if not isinstance(t, torch.Tensor):
            continue
        k = storage_key(t)
        if k in static:
            continue
        if k in in_at:
            kinds.append(("in", in_at[k]))
        elif k in out_at:
            kinds.append(("out", out_at[k]))
        elif k not in own:  # one tensor of its own per storage, however often it is saved
            own.add(k)
            kinds.append(("own", storage_nbytes(t)))
    return Entry(0.0, 0.0, flops, workspace, spec, tuple(leaves), tuple(kinds), rg)


def replay(entry: Entry, inputs: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """Fresh outputs of the recorded layout, and the tensors the node saves (on the same
    storages as a real run's: the inputs, the new outputs, or new tensors of their own).
    Call it inside the fake-tensor mode of the walk."""
    flat = []
    for leaf in entry.leaves:
        if isinstance(leaf, _Layout):
            flat.append(torch.empty_strided(leaf.shape, leaf.stride, dtype=leaf.dtype, device=leaf.device))
        else:
            flat.append(leaf)
    outs = [t for t in flat if isinstance(t, torch.Tensor)]
    out_by_leaf = {j: t for j, t in enumerate(flat) if isinstance(t, torch.Tensor)}
    device = outs[0].device if outs else (inputs[0].device if inputs else torch.device("cpu"))
    saved: list[torch.Tensor] = []
    for kind, i in entry.saved:
        if kind == "in":
            saved.append(inputs[i])
        elif kind == "out":
            saved.append(out_by_leaf[i])
        else:
            saved.append(torch.empty(i, dtype=torch.uint8, device=device))
    return tree_unflatten(flat, entry.spec), saved
