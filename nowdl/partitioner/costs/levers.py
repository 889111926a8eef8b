"""What recomputing a stage, or offloading its saved activations to host memory, costs and saves.

[Note: recompute cost] A recomputed stage (``Candidate.recompute``) keeps, of each micro-batch
in flight, only its inputs (the received tensors the stage holds anyway, and the model inputs
on stage 0); in its backward it runs its forward again, saving that one micro-batch's
activations, then runs the backward. Its peak is the plain one with one micro-batch's saved
activations instead of ``inflight``: in the Problem, the stage's ``inflight`` becomes 1 and
each placeholder's bytes are multiplied by the old ``inflight`` (they stay per micro-batch).
Its time per micro-batch gains the forward again: each node's time grows by its forward time
(``NodeVectors.fwd``), which on a spatial stage holds the forward halo wait (message latency plus
bytes over the link, less what the op's compute hides: ``exposed_halo_fwd_s``), since the
recompute exchanges every forward halo again; where a variant has no ``fwd`` (plain stages), by
its forward share ``fwd_s / (fwd_s + bwd_s)``. The choice is per stage, the whole stage, or a
prefix of it ([Note: recompute segments] in costs/segments.py): where a stage holds one micro-batch (one stage, the last stage of 1F1B,
one micro-batch) it saves nothing and only costs time, so the planner never chooses it there.

[Note: recompute hooks] The runtime's recompute (``runtime/pipeline/recompute.py``) runs the
stage's forward under saved-tensor hooks: each tensor autograd saves costs a Python pack call in
the forward (a numbered slot, not the tensor), another in the recompute (filling the slot) and an
unpack in the backward. On a CPU that host work adds to the step: ResNet-20's first stage
(bench_recompute_planned Table 2) measured about 1.2x its forward per recompute. It is charged
per micro-batch as ``NodeCost.saved_tensors`` (counted by the profile's accounting run) x the
DeviceSpec's ``recompute_tensor_s``, measured on the machine by running the runtime's
``Recompute`` on a probe stage against the plain forward (``bench_recompute_planned.py``'s
calibration); unset (every built-in spec, nothing measured on a GPU), nothing is charged.

[Note: recompute pending sends] The runner recomputes at the start of a ``B`` action, before it
takes the output gradients that tell it the next stage has posted its receives
(``Transfers.release_done``), and a recomputed stage keeps none of its outputs itself (their
saved copies are slots). So at its first backward the outputs of the ``inflight - 1`` older
micro-batches still wait in their sends, and the recomputed micro-batch's output is alive too:
the recompute's forward peaks at ``saved + inflight x sent`` (plus what the stage holds anyway)
where the plain stage had released them (bench_recompute_planned Table 2, ResNet-20 GPipe m = 4,
stage 0: 3 MiB of pending outputs, 1.06x the plan without this term). The solvers charge it by
raising the stage's ``send_held`` by ``inflight`` (:func:`recompute_send_held`, an upper bound:
added to the backward's workspace); the plan's figure takes the larger of the two peaks
(``memory_breakdown.stage_memory``).

[Note: host offload] An offloaded stage (``Candidate.offload``) copies each saved activation to
host memory on a side stream as the forward makes it and brings it back ahead of the backward
that needs it. On the GPU it holds, during node v's forward, the values live there (every output
made whose last reader has not run: a UNet's skips, ``live_bytes`` of costs/inference.py), and
during v's backward v's saved bytes, the window the runtime fetches back ahead of autograd (at
most ``WINDOW_TENSORS`` of the stage's largest saved tensors, the runtime's ``WINDOW``) and the
activation gradients alive then (``grad_live_bytes`` of costs/inference.py: every output whose
gradient a later node's backward has made and its own backward has not consumed yet, a UNet's
skip gradients waiting for the encoder), each on top of v's workspace: the Problem's workspace of
v grows by the larger of the two, and its saved bytes (placeholders excepted) leave it. On CPU
ranks the host copies are left out of the measured peak ([Note: host copies on CPU] in
profiler/memory.py), so ``benchmarks/bench_out_of_core.py`` and the tests compare like with like. Per micro-batch the stage moves its saved bytes ``A`` out and back
at ``host_link_bw`` (DeviceSpec, one direction per GPU). The copy out overlaps with the
forward and the copy back with the backward; with several micro-batches in flight the link is
full duplex and each direction overlaps with a whole forward + backward slot. So the exposed
time per micro-batch is ``max(0, A/bw - fwd) + max(0, A/bw - bwd)`` when the stage holds one
micro-batch, else ``max(0, A/bw - (fwd + bwd))``. Like message latency ([Note: message
latency] in costmodel.py) the solvers do not weigh it; it is added to the predicted stage time
and step. Host memory is a constraint: the micro-batches in flight keep ``inflight x A`` bytes
on the host per rank, at most ``HOST_USABLE`` of the rank's share of its node's
``host_memory`` (the node's RAM divided by its GPUs).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from nowdl.partitioner.config.candidate import Candidate
from nowdl.partitioner.costs.inference import grad_live_bytes, live_bytes
from nowdl.partitioner.costs.problem import NodeVectors, Problem, StageSpec
from nowdl.partitioner.costs.segments import segment_variant
from nowdl.plan.topology import node_spec_for
from nowdl.profiler.cost import Profile

__all__ = ["HOST_USABLE", "RECOMPUTE_TAG", "OFFLOAD_TAG", "host_share", "apply_levers", "recompute_vectors",
           "recompute_send_held",
           "offload_vectors", "offload_time_s", "host_bytes", "lever_figures", "LEVER_KEYS"]

HOST_USABLE = 0.8  # of a GPU's share of host memory, what offloaded activations may take (the rest: OS, data)
WINDOW_TENSORS = 2  # runtime/pipeline/offload.py's WINDOW: largest saved tensors' worth fetched back ahead
RECOMPUTE_TAG = "+rc"
OFFLOAD_TAG = "+off"
LEVER_KEYS = ("recompute_s", "offload_s", "recomputed_bytes", "offloaded_bytes", "saved_held")
"""Per-stage figures :func:`lever_figures` adds to a plan's ``stages[i].predicted``."""


