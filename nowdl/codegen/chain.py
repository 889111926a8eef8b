"""Run a plan's StageModules one after another in one process: what ``cm(x)`` runs.

The stages are the ones training runs (:func:`nowdl.codegen.stage.build_stages`); chaining
them feeds every stage its inputs by value name (see [Note: stage values] in
:mod:`nowdl.codegen.stage`) and rebuilds the model's output structure from the last stage's
values, so a stage that computes something else than the model shows in ``cm(x)``. A spatial
stage runs its plain module on the whole image (its tiles need several ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from nowdl.codegen.outputs import fill_outputs
from nowdl.codegen.stage import StageModule, build_stages
from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan

__all__ = ["StageChain", "chain_stages"]


class StageChain:
    """The stages of one plan, called like the model: ``chain(*inputs)`` returns what it returns."""

    def __init__(self, stages: Sequence[StageModule], graph: fx.Graph) -> None:
        self.stages = list(stages)  # in stage order
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.data = [n.name for n in placeholders]  # the model inputs' value names, in order
        self._defaults = {n.name: n.args[0] for n in placeholders if n.args}  # forward's default arguments
        self._graph = graph  # flattens the inputs as the traced graph does (a torch.export pytree)

    def __call__(self, *inputs: Any) -> Any:
        """Run every stage in order on the values the earlier ones made; the model's output.

        Raises:
            NowdlError: the inputs do not flatten to the graph's placeholders (counts them).
        """
        flat = list(self._graph.process_inputs(*inputs))
        need = [v for v in self.data[len(flat):] if v not in self._defaults]
        if len(flat) > len(self.data) or need:
            raise NowdlError(f"the stages take {len(self.data)} model input(s) ({', '.join(self.data)}) but got "
                             f"{len(flat)}: call with the inputs the model was traced with")
        values: dict[str, Any] = dict(zip(self.data, flat, strict=False))
        values.update((v, self._defaults[v]) for v in self.data[len(flat):])
        for st in self.stages:
            values.update(st.run(values))
        last = self.stages[-1]
        return fill_outputs(last.output_tree, [values[v] for v in last.outputs])


def chain_stages(gm: fx.GraphModule, plan: Plan) -> StageChain:
    """The plan's stages built from ``gm`` as training builds them, chained in one process.

    Raises:
        PlanError: the plan does not fit this graph (see ``build_stages``).
        NowdlError: a parameter is used by two stages (see ``build_stages``).
    """
    return StageChain(build_stages(gm, plan), gm.graph)
