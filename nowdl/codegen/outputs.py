"""The model's output structure across stages: which values the model returns, and rebuilding it.

The last stage returns the model's output tensors flattened (see [Note: stage values] in
:mod:`nowdl.codegen.stage`); :func:`output_tree` records the structure the model returns
(tensor, tuple, list, dict, constants) with an :class:`OutputSlot` for each tensor, and
:func:`fill_outputs` puts the stage's values back into it, so a loss sees what the model returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from nowdl.errors import NowdlError

__all__ = ["model_outputs", "output_tree", "fill_outputs", "OutputSlot"]


def _flatten_output(arg: Any) -> Iterator[fx.Node]:
    """The nodes of an output structure in order: tuples/lists in order, dicts in insertion order."""
    if isinstance(arg, fx.Node):
        yield arg
    elif isinstance(arg, (tuple, list)):
        for a in arg:
            yield from _flatten_output(a)
    elif isinstance(arg, dict):
        for a in arg.values():
            yield from _flatten_output(a)
    elif isinstance(arg, slice):
        for a in (arg.start, arg.stop, arg.step):
            yield from _flatten_output(a)


def model_outputs(gm: fx.GraphModule) -> list[str]:
    """The value names the model returns, flattened as the last stage returns them (no repeats)."""
    out = [n for n in gm.graph.nodes if n.op == "output"]
    if len(out) != 1:
        raise NowdlError(f"the graph has {len(out)} output nodes, expected 1: re-trace the model")
    names: list[str] = []
    for n in _flatten_output(out[0].args[0] if out[0].args else None):
        if n.name not in names:
            names.append(n.name)
    return names


@dataclass(frozen=True)
class OutputSlot:
    """Where ``output_tree`` holds the model's i-th flattened output tensor."""

    index: int


def output_tree(gm: fx.GraphModule) -> Any:
    """The structure ``gm`` returns (tensor, tuple, list, dict, constants), with every tensor
    replaced by an :class:`OutputSlot` indexing :func:`model_outputs`; ``fill_outputs`` rebuilds it.

    For a torch.export graph (pytree code generation) the output node holds the flat leaves and
    the structure is the graph's ``out_spec``.
    """
    names = model_outputs(gm)
    out = next(n for n in gm.graph.nodes if n.op == "output")

    def walk(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return OutputSlot(names.index(a.name))
        if isinstance(a, (tuple, list)):
            items = [walk(v) for v in a]
            return tuple(items) if isinstance(a, tuple) else items
        if isinstance(a, dict):
            return {k: walk(v) for k, v in a.items()}
        return a

    tree = walk(out.args[0] if out.args else None)
    spec = getattr(getattr(gm.graph._codegen, "pytree_info", None), "out_spec", None)
    if spec is not None:
        from torch.utils._pytree import tree_unflatten

        leaves = list(tree) if isinstance(tree, (tuple, list)) else [tree]
        tree = tree_unflatten(leaves, spec)
    return tree


def fill_outputs(tree: Any, values: list[Any]) -> Any:
    """``tree`` (from :func:`output_tree`) with each OutputSlot replaced by ``values[slot.index]``."""
    if isinstance(tree, OutputSlot):
        return values[tree.index]
    if isinstance(tree, tuple):
        return tuple(fill_outputs(v, values) for v in tree)
    if isinstance(tree, list):
        return [fill_outputs(v, values) for v in tree]
    if isinstance(tree, dict):
        return {k: fill_outputs(v, values) for k, v in tree.items()}
    return tree