def host_share(spec: Any, device_spec: Any = None) -> float | None:
    """Bytes of host memory one GPU may fill with offloaded activations: ``HOST_USABLE`` x the
    spec's ``host_memory`` / the GPUs of its node (the spec's ``"node"``, the built-in DGX node,
    else 1); None when the spec has no ``host_memory``."""
    host = getattr(spec, "host_memory", None)
    if not host:
        return None
    arg = device_spec if isinstance(device_spec, (str, os.PathLike)) else None
    node = node_spec_for(arg if arg is not None else getattr(spec, "name", None), getattr(spec, "name", None))
    return HOST_USABLE * float(host) / (node.gpus_per_node if node is not None else 1)


def _fwd_share(fwd: float, bwd: float) -> float:
    return fwd / (fwd + bwd) if fwd + bwd > 0 else 0.0


def recompute_vectors(prof: Profile, base: NodeVectors, inflight: int, tensor_s: float = 0.0) -> NodeVectors:
    """``base`` for a recomputed stage that held ``inflight`` micro-batches ([Note: recompute
    cost]); ``tensor_s``: seconds per saved tensor ([Note: recompute hooks])."""
    act = [a * inflight if n.op == "placeholder" else a for n, a in zip(prof.nodes, base.act, strict=True)]
    if base.fwd is not None:
        time = [t + f for t, f in zip(base.time, base.fwd, strict=True)]
    else:
        time = [t * (1.0 + _fwd_share(n.fwd_s, n.bwd_s)) for n, t in zip(prof.nodes, base.time, strict=True)]
    time = [t + n.saved_tensors * tensor_s for n, t in zip(prof.nodes, time, strict=True)]
    return NodeVectors(act=act, time=time, workspace=base.workspace, out=base.out)


def recompute_send_held(spec: StageSpec) -> float:
    """``send_held`` of a stage once recomputed: its gradient buffers plus the ``inflight``
    outputs alive at its recompute's forward ([Note: recompute pending sends])."""
    return spec.send_factor + spec.inflight


def offload_vectors(prof: Profile, base: NodeVectors) -> NodeVectors:
    """``base`` for an offloaded stage ([Note: host offload])."""
    keep = [n.op == "placeholder" for n in prof.nodes]
    act = [a if k else 0.0 for a, k in zip(base.act, keep, strict=True)]
    off = [0.0 if k else a for a, k in zip(base.act, keep, strict=True)]
    # the forward's live set at each node, at this variant's sizes (the inputs are in ``act``)
    sized = [dataclasses.replace(n, out_bytes=0 if k else int(o))
             for n, k, o in zip(prof.nodes, keep, base.out, strict=True)]
    live = live_bytes(sized, prof.edges)
    grads = grad_live_bytes(sized, prof.edges)
    window = WINDOW_TENSORS * max(off, default=0.0)  # fetched back ahead of autograd (runtime's WINDOW)
    ws = [w + max(live[v], grads[v] + a + window)
          for v, (w, a) in enumerate(zip(base.workspace, off, strict=True))]
    return NodeVectors(act=act, time=base.time, workspace=ws, out=base.out)


