"""Turn a Profile and a Candidate configuration into a partition Problem, and predict step time.

[Note: spatial cost] In a stage of P parts each rank holds one tile: a node's activations,
time, workspace and boundary tensors are divided by P, and a node with a spatial footprint
(conv, pool, bilinear upsample) adds its halo: the padded input it saves (memory) and the
halo it receives and, in backward, sends back (link time, plus a fixed latency per exchange).
Parameters are not divided: every tile rank holds the full weights.

[Note: links per crossing] With a topology (``Costs.topology``, [Note: topology]) every
message is charged at the link it crosses under the candidate's placement ([Note:
placement]): a tile group spanning nodes pays its halos at the inter-node bandwidth and
latency; a stage with a boundary tensor to or from another node pays all its boundary bytes
at the inter-node bandwidth (conservative: one rate per stage); the data-parallel all-reduce
is hierarchical (``placement.allreduce_s``); MASTER's gradient exchange pays the link between
the two replicas of each stage. On one node every figure is what it was without a topology.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from nowdl.partitioner.config.candidate import Candidate
from nowdl.partitioner.costs.held_tensors import backward_grad_bytes, deferred_bytes, held_buffers
from nowdl.partitioner.costs.inference import inference_stages
from nowdl.partitioner.costs.levers import apply_levers, offload_time_s
from nowdl.partitioner.costs.problem import NodeVectors, Partition, Problem, StageSpec
from nowdl.partitioner.costs.tile_overhead import tile_op_bytes, tile_op_seconds
from nowdl.partitioner.placement.layout import Layout, allreduce_s, flat_topology, place
from nowdl.partitioner.spatial.tileable import SpatialRule, halo_elements, slice_grid, tile_shape
from nowdl.plan.topology import Topology
from nowdl.profiler.cost import NodeCost, Profile
from nowdl.schedule.orders import skip_waits
from nowdl.schedule.zero_bubble_order import zb_slots

__all__ = ["Costs", "edge_indices", "build_problem", "predict_step", "message_latency_s", "HALO_LATENCY_S",
           "spatial_dims_of", "dtype_bytes", "layout_of", "grad_sync_s", "pipeline_slots",
           "exposed_halo_s", "exposed_halo_fwd_s", "norm_reduces", "border_fraction", "grad_workspace"]

HALO_LATENCY_S = 10e-6  # per halo exchange (one message round to the neighbours)


@dataclass(frozen=True)
class Costs:
    """Profile facts the cost model needs, flattened to lists in node order."""

    profile: Profile
    rules: dict[str, SpatialRule]
    link_bw: float  # bytes/s between GPUs
    mem_cap: float | None
    tied: tuple[tuple[str, ...], ...] = ()  # node groups sharing a weight (``tied_nodes``)
    topology: Topology | None = None  # None: one node, every message at link_bw
    inference: bool = False  # a forward-only plan ([Note: inference memory] in costs/inference.py)
    host_memory: float | None = None  # bytes of host memory one GPU may offload to (levers.host_share); None: none
    host_link_bw: float | None = None  # bytes/s GPU <-> host, one direction ([Note: host offload] in levers.py)
    tile_op_s: dict[str, float] | None = None  # per tiled op forward, by kind ([Note: tiled runtime overhead])
    tile_op_bwd_s: dict[str, float] | None = None  # and backward
    norm_schedule: str = "auto"  # sequential tiles' norms: auto, passes, layerwise ([Note: layer-wise norms cost])
    recompute_tensor_s: float = 0.0  # per saved tensor of a recomputed stage ([Note: recompute hooks] in levers.py)

    def topo(self, gpus: int) -> Topology:
        """The cluster, or one flat node of ``gpus`` ranks at ``link_bw`` when none was given."""
        return self.topology if self.topology is not None else flat_topology(gpus, self.link_bw)

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.profile.nodes]

    @cached_property
    def edges(self) -> list[tuple[int, int]]:
        """The profile's edges as (producer, consumer) node indices."""
        return edge_indices(self.profile)


def edge_indices(prof: Profile) -> list[tuple[int, int]]:
    """``prof.edges`` as (producer, consumer) indices into ``prof.nodes`` (edges to unknown names dropped)."""
    index = {n.name: i for i, n in enumerate(prof.nodes)}
    return [(index[u], index[v]) for u, v in prof.edges if u in index and v in index]


