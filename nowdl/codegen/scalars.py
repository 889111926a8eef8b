"""Values that cross stages but are not tensors: sizes read off tensors, folded to constants.

Only tensors travel between ranks. A size read off a tensor (``x.shape[0]``, ``x.size(1)``)
is fixed by the plan's input shapes, so :func:`_fold_scalars` runs the graph once on fake
tensors of those shapes (``_fake_values``) and hands each later stage the constant; a value
that depends on the tensors' data (``x.item()``) is refused with advice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan
from nowdl.trace.metadata import metadata_nodes

__all__: list[str] = []  # private helpers of nowdl.codegen.stage


def _fold_scalars(gm: fx.GraphModule, plan: Plan, crossing: list[fx.Node]) -> dict[str, Any]:
    """The values among ``crossing`` (used by a later stage) that are not tensors, as constants.

    Only tensors travel between ranks. A size read off a tensor (``x.shape[0]``, ``x.size(1)``,
    ``x.ndim``) is fixed by the plan's input shapes, so the stages that use it get it as a constant:
    the graph is run once on fake tensors of those shapes (in eval mode: no buffer moves).

    Raises:
        NowdlError: a non-tensor value that depends on tensor values (``x.item()``) or holds
            tensors (a tuple a later stage unpacks) crosses stages.
    """
    sized = {t.producer: t for t in plan.tensors}
    maybe = [n for n in crossing if n.op != "placeholder" and (n.name not in sized or not sized[n.name].bytes)]
    if not maybe:
        return {}
    values = _fake_values(gm, plan, {n.name for n in maybe})
    out: dict[str, Any] = {}
    meta = metadata_nodes(gm)
    for n in maybe:
        v = values.get(n.name)
        if isinstance(v, torch.Tensor):
            continue
        leaves = v if isinstance(v, (tuple, list)) else (v,)
        if (isinstance(v, _DataDependent) or any(isinstance(t, torch.Tensor) for t in leaves)
                or n.name not in meta):
            what = "a value that depends on the tensors' data" if isinstance(v, _DataDependent) else \
                f"a {type(v).__name__}, not a tensor,"
            raise NowdlError(
                f"node {n.name!r} ({n.format_node()}) gives {what} and a later stage uses it: only tensors and "
                "sizes read off tensors can cross between stages. Re-plan so that it and its users share a "
                "stage (for instance with fewer stages), or keep the value a tensor inside the model"
            )
        out[n.name] = v
    return out


@dataclass(frozen=True)
class _DataDependent:
    """A value a fake run cannot know: it depends on the tensors' values."""

    why: str


def _fake_values(gm: fx.GraphModule, plan: Plan, wanted: set[str]) -> dict[str, Any]:
    """Values of the nodes in ``wanted`` when ``gm`` runs on fake inputs of the plan's shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype = getattr(torch, str(plan.profile.get("dtype", "float32")).replace("torch.", ""), torch.float32)
    found: dict[str, Any] = {}

    class _Probe(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            try:
                value = super().run_node(n)
            except Exception as e:  # x.item() on a fake tensor: the value depends on the data
                if n.name not in wanted:
                    raise
                found[n.name] = _DataDependent(f"{type(e).__name__}: {e}")
                return torch.zeros(())
            if n.name in wanted:
                found[n.name] = value
            return value

    modes = [(m, m.training) for m in gm.modules()]  # the model's own modules (fx): put back as they were
    gm.eval()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            inputs = [torch.empty(shape, dtype=dtype) for shape in plan.model["inputs"]]
            _Probe(gm).run(*inputs)
    except Exception as e:
        raise NowdlError(f"could not find the sizes that cross between stages ({sorted(wanted)[:3]}) on fake inputs "
                         f"of shapes {plan.model['inputs']}: {type(e).__name__}: {e}") from e
    finally:
        for m, training in modes:
            m.training = training
    return found