def apply_levers(prof: Profile, cand: Candidate, stages: list[StageSpec],
                 variants: dict[str, NodeVectors], tensor_s: float = 0.0) -> list[StageSpec]:
    """``stages`` with ``cand``'s recomputed and offloaded stages on their lever variants (added
    to ``variants``); unchanged for a candidate without levers. ``tensor_s``: the recompute's
    seconds per saved tensor ([Note: recompute hooks])."""
    out = list(stages)
    cuts = dict(cand.segments)  # [Note: recompute segments] in costs/segments.py
    for s in cand.recompute:
        spec = out[s]
        key = f"{spec.variant}{RECOMPUTE_TAG}{spec.inflight}"
        if key not in variants:
            variants[key] = recompute_vectors(prof, variants[spec.variant], spec.inflight, tensor_s)
        if s in cuts:
            key = segment_variant(prof, variants, spec.variant, key, spec.inflight, cuts[s])
        out[s] = dataclasses.replace(spec, variant=key, inflight=1, send_held=recompute_send_held(spec))
    for s in cand.offload:
        spec = out[s]
        key = f"{spec.variant}{OFFLOAD_TAG}"
        if key not in variants:
            variants[key] = offload_vectors(prof, variants[spec.variant])
        out[s] = dataclasses.replace(spec, variant=key)
    return out


def offload_time_s(cand: Candidate, sums: Sequence[dict[str, float]], host_link_bw: float | None) -> list[float]:
    """Per stage: the exposed host-copy seconds per micro-batch of [Note: host offload] (0 where
    the stage is not offloaded). ``sums``: ``costmodel.stage_sums`` of the split."""
    out = [0.0] * cand.stages
    if not cand.offload:
        return out
    bw = host_link_bw or 0.0
    inflight = cand.inflight()
    for s in cand.offload:
        a = sums[s]["act_bytes"]
        copy = a / bw if bw > 0 else float("inf")
        f, b = sums[s]["fwd_s"], sums[s]["bwd_s"]
        out[s] = (max(0.0, copy - f) + max(0.0, copy - b)) if inflight[s] <= 1 else max(0.0, copy - (f + b))
    return out


def host_bytes(cand: Candidate, sums: Sequence[dict[str, float]]) -> list[float]:
    """Per pipeline slot (a rank of it): host bytes its offloaded stages hold at their peak,
    ``inflight x saved`` each (MASTER: both stages of the slot)."""
    k = cand.stages
    inflight = cand.inflight()
    per_stage = [inflight[s] * sums[s]["act_bytes"] if s in cand.offload else 0.0 for s in range(k)]
    if cand.replicas == 2:
        return [per_stage[j] + per_stage[k - 1 - j] for j in range(k)]
    return per_stage


def lever_figures(problem: Problem, cand: Candidate, stage_of: Sequence[int], sums: Sequence[dict[str, float]],
                  host_link_bw: float | None) -> list[dict[str, float]]:
    """Per stage, the keys of :data:`LEVER_KEYS`: seconds per micro-batch that recomputation
    and the exposed host copies add, bytes per rank the recomputation keeps off the GPU at the
    peak (``(inflight - 1) x saved``), bytes held on the host, and how many micro-batches' saved
    activations the stage holds at its peak."""
    k = cand.stages
    inflight = cand.inflight()
    off_s = offload_time_s(cand, sums, host_link_bw)
    rc_s = [0.0] * k
    for v, s in enumerate(stage_of):
        name = problem.stages[s].variant
        if RECOMPUTE_TAG in name:
            base = problem.variants[name.rsplit(RECOMPUTE_TAG, 1)[0]]
            rc_s[s] += problem.variants[name].time[v] - base.time[v]
    hb = [inflight[s] * sums[s]["act_bytes"] if s in cand.offload else 0.0 for s in range(k)]
    return [{"recompute_s": rc_s[s], "offload_s": off_s[s],
             "recomputed_bytes": (inflight[s] - 1) * sums[s]["act_bytes"] if s in cand.recompute else 0.0,
             "offloaded_bytes": hb[s], "saved_held": float(problem.stages[s].inflight)} for s in range(k)]