def spatial_dims_of(profile: Profile) -> int:
    """Spatial dims of the model's input (2 for N,C,H,W)."""
    shapes = profile.input_shapes or [[1, 1, 1, 1]]
    return max(1, len(shapes[0]) - 2)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name ('float32', 'torch.float16', ...); 4 when unknown."""
    return {"float16": 2, "bfloat16": 2, "float64": 8, "int64": 8}.get(dtype.replace("torch.", ""), 4)


def layout_of(costs: Costs, cand: Candidate) -> Layout:
    """Where ``cand``'s ranks sit ([Note: placement])."""
    return place(cand, costs.topo(cand.ranks_per_pipeline() * cand.dp))


def _tiled_vectors(costs: Costs, parts: int, slice_: str, link_bw: float | None = None,
                   latency_s: float = HALO_LATENCY_S) -> NodeVectors:
    prof = costs.profile
    grid = slice_grid(slice_, parts, spatial_dims_of(prof))
    producers: dict[str, str] = {}
    for u, v in prof.edges:
        producers.setdefault(v, u)
    act, time, ws, out, fwd = [], [], [], [], []
    grads = grad_workspace(prof, costs.inference)
    for n, g in zip(prof.nodes, grads, strict=True):
        rule = costs.rules.get(n.name)
        a = _tile_act(costs, n, parts)
        over_t, over_f = tile_op_seconds(rule, parts, costs.tile_op_s, costs.tile_op_bwd_s, costs.inference)
        t, f = n.time_s / parts + over_t, n.fwd_s / parts + over_f  # [Note: tiled runtime overhead]
        src = producers.get(n.name)
        shape = prof[src].out_shape if src is not None and src in prof else None  # the input's
        if rule is not None and rule.tileable and rule.halo and any(rule.halo):
            if src is not None and shape is not None and len(shape) >= 3:
                hb = halo_elements(shape, grid, rule.halo) * dtype_bytes(prof[src].out_dtype)
                if n.saved_bytes:
                    a += hb  # the padded input tile is what the op saves
                one_way = hb / (link_bw or costs.link_bw) + latency_s
                border = border_fraction(shape, grid, rule.halo)
                t += exposed_halo_s(rule, one_way, n.fwd_s / parts, n.bwd_s / parts, n.param_bytes > 0, border)
                f += exposed_halo_fwd_s(rule, one_way, n.fwd_s / parts, border)
        elif rule is not None and rule.kind == "norm" and parts > 1:
            reduces = norm_reduces(n.target, costs.inference)  # [Note: tile norm latency]
            t += reduces * latency_s
            f += min(reduces, 1) * latency_s
        act.append(a)
        time.append(t)
        fwd.append(f)
        ws.append(max(n.workspace_bytes, g) / parts + tile_op_bytes(rule, parts, n.target, n.out_bytes, shape,
                                                                  n.out_shape))
        out.append(n.out_bytes / parts)
    return NodeVectors(act=act, time=time, workspace=ws, out=out, fwd=fwd)


def _tile_act(costs: Costs, n: NodeCost, parts: int) -> float:
    """Activation bytes node ``n`` saves per tile of ``parts`` (halo not included). A tiled max
    pool saves its input window and recomputes in backward ([Note: halo overlap] in
    runtime/spatial/window_op.py): not the int64 indices the plain pool saves."""
    a = n.act_bytes / parts
    rule = costs.rules.get(n.name)
    if parts > 1 and rule is not None and rule.kind == "pool" and any(
            k in n.target.lower() for k in ("maxpool", "max_pool")):
        a = max(0.0, a - n.out_bytes / dtype_bytes(n.out_dtype) * 8 / parts)
    return a


