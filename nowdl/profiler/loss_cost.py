"""What the loss costs the last stage in memory, measured or by a documented default.

[Note: loss memory] The last stage also runs the loss: for every micro-batch in flight it holds
what the loss saved for its backward (cross-entropy: the log-softmax, one output's size) and,
on a device other than the CPU, the labels copied there (the loss saves them too); while the
loss's backward runs, its gradients (cross-entropy: of the log-softmax and of the output) are
alive on top. The cost model charges this on the graph's ``output`` node (pinned to the last
stage): ``saved + target`` as its activations, ``workspace`` as its transient.

* measured (:func:`measure_loss_cost`): the loss run once on a random output of the model's
  output shape and the given target, under :class:`AllocTracker`;
* default (:func:`default_loss_cost`, no loss or no target given): ``saved`` = one output's
  bytes, ``workspace`` = two, and labels of the output's bytes held on non-CPU devices (a
  per-pixel loss: labels shaped like the output).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nowdl.profiler.cost import NodeCost, Profile
from nowdl.profiler.memory import AllocTracker, tensor_bytes

log = logging.getLogger(__name__)

__all__ = ["LossCost", "default_loss_cost", "measure_loss_cost", "output_bytes", "with_loss", "loss_cost_for"]


@dataclass(frozen=True)
class LossCost:
    """Bytes the loss adds to the last stage ([Note: loss memory])."""

    saved_bytes: int  # per micro-batch in flight, until its backward
    workspace_bytes: int  # transient of the loss's backward, above what is saved
    target_bytes: int  # labels held per micro-batch in flight (copied to the device)
    source: str  # "measured" or "default"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _output_producers(profile: Profile) -> list[NodeCost]:
    """The nodes whose results the graph's ``output`` node returns."""
    outs = {n.name for n in profile.nodes if n.op == "output"}
    producers = {u for u, v in profile.edges if v in outs}
    return [n for n in profile.nodes if n.name in producers]


def output_bytes(profile: Profile) -> int:
    """Bytes of one micro-batch of the model's output (the producers of the ``output`` node)."""
    return sum(n.out_bytes for n in _output_producers(profile))


def _on_cpu(device: str) -> bool:
    """``cpu``, or an estimate for a CPU spec (``estimate:cpu``, ``estimate:cpu-1t-calibrated``:
    the built-in and calibrated CPU specs' names start with ``cpu``)."""
    head = device.split(" ")[0]
    if head.startswith("estimate:"):
        return head[len("estimate:"):].startswith("cpu")
    return head.split(":")[0] == "cpu"


def default_loss_cost(profile: Profile) -> LossCost:
    """One output saved, two output-sized gradients in the backward, output-sized labels off the CPU."""
    out = output_bytes(profile)
    return LossCost(saved_bytes=out, workspace_bytes=2 * out,
                    target_bytes=0 if _on_cpu(profile.device) else out, source="default")


def _example_output(profile: Profile) -> torch.Tensor | None:
    producers = _output_producers(profile)
    if len(producers) != 1:
        return None  # a tuple or dict output: the default
    shape, dtype = producers[0].out_shape, getattr(torch, producers[0].out_dtype.replace("torch.", ""), torch.float32)
    return torch.randn(shape, dtype=dtype) if shape is not None and dtype.is_floating_point else None


def measure_loss_cost(loss_fn: Callable[[Any, Any], torch.Tensor], output: torch.Tensor, target: Any,
                      device: str = "cpu") -> LossCost:
    """Run ``loss_fn(output, target)`` forward and backward once on the CPU and measure its bytes.

    ``target`` is one micro-batch's target; its bytes count as held labels unless ``device`` is
    the CPU (where the runtime passes the caller's tensor through uncopied).
    """
    out = output.detach().requires_grad_(True)
    with AllocTracker() as tracker:
        loss = loss_fn(out, target)
        tracker.poll()
        saved = tracker.current
        loss.backward(torch.ones_like(loss))
        tracker.poll()
        work = max(0, tracker.peak - saved)
    tb = sum(tensor_bytes(t) for t in torch.utils._pytree.tree_leaves(target) if isinstance(t, torch.Tensor))
    return LossCost(saved_bytes=int(saved), workspace_bytes=int(work),
                    target_bytes=0 if _on_cpu(device) else int(tb), source="measured")


def loss_cost_for(profile: Profile, loss_fn: Callable[[Any, Any], torch.Tensor] | None, target: Any) -> LossCost:
    """Measured when both a loss and a target are given and the output is one float tensor, else the default."""
    out = _example_output(profile) if loss_fn is not None and target is not None else None
    if out is None or loss_fn is None:
        return default_loss_cost(profile)
    target = torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, target)
    try:
        return measure_loss_cost(loss_fn, out, target, profile.device)
    except Exception as e:  # a loss that wants other outputs than random ones: the default
        log.warning("could not measure the loss's memory on a random output of shape %s (%s: %s); planning "
                    "with the default charge ([Note: loss memory])", tuple(out.shape), type(e).__name__, e)
        return default_loss_cost(profile)


def with_loss(profile: Profile, cost: LossCost) -> Profile:
    """``profile`` with the loss charged on its ``output`` node ([Note: loss memory])."""
    nodes = [dataclasses.replace(n, act_bytes=n.act_bytes + cost.saved_bytes + cost.target_bytes,
                                 workspace_bytes=max(n.workspace_bytes, cost.workspace_bytes))
             if n.op == "output" else n for n in profile.nodes]
    return dataclasses.replace(profile, nodes=nodes)
