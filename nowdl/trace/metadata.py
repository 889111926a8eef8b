"""Graph nodes whose value depends on tensors only through their metadata (shape, dtype, device).

A size read off a tensor (``x.shape[2:]``, ``x.size(1)``, ``x.ndim``) and arithmetic on such
sizes are fixed by the input shapes: codegen folds the ones that cross stages to constants, and
a spatial stage reads them off the whole image rather than off its tile.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch.fx as fx

__all__ = ["META_ATTRS", "META_METHODS", "reads_metadata", "metadata_nodes"]

#: Attributes and methods that read a tensor's metadata, never its values.
META_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout"})
META_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "get_device"})
_SCALAR_FUNCS: frozenset[Any] = frozenset({
    operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv,
    operator.mod, operator.neg, operator.pow, len, int, float, max, min, math.prod, math.floor, math.ceil,
})


def reads_metadata(node: fx.Node) -> bool:
    """True when ``node`` itself reads a tensor's metadata (``getattr(x, "shape")``, ``x.size()``)."""
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in META_ATTRS
    return node.op == "call_method" and node.target in META_METHODS


def _from_metadata(node: fx.Node, seen: dict[str, bool]) -> bool:
    if node.name in seen:
        return seen[node.name]
    if reads_metadata(node):
        ok = True
    elif node.op == "call_function" and node.target in _SCALAR_FUNCS:
        ok = all(_from_metadata(a, seen) for a in node.all_input_nodes)
    else:
        ok = False
    seen[node.name] = ok
    return ok


def metadata_nodes(gm: fx.GraphModule | fx.Graph) -> set[str]:
    """Names of the nodes whose value depends on tensors only through their metadata: the reads
    themselves and the scalar arithmetic and indexing on what they read."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    seen: dict[str, bool] = {}
    return {n.name for n in graph.nodes if _from_metadata(n, seen)}