def exposed_halo_s(rule: SpatialRule, one_way_s: float, fwd_s: float, bwd_s: float, has_weight: bool,
                   border: float) -> float:
    """[Note: halo overlap cost] Halo time a tile rank waits for per micro-batch.

    Convs and pools overlap the exchange ([Note: halo overlap] in
    ``nowdl.runtime.spatial.window_op``): forward, ``max(0, halo - op compute)`` plus the border
    frame computed again after the wait (``border`` x forward compute); backward (convs only),
    the halo gradients' return against the rest of the backward (the halo slabs' gradients are
    computed first, from the border outputs: ``(1 - border)`` x backward). A strided conv whose
    window is not its tile padded evenly hides it behind the weight gradient only (about half):
    not told apart here. Other ops (transposed convs, upsampling) wait for the whole exchange
    each way. ``one_way_s`` is one direction's ``bytes / link + latency``.
    """
    if rule.kind not in ("conv", "pool"):
        return 2 * one_way_s
    hidden_bwd = (1.0 - border) * bwd_s if has_weight else 0.0
    return max(0.0, one_way_s - fwd_s) + border * fwd_s + max(0.0, one_way_s - hidden_bwd)


def norm_reduces(target: str, inference: bool) -> int:
    """[Note: tile norm latency] All-reduces a tiled norm makes per micro-batch over its tile
    group (``runtime/spatial/norms.py``): its statistics in the forward and two per-channel sums
    in the backward, each one blocking round of messages charged the link's latency (their
    bytes are a few per channel); an inference BatchNorm reads its running statistics (none)."""
    if inference:
        return 0 if "batch" in target.lower() else 1
    return 2


def exposed_halo_fwd_s(rule: SpatialRule, one_way_s: float, fwd_s: float, border: float) -> float:
    """The forward's share of :func:`exposed_halo_s`: what a recompute of the op waits for again."""
    if rule.kind not in ("conv", "pool"):
        return one_way_s
    return max(0.0, one_way_s - fwd_s) + border * fwd_s


def border_fraction(shape: Sequence[int], grid: Sequence[int], halo: Sequence[int]) -> float:
    """Share of an op's output tile that reads the halo (recomputed after the wait): about
    ``2 x halo / tile side`` per cut dim."""
    sp = list(tile_shape(shape, grid)[2:])
    g = [1] * (len(sp) - len(grid)) + list(grid)[-len(sp):]
    h = list(halo) + [halo[-1]] * (len(sp) - len(halo))
    return min(1.0, sum(2 * hi / max(1, side) for side, hi, gi in zip(sp, h, g, strict=True) if gi > 1))


def grad_workspace(prof: Profile, inference: bool = False) -> list[float]:
    """Gradients alive during each node's backward ([Note: held buffers]); zeros for an inference
    plan (no backward)."""
    if inference:
        return [0.0] * len(prof.nodes)
    edges = edge_indices(prof)
    floating = [n.out_dtype.replace("torch.", "") in ("float32", "float16", "bfloat16", "float64")
                for n in prof.nodes]
    return backward_grad_bytes([n.op for n in prof.nodes], [n.out_bytes for n in prof.nodes], floating, edges,
                               [n.target for n in prof.nodes])


def build_problem(costs: Costs, cand: Candidate, objective: str) -> Problem:
    """The partition Problem for one candidate configuration."""
    prof = costs.profile
    names = costs.names
    index = {n: i for i, n in enumerate(names)}
    edges = costs.edges
    variants = {
        "plain": NodeVectors(
            act=[n.act_bytes for n in prof.nodes],
            time=[n.time_s for n in prof.nodes],
            workspace=[max(n.workspace_bytes, g) for n, g in zip(prof.nodes, grad_workspace(prof, costs.inference), strict=True)],
            out=[n.out_bytes for n in prof.nodes],
        )
    }
    parts = cand.stage_parts()
    lay = layout_of(costs, cand)
    multi = lay.topo.multi_node
    cross_tiles = [multi and parts[s] > 1 and lay.tiles_cross(s) for s in range(cand.stages)]
    cross_edge = [multi and lay.boundary_cross(s) for s in range(cand.stages)]
    for p in sorted(set(parts) - {1}):
        variants[f"tiled{p}"] = _tiled_vectors(costs, p, cand.slice, None, lay.topo.intra.latency_s)
        if any(c for s, c in enumerate(cross_tiles) if parts[s] == p):
            inter = lay.topo.inter
            variants[f"tiled{p}-inter"] = _tiled_vectors(costs, p, cand.slice, inter.bw, inter.latency_s)
    inflight = cand.inflight()
    held = [held_buffers(cand.schedule, cand.micro_batches, n) for n in inflight]  # [Note: held buffers]
    waits = skip_waits(cand.schedule, cand.stages, cand.micro_batches)  # [Note: long-skip gradient waits]
    waiting = _deferred_variants(costs, cand, variants)
    stages = [  # activation forward + gradient backward, at the link each stage's boundaries cross
        StageSpec(inflight=inflight[s],
                  variant=(f"tiled{parts[s]}" + ("-inter" if cross_tiles[s] else "")) if parts[s] > 1 else waiting[s],
                  spatial=parts[s] > 1,
                  link_s_per_byte=2.0 / (lay.topo.inter.bw if cross_edge[s] else costs.link_bw),
                  recv_held=held[s][0], send_held=held[s][1], skip_wait=waits[s])
        for s in range(cand.stages)
    ]
    stages = inference_stages(stages) if costs.inference else apply_levers(prof, cand, stages, variants,
                                                                                     costs.recompute_tensor_s)
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


