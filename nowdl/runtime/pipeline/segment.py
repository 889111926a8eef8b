"""A recomputed segment: a stage whose backward recomputes only some of its nodes' saved tensors.

[Note: recompute segment] A stage with ``StagePlan.recompute_segment == [start, stop)``
recomputes the saved tensors of ``nodes[start:stop]`` (the plan's node list of the stage, in
graph order) and keeps those of its other nodes. Its forward runs the stage's GraphModule node
by node (:class:`torch.fx.Interpreter`, the same ops in the same order as the module's
generated code) with the slot hooks of [Note: recompute exactness] in recompute.py around the
segment's nodes only (a prefix, the planner's choice, runs as two generated modules instead, the
hooks around the first); the other nodes save their tensors as usual. The recompute at the start of
the ``B`` action is the same machinery as a whole stage's (random state replayed, changed buffers
set to their values from before the forward and put back, saved tensors checked against the
forward's): it runs the stage's nodes from the first up to the segment's last, the nodes before
``start`` without grad (they save nothing), and stops there. The buffers it sets and puts back
are those of the modules the segment calls (``SegmentRun.owner``): a kept node's saved buffer
(BatchNorm saves its running statistics) must not change its version. A prefix (``start == 0``), the
planner's choice, reruns exactly the segment's forward. Spatial stages and sequential tiles
recompute their whole stage (their forward is the tiled one); the plan refuses a segment there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from nowdl.errors import NowdlError

__all__ = ["SegmentRun", "segment_names"]

Hooks = Callable[[], AbstractContextManager[Any]]


def segment_names(nodes: Sequence[str], segment: Sequence[int], module: fx.GraphModule, what: str) -> frozenset[str]:
    """The names of ``nodes[start:stop]`` that the stage's module computes.

    Raises:
        NowdlError: the segment names none of the module's nodes.
    """
    start, stop = segment
    names = frozenset(nodes[start:stop])
    ops = {n.name for n in module.graph.nodes if n.op not in ("placeholder", "output")}
    got = names & ops
    if not got:
        raise NowdlError(f"{what}: recompute_segment {list(segment)} names nodes {sorted(names)[:4]} none of which the "
                         "stage computes: the plan does not match this model; re-plan (nowdl plan) or drop the "
                         "stage's recompute_segment")
    return frozenset(got)


class _Stop(Exception):
    """Raised after the segment's last node in a recompute."""


class _Interpreter(fx.Interpreter):
    def __init__(self, module: fx.GraphModule, names: frozenset[str], hooks: Hooks, replay: bool, last: str) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.names, self.hooks, self.replay, self.last = names, hooks, replay, last
        self.started = False

    def run_node(self, n: fx.Node) -> Any:
        inside = n.name in self.names
        self.started = self.started or inside
        if inside:
            with self.hooks():
                out = super().run_node(n)
        elif self.replay and not self.started and n.op not in ("placeholder", "get_attr"):
            with torch.no_grad():  # before the segment: its values only, nothing saved
                out = super().run_node(n)
        else:
            out = super().run_node(n)
        if self.replay and n.name == self.last:
            raise _Stop
        return out


def _split_prefix(module: fx.GraphModule, names: frozenset[str]) -> tuple[fx.GraphModule, fx.GraphModule] | None:
    """``(head, tail)``: ``head(*args)`` computes the segment, a prefix of ``module``'s computing
    nodes, and returns the tuple of its values that later nodes read; ``tail(*args, *those)``
    computes the rest and returns what ``module`` returns. None when the segment is not a prefix.
    Both are generated code over ``module``'s own submodules and attributes, so a prefix runs at
    the module's speed rather than node by node through an interpreter."""
    nodes = list(module.graph.nodes)
    places = [n for n in nodes if n.op == "placeholder"]
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    k = sum(1 for n in body if n.name in names)
    if k == 0 or k == len(body) or any(n.name not in names for n in body[:k]):
        return None
    head_nodes, tail_nodes = body[:k], body[k:]
    out_node = next(n for n in nodes if n.op == "output")
    inside = set(head_nodes)
    crossing = [n for n in head_nodes if any(u not in inside for u in n.users)]
    head, env_h = fx.Graph(), {}
    for p in places:
        env_h[p] = head.node_copy(p)
    for n in head_nodes:
        env_h[n] = head.node_copy(n, lambda a: env_h[a])
    head.output(tuple(env_h[n] for n in crossing))
    tail, env_t = fx.Graph(), {}
    for p in places:
        env_t[p] = tail.node_copy(p)
    for n in crossing:
        env_t[n] = tail.placeholder(f"{n.name}_from_head")
    for n in tail_nodes:
        env_t[n] = tail.node_copy(n, lambda a: env_t[a])
    tail.output(fx.map_arg(out_node.args[0], lambda a: env_t[a]))
    return fx.GraphModule(module, head), fx.GraphModule(module, tail)


class SegmentRun:
    """Runs a stage's module with hooks around the segment's nodes ([Note: recompute segment]).

    Args:
        module: the stage's GraphModule.
        names: the segment's node names (:func:`segment_names`).
    """

    def __init__(self, module: fx.GraphModule, names: frozenset[str]) -> None:
        self.module = module
        self.names = names
        self.last = [n.name for n in module.graph.nodes if n.name in names][-1]
        # the modules the segment calls: their buffers are the ones the recompute sets and puts back
        # (a buffer a kept node saved must keep its version, so the others are left alone)
        self.owner = nn.ModuleList([module.get_submodule(str(n.target)) for n in module.graph.nodes
                                    if n.name in names and n.op == "call_module"])
        self.split = _split_prefix(module, names)  # the planner's segments are prefixes: no interpreter

    def __call__(self, args: Sequence[torch.Tensor], hooks: Hooks, replay: bool) -> Any:
        """The module's outputs on ``args`` with ``hooks()`` around each segment node; ``replay``:
        stop after the segment's last node (returns None), the nodes before it without grad."""
        if self.split is not None:
            head, tail = self.split
            with hooks() if not replay else contextlib.nullcontext():
                mids = head(*args)
            return None if replay else tail(*args, *mids)
        interp = _Interpreter(self.module, self.names, hooks if not replay else contextlib.nullcontext, replay,
                              self.last)
        try:
            return interp.run(*args)
        except _Stop:
            return None
