"""Split a traced model into the plan's stages with torch.fx's split_module."""

from __future__ import annotations

import copy

import torch.fx as fx
from torch.fx.passes.split_module import split_module

from nowdl.errors import PlanError
from nowdl.plan.plan import Plan

__all__ = ["split_stages"]


def split_stages(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """A GraphModule whose children ``submod_0`` .. ``submod_{K-1}`` are the plan's stages.

    Calling the returned module runs the stages one after another and returns exactly what
    ``gm`` returns (split_module routes every value used across stages, long skips included).

    Raises:
        PlanError: a node of the graph is missing from the plan (the plan is for another graph).
    """
    where = plan.node_stage()
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    missing = [n.name for n in compute if n.name not in where]
    if missing:
        raise PlanError(
            f"the plan does not place node(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} of this "
            "graph: it was made for another model or tracer; re-plan"
        )

    def stage_of(node: fx.Node) -> int:
        return where[node.name]

    ordered = _stage_ordered(gm, where)
    out = split_module(ordered, ordered, stage_of, keep_original_order=True)
    if getattr(gm.graph._codegen, "pytree_info", None) is not None:
        # a torch.export graph takes and returns the model's own structures (pytree code
        # generation); split_module's module would return the flat tuple of leaves
        out.graph._codegen = copy.deepcopy(gm.graph._codegen)
        out.recompile()
    return out


def _stage_ordered(gm: fx.GraphModule, where: dict[str, int]) -> fx.GraphModule:
    """``gm`` with its nodes sorted by stage (graph order within a stage).

    Convex stages allow a topological order that interleaves them (a stage-1 node listed
    before a stage-0 node with no path between them); split_module needs each stage's nodes
    to come after every earlier stage's. Sorting by (stage, position) keeps a topological
    order because every edge goes to the same or a later stage.
    """
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}

    def key(n: fx.Node) -> tuple[int, int]:
        if n.op == "placeholder":
            return (-1, pos[n])
        if n.op == "output":
            return (len(nodes), pos[n])
        return (where[n.name], pos[n])

    ordered = sorted(nodes, key=key)
    if ordered == nodes:
        return gm
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in ordered:
        env[n] = graph.node_copy(n, lambda a: env[a])
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)
