"""Turn a Profile and a Candidate configuration into a partition Problem, and predict step time.

[Note: spatial cost] In a stage of P parts each rank holds one tile: a node's activations,
time, workspace and boundary tensors are divided by P, and a node with a spatial footprint
(conv, pool, bilinear upsample) adds its halo: the padded input it saves (memory) and the
halo it receives and, in backward, sends back (link time, plus a fixed latency per exchange).
Parameters are not divided: every tile rank holds the full weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from nowdl.partitioner.config import Candidate
from nowdl.partitioner.held import backward_grad_bytes, held_buffers
from nowdl.partitioner.problem import NodeVectors, Partition, Problem, StageSpec
from nowdl.partitioner.spatial import SpatialRule, halo_elements, slice_grid
from nowdl.profiler.cost import Profile

__all__ = ["Costs", "build_problem", "predict_step", "tied_nodes", "HALO_LATENCY_S",
           "spatial_dims_of", "dtype_bytes"]

HALO_LATENCY_S = 10e-6  # per halo exchange (one message round to the neighbours)


@dataclass(frozen=True)
class Costs:
    """Profile facts the cost model needs, flattened to lists in node order."""

    profile: Profile
    rules: dict[str, SpatialRule]
    link_bw: float  # bytes/s between GPUs
    mem_cap: float | None
    tied: tuple[tuple[str, ...], ...] = ()  # node groups sharing a weight (``tied_nodes``)

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.profile.nodes]


def spatial_dims_of(profile: Profile) -> int:
    """Spatial dims of the model's input (2 for N,C,H,W)."""
    shapes = profile.input_shapes or [[1, 1, 1, 1]]
    return max(1, len(shapes[0]) - 2)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name ('float32', 'torch.float16', ...); 4 when unknown."""
    return {"float16": 2, "bfloat16": 2, "float64": 8, "int64": 8}.get(dtype.replace("torch.", ""), 4)


def _tiled_vectors(costs: Costs, parts: int, slice_: str) -> NodeVectors:
    prof = costs.profile
    grid = slice_grid(slice_, parts, spatial_dims_of(prof))
    producers: dict[str, str] = {}
    for u, v in prof.edges:
        producers.setdefault(v, u)
    act, time, ws, out = [], [], [], []
    grads = _grad_workspace(prof)
    for n, g in zip(prof.nodes, grads, strict=True):
        rule = costs.rules.get(n.name)
        a = n.act_bytes / parts
        t = n.time_s / parts
        if rule is not None and rule.tileable and rule.halo and any(rule.halo):
            src = producers.get(n.name)
            shape = prof[src].out_shape if src is not None and src in prof else None
            if src is not None and shape is not None and len(shape) >= 3:
                hb = halo_elements(shape, grid, rule.halo) * dtype_bytes(prof[src].out_dtype)
                if n.saved_bytes:
                    a += hb  # the padded input tile is what the op saves
                t += 2 * hb / costs.link_bw + 2 * HALO_LATENCY_S
        act.append(a)
        time.append(t)
        ws.append(max(n.workspace_bytes, g) / parts)
        out.append(n.out_bytes / parts)
    return NodeVectors(act=act, time=time, workspace=ws, out=out)


def _grad_workspace(prof: Profile) -> list[float]:
    """Gradients alive during each node's backward ([Note: held buffers])."""
    index = {n.name: i for i, n in enumerate(prof.nodes)}
    edges = [(index[u], index[v]) for u, v in prof.edges if u in index and v in index]
    floating = [n.out_dtype.replace("torch.", "") in ("float32", "float16", "bfloat16", "float64")
                for n in prof.nodes]
    return backward_grad_bytes([n.op for n in prof.nodes], [n.out_bytes for n in prof.nodes], floating, edges)