def _deferred_variants(costs: Costs, cand: Candidate, variants: dict[str, NodeVectors]) -> list[str]:
    """Zero bubble: per stage, the variant whose activations carry the deferred ``W``'s share
    (``deferred / inflight`` x :func:`held.deferred_bytes`, so that ``inflight`` x act is the
    whole peak: [Note: held buffers]); added to ``variants``. "plain" where nothing waits."""
    prof, plain = costs.profile, variants["plain"]
    wb = deferred_bytes([n.target for n in prof.nodes], [n.out_bytes for n in prof.nodes], costs.edges)
    names = []
    for n, w in zip(cand.inflight(), cand.deferred(), strict=True):
        key = f"plain+w{w}/{n}" if w else "plain"
        if key not in variants:
            variants[key] = NodeVectors(act=[a + w / n * b for a, b in zip(plain.act, wb, strict=True)],
                                        time=plain.time, workspace=plain.workspace, out=plain.out)
        names.append(key)
    return names


def predict_step(costs: Costs, cand: Candidate, part: Partition, batch: int) -> dict[str, float]:
    """Step time and throughput of a solved candidate.

    step = :func:`pipeline_slots` x slowest rank's time per micro-batch (GPipe and 1F1B:
    ``m + K - 1``; zero bubble: fewer, from the slowest stage's forward share), plus the
    gradient all-reduce over data-parallel copies (ring: 2(D-1)/D x bytes / bandwidth) and, for
    MASTER, the exchange that combines the two replicas' gradients.
    """
    m, k = cand.micro_batches, cand.stages
    prof = costs.profile
    stage_param = [0.0] * k
    for i, n in enumerate(prof.nodes):
        stage_param[part.stage_of[i]] += n.param_bytes
    sync = grad_sync_s(costs, cand, stage_param)
    sums = stage_sums(costs, cand, part.stage_of)
    lat = message_latency_s(costs, cand, part.stage_of)
    off = offload_time_s(cand, sums, costs.host_link_bw)  # [Note: host offload]: not weighed by the solvers
    times = [part.stage_time[s] + lat[s] + off[s] for s in range(k)]
    slow = max(range(k), key=lambda s: times[s])
    busy = sums[slow]["fwd_s"] + sums[slow]["bwd_s"]
    slots = pipeline_slots(cand, sums[slow]["fwd_s"] / busy if busy > 0 else 1 / 3)
    step = slots * max(_rank_times(cand, times)) + sync
    global_batch = batch * m * cand.replicas * cand.dp
    return {
        "step_s": step,
        "throughput": global_batch / step if step > 0 else math.inf,
        "global_batch": float(global_batch),
        "peak_bytes": part.bottleneck_mem,
        "bubble": 1.0 - m / slots,
        "grad_sync_s": sync,
    }


def pipeline_slots(cand: Candidate, fwd_frac: float) -> float:
    """The step in units of the slowest rank's time per micro-batch: ``m + K - 1`` for GPipe
    and 1F1B; for zero bubble, ``zborder.zb_slots`` with forward share ``fwd_frac`` (about
    ``m + (K - 1) fwd_frac``: the bubble keeps only the forwards). Never below ``m``."""
    m, k = cand.micro_batches, cand.stages
    if cand.schedule == "zb":
        return zb_slots(k, m, fwd_frac)
    return float(m + k - 1)


