"""Inference plans: what a forward-only run holds, as a profile the training cost model can take.

[Note: inference memory] An inference plan runs each micro-batch's forward once, under
``torch.no_grad``: nothing is saved for a backward, there are no gradients and no optimizer
state. A stage then holds its parameters and buffers, plus the activations *live* at the node
it is running: every output already made whose last reader has not run yet (the fx code the
stages run drops each value after its last use). :func:`inference_profile` turns a training
profile into one whose nodes say exactly that: no backward time, no gradient or optimizer
bytes, nothing saved (``act_bytes`` 0), and as workspace the bytes live while the node runs
(:func:`live_bytes`: its inputs, its output and everything made earlier that a later node
still reads) plus the node's own forward transient (``fwd_workspace_bytes``: a convolution's
library workspace, [Note: convolution workspace] in profiler/memory.py; the backward's is not run). The cost model charges a stage its largest
workspace, so a one-stage plan's figure is the forward's peak.

Across pipeline stages the live set is an upper bound: a node's live set counts values made on
earlier stages that only later stages read (the stage itself never holds them) as well as the
received values that ``recv_bytes`` also counts. Views (reshape, getitem) are counted as new
tensors. :func:`inference_stages` sets what a forward-only schedule holds of boundary tensors:
the next micro-batch's receive posted ahead (``RECV_LOOKAHEAD``) and one pending send; no
long-skip gradient waits. The gradient all-reduce of data-parallel copies costs nothing (the
``Costs.inference`` flag, read by ``grad_sync_s``).

An inference plan also records the ops that depend on the whole image
(:func:`record_whole_image_ops`, [Note: whole-image ops]) and what streaming an image in several
windows costs on top of the writing pass: ``config.statistics_passes``, the statistics passes
(the deepest op's pass), each the prefix of one window's forward (``predicted.step_s``) that its
ops read, per window ([Note: statistics passes] in runtime/predict/passes.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch.fx as fx

from nowdl.errors import NowdlError
from nowdl.partitioner.config.candidate import PlanRequest
from nowdl.partitioner.costs.problem import StageSpec
from nowdl.partitioner.costs.tile_overhead import tile_op_seconds
from nowdl.partitioner.spatial.tileable import spatial_rules
from nowdl.partitioner.spatial.whole_image import pass_prefixes
from nowdl.plan.plan import Plan
from nowdl.profiler.cost import NodeCost, Profile
from nowdl.schedule.actions import FORWARD_ONLY
from nowdl.schedule.orders import RECV_LOOKAHEAD

__all__ = ["live_bytes", "grad_live_bytes", "inference_profile", "inference_stages", "inference_request", "mark_inference",
           "record_whole_image_ops", "node_forward_s"]

_NOT_ACTIVATIONS = ("get_attr", "output")


def live_bytes(nodes: Sequence[NodeCost], edges: Sequence[tuple[str, str]]) -> list[int]:
    """Per node, in graph order: bytes of the values alive while it runs.

    A value (a node's output) is alive from its node until its last reader has run (until its
    own node when nothing reads it); parameters (``get_attr``) and the ``output`` node are not
    activations. The model's outputs stay alive to the end (the ``output`` node reads them), and
    so do its inputs (``placeholder``: the caller holds the batch during the whole forward).

    >>> from nowdl.profiler.cost import NodeCost as N
    >>> live_bytes([N("x", "placeholder", "", out_bytes=4), N("a", "call_module", "", out_bytes=8),
    ...             N("b", "call_module", "", out_bytes=8), N("c", "call_function", "", out_bytes=8),
    ...             N("output", "output", "")],
    ...            [("x", "a"), ("a", "b"), ("a", "c"), ("b", "c"), ("c", "output")])
    [4, 12, 20, 28, 12]
    """
    index = {n.name: i for i, n in enumerate(nodes)}
    end = len(nodes) - 1
    last = [end if n.op == "placeholder" else i for i, n in enumerate(nodes)]
    for u, v in edges:
        if u in index and v in index:
            last[index[u]] = max(last[index[u]], index[v])
    delta = [0] * (len(nodes) + 1)  # +bytes where a value is made, -bytes after its last reader
    for i, n in enumerate(nodes):
        if n.op in _NOT_ACTIVATIONS or n.out_bytes <= 0:
            continue
        delta[i] += n.out_bytes
        delta[last[i] + 1] -= n.out_bytes
    out, live = [], 0
    for i, n in enumerate(nodes):
        live += delta[i]
        out.append(live if n.op != "output" else sum(nodes[index[u]].out_bytes for u, v in edges
                                                     if v == n.name and u in index) + sum(
            m.out_bytes for m in nodes if m.op == "placeholder"))
    return out


def grad_live_bytes(nodes: Sequence[NodeCost], edges: Sequence[tuple[str, str]]) -> list[int]:
    """Per node, in graph order: bytes of the activation gradients alive during its backward.

    The backward runs the nodes in reverse. The gradient of a node's output exists from the
    backward of its latest reader (which makes it) until its own backward (which consumes it), so
    during the backward of node ``v`` every node ``u <= v`` with a reader ``w >= v`` holds its
    output's gradient: ``v``'s own, the ones ``v``'s backward is making, and long skips' gradients
    made by far readers and waiting for their producer (a UNet's encoder). Inputs (placeholders)
    and parameters hold none.

    >>> from nowdl.profiler.cost import NodeCost as N
    >>> grad_live_bytes([N("x", "placeholder", "", out_bytes=4), N("a", "call_module", "", out_bytes=8),
    ...                  N("b", "call_module", "", out_bytes=2), N("c", "call_function", "", out_bytes=8),
    ...                  N("output", "output", "")],
    ...                 [("x", "a"), ("a", "b"), ("a", "c"), ("b", "c"), ("c", "output")])
    [0, 8, 10, 18, 8]
    """
    index = {n.name: i for i, n in enumerate(nodes)}
    latest = list(range(len(nodes)))  # the latest reader of each node's output
    for u, v in edges:
        if u in index and v in index:
            latest[index[u]] = max(latest[index[u]], index[v])
    delta = [0] * (len(nodes) + 1)
    for i, n in enumerate(nodes):
        if n.op in ("placeholder", "get_attr", "output") or n.out_bytes <= 0 or latest[i] == i:
            continue
        delta[i] += n.out_bytes  # alive for the backwards of nodes i .. latest[i] (counted from the end)
        delta[latest[i] + 1] -= n.out_bytes
    out, alive = [], 0
    for i in range(len(nodes)):
        alive += delta[i]
        out.append(alive)
    return out


def inference_profile(prof: Profile) -> Profile:
    """``prof`` as a forward-only run costs it ([Note: inference memory]): no backward, no
    gradients, no optimizer state, nothing saved; each node's workspace is the bytes live while
    it runs plus its own transient. Parameters and buffers keep their bytes."""
    live = live_bytes(prof.nodes, prof.edges)
    nodes = [dataclasses.replace(n, bwd_s=0.0, saved_bytes=0, act_bytes=0, self_saved=False, grad_bytes=0,
                                 optim_bytes=0, workspace_bytes=int(w + n.fwd_workspace_bytes))
             for n, w in zip(prof.nodes, live, strict=True)]
    return dataclasses.replace(prof, nodes=nodes, optimizer="none")


def inference_stages(stages: Sequence[StageSpec]) -> list[StageSpec]:
    """The stages of a forward-only schedule: one micro-batch in flight, the next one's receive
    posted ahead, one send pending, no gradient waits; the link carries the forward only."""
    return [dataclasses.replace(s, inflight=1, recv_held=float(RECV_LOOKAHEAD), send_held=1.0, skip_wait=(),
                                link_s_per_byte=s.link_s_per_byte / 2.0) for s in stages]


def inference_request(req: PlanRequest) -> PlanRequest:
    """``req`` for an inference plan: one replica (GEMS-MASTER fills training bubbles), no global
    batch to match (any batch is cut into steps), GPipe's forward order for the search, and one
    micro-batch per step unless ``req`` pins ``micro_batches`` (pin more to pipeline many images).

    Raises:
        NowdlError: ``req`` pins ``replicas=2``.
    """
    if req.replicas == 2:
        raise NowdlError("replicas=2 (GEMS-MASTER) mirrors a second replica to fill the bubbles of training's "
                         "backward; an inference plan has no backward: leave replicas unset (or 1) with train=False")
    return dataclasses.replace(req, replicas=1, schedule="gpipe", global_batch=None,
                               micro_batches=req.micro_batches or 1)


def mark_inference(plan: Plan, gm: fx.GraphModule | None = None, prof: Profile | None = None,
                   tile_op_s: Mapping[str, float] | None = None) -> None:
    """Record in ``plan`` that it is an inference plan with a forward-only schedule, and, given the
    graph and profile it was made from, its whole-image ops (:func:`record_whole_image_ops`;
    ``tile_op_s``: the spec's, [Note: tiled runtime overhead])."""
    plan.config["inference"] = True
    plan.profile["optimizer"] = "inference"
    plan.config["schedule"] = FORWARD_ONLY
    pinned = plan.config.get("pinned")
    if isinstance(pinned, dict) and pinned.get("schedule") == "gpipe":
        pinned.pop("schedule")
    plan.schedule["name"] = FORWARD_ONLY
    plan.schedule["inflight"] = [1] * len(plan.stages)
    for st in plan.stages:
        if isinstance(st.predicted, dict) and "inflight" in st.predicted:
            st.predicted["inflight"] = 1.0
    if gm is not None and prof is not None:
        record_whole_image_ops(plan, gm, prof, tile_op_s)


def node_forward_s(plan: Plan, gm: fx.GraphModule, prof: Profile, tile_op_s: Mapping[str, float] | None = None
                   ) -> dict[str, float]:
    """Per node, one rank's forward seconds on ``plan``: its profiled time over its stage's
    spatial parts, plus the spatial runtime's own work per tiled op (``tile_op_s``, [Note: tiled
    runtime overhead])."""
    parts = {n: st.parts for st in plan.stages for n in st.nodes}
    rules = spatial_rules(gm, prof.out_ranks()) if tile_op_s else {}
    return {n.name: n.fwd_s / parts.get(n.name, 1) + tile_op_seconds(rules.get(n.name), parts.get(n.name, 1), tile_op_s,
                                                                   None, inference=True)[1] for n in prof.nodes}


def record_whole_image_ops(plan: Plan, gm: fx.GraphModule, prof: Profile,
                           tile_op_s: Mapping[str, float] | None = None) -> None:
    """Record in an inference ``plan`` the ops of ``gm`` that depend on the whole image
    (``config.whole_image_ops``) and the statistics passes streaming needs
    (``config.statistics_passes``): ``passes``; ``forward_s``, one window's forward
    (``predicted.step_s`` less the statistics passes of stages on sequential tiles, which a
    streamed window does not run: predict's passes take their place); ``prefix``, per pass the
    share of the forward's node time (:func:`node_forward_s`) it runs (the convolutions no op of
    the pass reads give zeros); ``seconds_per_window``, ``forward_s`` times the sum of ``prefix``:
    what each window costs on top of its writing pass."""
    nd = len(plan.model["inputs"][0]) - 2
    ops, needed = pass_prefixes(gm, {n.name: n.out_shape for n in prof.nodes}, nd)
    passes = max((int(o["pass"]) for o in ops), default=0)
    seq = sum(float(st.predicted.get("norm_passes_s", 0.0)) for st in plan.stages) if passes else 0.0
    forward = max(0.0, float(plan.predicted.get("step_s", 0.0)) - seq)
    times = node_forward_s(plan, gm, prof, tile_op_s)
    total = sum(times.values())
    prefix = [1.0 - sum(t for n, t in times.items() if n in needed and k not in needed[n]) / total
              if total > 0 else 1.0 for k in range(1, passes + 1)]
    plan.config["whole_image_ops"] = ops
    plan.config["statistics_passes"] = {"passes": passes, "forward_s": forward, "prefix": [round(p, 4) for p in prefix],
                                        "seconds_per_window": forward * sum(prefix)}
