"""Build each pipeline stage of a Plan as a runnable fx module with explicit, named inputs and outputs.

[Note: stage values] A *value* is named by the fx node of the ORIGINAL traced graph that
produces it (``"encoders_0_relu2"``, ``"x"``). For stage ``i``:

* ``inputs`` are the values stage ``i`` uses but does not compute, in the original graph's
  order; ``forward`` takes them positionally in that order. ``producers[v]`` is the stage that
  computes ``v``, or ``-1`` when ``v`` is a model input (a placeholder): model inputs are never
  sent between stages, every stage that needs one reads it from the data loader itself (a
  UNet skip from the input goes to the last stage as ``producers["x"] == -1``).
* ``outputs`` are the values stage ``i`` computes that a later stage uses, in the original
  graph's order; ``consumers[v]`` lists every stage that uses ``v`` (sorted). A value used by
  several later stages (a long skip) is sent directly from its producer to each of them.
* The model's output: the last stage returns the model's output tensors, flattened (a tensor:
  one value; a tuple/list: its tensors in order; a dict: its tensors in insertion order;
  constants such as ``None`` are dropped; a value returned twice is returned once), with
  ``consumers[v] == [len(plan.stages)]`` ("the loss"). An output computed by an earlier stage
  is sent to the last stage, which takes it as an input and returns it unchanged. The last
  stage's ``output_tree`` is the model's own output structure with each tensor an
  :class:`OutputSlot` into ``outputs``: ``fill_outputs(tree, values)`` rebuilds what the
  model returns, so a loss sees the same structure as with the model itself.
* ``forward`` always returns a tuple, even of one tensor (or none).

Parameters are not copied: a stage's submodules, parameters and buffers ARE the traced
graph's (the model's own objects for fx-traced models), re-parented under their original
qualified names, so ``param_names`` is usually the identity map and a runtime can load and
save state under the model's ``state_dict()`` keys. ``get_attr`` nodes are materialised in
every stage that uses them (a parameter is never sent); parameters or buffers used by two
stages (tied weights, a module called twice) are refused: their gradients would have to be
summed across ranks, which nowdl does not do yet. Parameters the forward never uses belong
to no stage.

This module assigns nodes to stages and builds them; the model's output structure lives in
:mod:`nowdl.codegen.outputs`, the non-tensor values that cross stages in
:mod:`nowdl.codegen.scalars`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from nowdl.codegen.outputs import OutputSlot, fill_outputs, model_outputs, output_tree
from nowdl.codegen.scalars import _fold_scalars
from nowdl.errors import NowdlError, PlanError
from nowdl.plan.plan import Plan

# model_outputs, output_tree, fill_outputs and OutputSlot live in nowdl.codegen.outputs
__all__ = ["StageModule", "build_stages", "model_outputs", "output_tree", "fill_outputs", "OutputSlot", "DATA"]

#: ``producers[v] == DATA``: ``v`` is a model input, fed to the stage by its data loader.
DATA = -1


@dataclass
class StageModule:
    """One pipeline stage: a GraphModule and where its inputs come from and its outputs go."""

    index: int
    module: fx.GraphModule  # forward(*inputs) -> tuple of tensors, always a tuple
    inputs: list[str]  # value names (fx node names of the original graph), forward's argument order
    outputs: list[str]  # value names, in the order forward returns them
    producers: dict[str, int] = field(default_factory=dict)  # input -> producing stage, -1: the data
    consumers: dict[str, list[int]] = field(default_factory=dict)  # output -> stages (K: the loss)
    param_names: dict[str, str] = field(default_factory=dict)  # module's name -> original qualified name
    # last stage only: the model's output structure, each tensor an OutputSlot into ``outputs``
    output_tree: Any = None

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run the stage: ``forward(*inputs)`` (a tuple, ordered like ``outputs``)."""
        out = self.module(*inputs)
        assert isinstance(out, tuple)
        return out

    def run(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the stage on values looked up by name; returns ``{output name: tensor}``.

        Raises:
            NowdlError: a value this stage needs is not in ``values`` (names it and its producer).
        """
        missing = [v for v in self.inputs if v not in values]
        if missing:
            raise NowdlError(
                f"stage {self.index} needs value(s) "
                + ", ".join(f"{v!r} (from {_who(self.producers.get(v, DATA))})" for v in missing)
                + " that were not given: run the producing stages first (or feed the model input)"
            )
        out = self(*(values[v] for v in self.inputs))
        return dict(zip(self.outputs, out, strict=True))


def _who(stage: int) -> str:
    return "the data loader" if stage == DATA else f"stage {stage}"


def _assign_stages(gm: fx.GraphModule, plan: Plan) -> tuple[dict[str, int], list[fx.Node]]:
    """Stage of every placeholder and compute node (get_attr nodes excluded: they go where used)."""
    where = plan.node_stage()
    k = len(plan.stages)
    nodes = list(gm.graph.nodes)
    compute = [n for n in nodes if n.op not in ("placeholder", "output", "get_attr")]
    missing = [n.name for n in compute if n.name not in where]
    if missing:
        raise PlanError(
            f"the plan does not place node(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} of this "
            "graph: it was made for another model or tracer; re-plan"
        )
    names = {n.name for n in nodes}
    extra = [n for n in where if n not in names]
    if extra:
        raise PlanError(
            f"the plan places node(s) {extra[:5]}{' ...' if len(extra) > 5 else ''} that this graph does not "
            "have: it was made for another model or tracer; re-plan"
        )
    stage: dict[str, int] = {}
    for n in nodes:
        if n.op == "placeholder":
            stage[n.name] = DATA
        elif n.op == "output":
            stage[n.name] = k - 1
        elif n.op != "get_attr":
            stage[n.name] = where[n.name]
    for n in compute:
        for a in n.all_input_nodes:
            sa = stage.get(a.name)
            if sa is not None and sa > stage[n.name]:
                raise PlanError(
                    f"node {n.name!r} in stage {stage[n.name]} uses {a.name!r}, which the plan puts in the later "
                    f"stage {sa}: a stage may only use values of earlier stages; the plan is invalid, re-plan"
                )
    return stage, nodes


def _env(local: dict[str, Any]) -> Callable[[fx.Node], Any]:
    """Map a node of the original graph to its copy in the stage graph (or a folded constant)."""
    return lambda a: local[a.name]


def _owned_tensors(gm: fx.GraphModule, node: fx.Node) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers (gm's qualified names) that a call_module/get_attr node touches."""
    target = str(node.target)
    if node.op == "call_module":
        mod = gm.get_submodule(target)
        prefix = target + "." if target else ""
        pairs: list[tuple[str, torch.Tensor]] = [(prefix + k, t) for k, t in mod.named_parameters()]
        pairs += [(prefix + k, t) for k, t in mod.named_buffers()]
        return pairs
    if node.op == "get_attr":
        owner, _, leaf = target.rpartition(".")
        mod = gm.get_submodule(owner) if owner else gm
        if leaf in mod._parameters or leaf in mod._buffers:
            t = getattr(mod, leaf)
            if isinstance(t, torch.Tensor):
                return [(target, t)]
    return []


def build_stages(gm: fx.GraphModule, plan: Plan) -> list[StageModule]:
    """Cut ``gm`` into ``len(plan.stages)`` StageModules following ``plan.stages[i].nodes``.

    Chaining the stages (each fed its ``inputs`` by name, see ``StageModule.run``) computes
    exactly what ``gm`` computes, in train and eval mode, with the same autograd graph; see
    [Note: stage values] in this module for the conventions.

    Raises:
        PlanError: the plan does not fit this graph (a node missing or unknown, or a stage
            using a value of a later stage).
        NowdlError: a parameter or buffer is used by two stages (tied weights across stages).
    """
    k = len(plan.stages)
    stage, nodes = _assign_stages(gm, plan)
    out_node = next(n for n in nodes if n.op == "output")
    final = model_outputs(gm)

    # Which stages use each node (get_attr nodes are local wherever used, never sent).
    users: dict[str, set[int]] = {n.name: set() for n in nodes}
    attr_stages: dict[str, set[int]] = {n.name: set() for n in nodes if n.op == "get_attr"}
    for n in nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        s = stage[n.name]
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                attr_stages[a.name].add(s)
            elif stage[a.name] != s:
                users[a.name].add(s)
    for a in out_node.all_input_nodes:
        if a.op == "get_attr":
            attr_stages[a.name].add(k - 1)
    for n in nodes:  # an unused get_attr stays where the plan put it (or stage 0)
        if n.op == "get_attr" and not attr_stages[n.name]:
            attr_stages[n.name].add(plan.node_stage().get(n.name, 0))
    # Python values (sizes read off a tensor) used by later stages: constants of the plan's shapes
    folded = _fold_scalars(gm, plan, [n for n in nodes if users[n.name] and n.name not in final])
    for v in folded:
        users[v] = set()

    # Parameters and buffers: each belongs to exactly one stage.
    owner: dict[int, tuple[str, int, str]] = {}
    for n in nodes:
        if n.op == "call_module":
            here = {stage[n.name]}
        elif n.op == "get_attr":
            here = attr_stages[n.name]
        else:
            continue
        for qual, t in _owned_tensors(gm, n):
            for s in sorted(here):
                prev = owner.setdefault(id(t), (qual, s, n.name))
                if prev[1] != s:
                    raise NowdlError(
                        f"parameter/buffer {prev[0]!r} is used by stage {prev[1]} (node {prev[2]!r}) and stage {s} "
                        f"(node {n.name!r}): weights shared across stages need their gradients summed across "
                        "ranks, which nowdl does not support yet. Untie the weights, or plan with fewer "
                        "stages so that both uses fall in one stage"
                    )

    orig_names: dict[int, str] = {}
    for name, t in list(gm.named_parameters(remove_duplicate=True)) + list(gm.named_buffers(remove_duplicate=True)):
        orig_names.setdefault(id(t), name)

    order = {n.name: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    stages: list[StageModule] = []
    for i in range(k):
        graph = fx.Graph()
        local: dict[str, Any] = {}
        # inputs: values used here but made elsewhere (or model inputs), in graph order
        needed: set[str] = set()
        members = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output") and stage[n.name] == i]
        for n in members:
            for a in n.all_input_nodes:
                if a.op != "get_attr" and stage[a.name] != i and a.name not in folded:
                    needed.add(a.name)
        if i == k - 1:
            for name in final:
                if by_name[name].op != "get_attr" and stage[name] != i:
                    needed.add(name)
        inputs = sorted(needed, key=order.__getitem__)
        for v in inputs:
            src = by_name[v]
            ph = graph.placeholder(v, type_expr=src.type)
            ph.meta = dict(src.meta)
            local[v] = ph
        local.update(folded)  # constants where a later stage reads a size (never placeholders)
        env = _env(local)
        for n in nodes:
            if n.op == "get_attr" and i in attr_stages[n.name]:
                local[n.name] = graph.node_copy(n, env)
        for n in members:
            local[n.name] = graph.node_copy(n, env)
        if i == k - 1:
            outputs = list(final)
            consumers = {v: [k] for v in outputs}
        else:
            outputs = [n.name for n in members if users[n.name] or n.name in final]
            consumers = {}
            for v in outputs:
                cs = set(users[v])
                if v in final:
                    cs.add(k - 1)
                consumers[v] = sorted(cs)
        graph.output(tuple(local[v] for v in outputs))
        graph.lint()
        module = fx.GraphModule(gm, graph, class_name=f"Stage{i}")
        producers = {v: stage[v] for v in inputs}
        param_names: dict[str, str] = {}
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            param_names[name] = orig_names.get(id(t), name)
        stages.append(StageModule(index=i, module=module, inputs=inputs, outputs=outputs, producers=producers,
                                  consumers=consumers, param_names=param_names,
                                  output_tree=output_tree(gm) if i == k - 1 else None))
    return stages