def build_problem(costs: Costs, cand: Candidate, objective: str) -> Problem:
    """The partition Problem for one candidate configuration."""
    prof = costs.profile
    names = costs.names
    index = {n: i for i, n in enumerate(names)}
    edges = [(index[u], index[v]) for u, v in prof.edges if u in index and v in index]
    variants = {
        "plain": NodeVectors(
            act=[n.act_bytes for n in prof.nodes],
            time=[n.time_s for n in prof.nodes],
            workspace=[max(n.workspace_bytes, g) for n, g in zip(prof.nodes, _grad_workspace(prof), strict=True)],
            out=[n.out_bytes for n in prof.nodes],
        )
    }
    parts = cand.stage_parts()
    for p in sorted(set(parts) - {1}):
        variants[f"tiled{p}"] = _tiled_vectors(costs, p, cand.slice)
    link = 2.0 / costs.link_bw  # activation forward + gradient backward
    inflight = cand.inflight()
    held = [held_buffers(cand.schedule, cand.micro_batches, n) for n in inflight]  # [Note: held buffers]
    stages = [
        StageSpec(inflight=inflight[s], variant=f"tiled{parts[s]}" if parts[s] > 1 else "plain",
                  spatial=parts[s] > 1, link_s_per_byte=link, recv_held=held[s][0], send_held=held[s][1])
        for s in range(cand.stages)
    ]
    k = cand.stages
    ranks: list[list[int]] = []
    if cand.replicas == 2:
        ranks = [[j, k - 1 - j] for j in range(k)]
    pinned: dict[int, int] = {}
    for i, n in enumerate(prof.nodes):
        if n.op == "placeholder":
            pinned[i] = 0
        elif n.op == "output":
            pinned[i] = k - 1
    tileable = [costs.rules[n].tileable if n in costs.rules else False for n in names]
    tied = [[index[v] for v in grp if v in index] for grp in costs.tied]
    return Problem(
        names=names, edges=edges, static=[n.static_bytes for n in prof.nodes], variants=variants,
        stages=stages, tileable=tileable, ranks=ranks, objective=objective,
        mem_cap=costs.mem_cap, pinned=pinned, tied=[g for g in tied if len(g) > 1],
    )


def tied_nodes(gm: fx.GraphModule) -> tuple[tuple[str, ...], ...]:
    """Groups of nodes that use one parameter or buffer (a call_module owning it, or a node
    reading it through get_attr): they must share a stage, since the runtime cannot yet sum
    a shared weight's gradients across stages."""
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


def predict_step(costs: Costs, cand: Candidate, part: Partition, batch: int) -> dict[str, float]:
    """Step time and throughput of a solved candidate.

    step = (m + K - 1) x slowest rank's time per micro-batch (GPipe and 1F1B alike), plus
    the gradient all-reduce over data-parallel copies (ring: 2(D-1)/D x bytes / bandwidth)
    and, for MASTER, the exchange that combines the two replicas' gradients.
    """
    m, k = cand.micro_batches, cand.stages
    prof = costs.profile
    stage_param = [0.0] * k
    for i, n in enumerate(prof.nodes):
        stage_param[part.stage_of[i]] += n.param_bytes
    rank_param = [stage_param[j] + (stage_param[k - 1 - j] if cand.replicas == 2 else 0.0) for j in range(k)]
    sync = 0.0
    if cand.dp > 1:
        sync += 2 * (cand.dp - 1) / cand.dp * max(rank_param) / costs.link_bw
    if cand.replicas == 2:
        sync += max(stage_param) / costs.link_bw
    step = (m + k - 1) * part.bottleneck_time + sync
    global_batch = batch * m * cand.replicas * cand.dp
    return {
        "step_s": step,
        "throughput": global_batch / step if step > 0 else math.inf,
        "global_batch": float(global_batch),
        "peak_bytes": part.bottleneck_mem,
        "bubble": (k - 1) / (m + k - 1),
        "grad_sync_s": sync,
    }


def stage_sums(costs: Costs, cand: Candidate, stage_of: Sequence[int]) -> list[dict[str, float]]:
    """Per-stage breakdown (per rank of the stage): fwd/bwd time, static and activation bytes."""
    k = cand.stages
    parts = cand.stage_parts()
    out = [dict(fwd_s=0.0, bwd_s=0.0, static_bytes=0.0, act_bytes=0.0, params=0.0, param_bytes=0.0) for _ in range(k)]
    for i, n in enumerate(costs.profile.nodes):
        s = stage_of[i]
        p = parts[s]
        out[s]["fwd_s"] += n.fwd_s / p
        out[s]["bwd_s"] += n.bwd_s / p
        out[s]["static_bytes"] += n.static_bytes
        out[s]["act_bytes"] += n.act_bytes / p
        out[s]["param_bytes"] += n.param_bytes
    return out
