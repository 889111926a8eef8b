"""Nodes that must share a pipeline stage: users of one parameter or buffer, and pooled branches."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx

__all__ = ["tied_nodes"]


def tied_nodes(gm: fx.GraphModule, also: Sequence[Sequence[str]] = ()) -> tuple[tuple[str, ...], ...]:
    """Groups of nodes that use one parameter or buffer (a call_module owning it, or a node
    reading it through get_attr): they must share a stage, since the runtime cannot yet sum
    a shared weight's gradients across stages. ``also``: more groups that must share a stage
    (pooled branches: [Note: whole values on tiles]); groups that share a node are merged."""
    users: dict[int, list[str]] = {}
    for node in gm.graph.nodes:
        tensors: list[torch.Tensor] = []
        names = [node.name]
        if node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            tensors = [*mod.parameters(), *mod.buffers()]
        elif node.op == "get_attr":
            owner, _, leaf = str(node.target).rpartition(".")
            mod = gm.get_submodule(owner) if owner else gm
            if leaf in mod._parameters or leaf in mod._buffers:
                tensors = [getattr(mod, leaf)]
            names = [u.name for u in node.users]  # get_attr lives with its users
        for t in tensors:
            for name in names:
                if name not in users.setdefault(id(t), []):
                    users[id(t)].append(name)
    for i, grp in enumerate(also):
        users[-1 - i] = list(dict.fromkeys(grp))
    # merge groups that share a node (a module with two tied weights, say)
    parent: dict[str, str] = {}

    def root(a: str) -> str:
        while parent.setdefault(a, a) != a:
            a = parent[a]
        return a

    for names in users.values():
        for other in names[1:]:
            parent[root(other)] = root(names[0])
    groups: dict[str, list[str]] = {}
    for names in users.values():
        for name in names:
            groups.setdefault(root(name), [])
            if name not in groups[root(name)]:
                groups[root(name)].append(name)
    return tuple(tuple(g) for g in groups.values() if len(g) > 1)