def grad_sync_s(costs: Costs, cand: Candidate, stage_param: Sequence[float],
                rank_param: Sequence[float] | None = None) -> float:
    """Gradient synchronisation per step: the data-parallel all-reduce of every slot's
    gradients (hierarchical across nodes, ``placement.allreduce_s``), plus MASTER's exchange of
    each stage's gradients between its two replicas, at the link between them. Monotone in
    ``stage_param`` and ``rank_param`` (per slot; default: its stages' sum), so the search
    bounds it with every stage and every rank holding all parameters."""
    if costs.inference:
        return 0.0  # no gradients
    k = cand.stages
    lay = layout_of(costs, cand)
    topo = lay.topo
    sync = 0.0
    if cand.dp > 1:
        if rank_param is None:
            rank_param = [stage_param[j] + (stage_param[k - 1 - j] if cand.replicas == 2 else 0.0) for j in range(k)]
        sync += max(allreduce_s(rank_param[j], members, topo) for j in range(k) for members in lay.dp_members(j))
    if cand.replicas == 2:
        sync += max(stage_param[s] / topo.inter.bw + topo.inter.latency_s if lay.master_cross(s)
                    else stage_param[s] / costs.link_bw for s in range(k))
    return sync


def stage_sums(costs: Costs, cand: Candidate, stage_of: Sequence[int]) -> list[dict[str, float]]:
    """Per-stage breakdown (per rank of the stage): fwd/bwd time (the tiled runtime's work
    included), static and activation bytes."""
    k = cand.stages
    parts = cand.stage_parts()
    out = [dict(fwd_s=0.0, bwd_s=0.0, static_bytes=0.0, act_bytes=0.0, params=0.0, param_bytes=0.0) for _ in range(k)]
    for i, n in enumerate(costs.profile.nodes):
        s = stage_of[i]
        p = parts[s]
        over_t, over_f = tile_op_seconds(costs.rules.get(n.name), p, costs.tile_op_s, costs.tile_op_bwd_s,
                                         costs.inference)  # [Note: tiled runtime overhead]
        out[s]["fwd_s"] += n.fwd_s / p + over_f
        out[s]["bwd_s"] += n.bwd_s / p + over_t - over_f
        out[s]["static_bytes"] += n.static_bytes
        out[s]["act_bytes"] += _tile_act(costs, n, p)
        out[s]["param_bytes"] += n.param_bytes
    return out


def message_latency_s(costs: Costs, cand: Candidate, stage_of: Sequence[int]) -> list[float]:
    """Per stage: the fixed cost of its boundary messages, one link latency each.

    [Note: message latency] The engine sends every tensor crossing a boundary as its own
    message, forward and (its gradient) backward, to every stage that reads it. The cost model
    charges bytes at the link's bandwidth in every solver; each message's latency (``nowdl
    calibrate`` measured 63-73 us per gloo message over loopback on this 2-core machine) is added here, to the plan's
    predicted stage times and step, not weighed by the solvers (it adds about the same to every
    split's stages: 2 x latency x tensors crossing). Between a stage of P tiles and one of Q, a
    rank swaps one piece with each of the ceil(Q / P) ranks its tile meets. The inter-node link's
    latency applies to a stage whose boundary crosses nodes.
    """
    k = cand.stages
    lay = layout_of(costs, cand)
    multi = lay.topo.multi_node
    nodes = costs.profile.nodes
    crossing = {(u, stage_of[v]) for u, v in costs.edges  # (producer node, consumer stage)
                if stage_of[u] != stage_of[v] and nodes[v].op != "output"}
    parts = cand.stage_parts()
    msgs = [0] * k
    for u, c in crossing:  # a rank of P tiles swaps pieces with the tile ranks its box meets
        src = stage_of[u]
        msgs[src] += 2 * -(-parts[c] // parts[src])  # the activation out, its gradient back in
        msgs[c] += 2 * -(-parts[src] // parts[c])
    return [msgs[s] * (lay.topo.inter.latency_s if multi and lay.boundary_cross(s) else lay.topo.intra.latency_s)
            for s in range(k)]


def _rank_times(cand: Candidate, times: Sequence[float]) -> list[float]:
    """Per pipeline slot: the time per micro-batch of the stages it holds (MASTER: two; the
    middle slot of an odd K holds both copies of its stage, as ``structure.rank_loads``)."""
    k = cand.stages
    return [times[j] + (times[k - 1 - j] if cand.replicas == 2 else 0.0) for j in range(k)]
