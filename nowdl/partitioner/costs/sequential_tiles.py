"""What sequential tiles cost: a spatial stage whose GPUs each run T tiles one after another.

[Note: sequential tiles cost] With ``tiles_per_gpu`` T a stage of P parts runs the P x T grid
(``config.grids.sub_grid``), each GPU its T tiles in turn. A tile's forward runs over the whole
stage on the tile widened by a margin that covers what the rest of the stage reads around it
(a fused halo), keeping nothing; the backward recomputes it, saving, and runs its backward.
Only the stage's input and output tiles (all T of them) are kept between forward and backward.
So, per node v of such a stage, with ``infl_v`` the margin's extra pixels (the tile's area with
its margin over its area, at v's resolution):

- memory: the saved activations and workspace of ONE tile, ``act_v x infl_v / T`` (held once,
  not per in-flight micro-batch: the vector holds it divided by ``inflight``, so the cost model's
  ``inflight x act`` is one tile's), plus the input tile per in-flight micro-batch (the model
  input's node keeps its whole act), the loss's saved bytes and workspace whole (the graph's
  ``output`` node: the loss runs once on the whole output) and the boundary tensors as for any
  stage. ``infl_v`` is the window the runtime recomputes a tile on ([Note: sequential tiles
  window]), the same ratio at every node;
- time: ``(2 x fwd_v + bwd_v) x infl_v / P`` (T tiles, the forward twice, nothing overlapped
  between tiles) plus the halo time the P-part stage pays between GPUs.

The margin of node v is what the nodes after it in the tileable region read around a tile,
in pixels at v's output: each consumer adds its halo and scales by its resolution change
(a pool of stride 2 doubles it). It runs to the end of the region, so a stage that ends earlier
needs less: an upper bound.

[Note: sequential tiles window] The runtime (``runtime/spatial/sequential/tiles.py``) runs EVERY node
of a sub-tile on one window: the sub-tile's region plus the stage's whole reach on each side,
its start rounded down and its length up to the alignment (the least common multiple of the
nodes' scales), clipped at the image border. So a node's saved bytes grow by the window's area
over the tile's, not by the node's own margin (which shrinks towards the stage's end):
:func:`window_inflation` computes the largest window of the grid as the runtime does, from the
reach the runtime computes (:func:`stage_reach_px`). Sized by each node's margin instead,
training peaks measured 1.12x (T = 2) to 1.75x (T = 8) the plan on nowdl's UNet at 256². Norms whose statistics span the image (BatchNorm in training,
InstanceNorm, GroupNorm) add statistics passes over the sub-tiles ([Note: norm passes cost]);
averages over the whole image (global pooling) are kept out of stages with T > 1
(:func:`image_pools`; the runtime refuses them too). The plan reports a stage's time apart
(:func:`time_terms`): ``seq_recompute_s`` (each sub-tile's forward again in the backward),
``seq_margin_s`` (the work on the windows' margins), ``norm_passes_s`` (the statistics passes),
``comm_s`` only what crosses links.

In an inference plan (``Costs.inference``) each sub-tile's forward runs once, under ``no_grad``:
nothing is saved or recomputed. The stage holds its whole input (the model input's share,
``I``, which every node's live set counts: [Note: inference memory]), the output tiles of all T
sub-tiles (allocated before the first sub-tile runs) and ONE sub-tile's live forward set. So
per node v: workspace ``(ws_v - I) x infl_v / T + I``, with ``infl_v`` from the window the runtime runs every
node on (:func:`window_margins`: the stage's whole reach, not only what later nodes read); the producers of the model's outputs
carry their whole output tile as activation bytes (held by the stage that computes them); time
``fwd_v x infl_v / P`` plus the halo time.

[Note: norm passes cost] A stage of sequential tiles whose norms take the image's statistics
(BatchNorm in training, InstanceNorm, GroupNorm) runs extra passes over its T sub-tiles
([Note: sequential norms] in ``runtime/spatial/statistics/seq_norms.py``). With a norm's *forward
level* 1 + the most norms on a path before it, and its *backward level* 1 + the most norms on a
path after it (``Kf``, ``Kb`` the highest): forward pass k runs the nodes the level-k norms read
(node v runs ``a_v`` more forwards, the number of forward levels whose norms it feeds); backward
pass k recomputes the whole stage on every sub-tile (``Kb`` more forwards for every node) and runs
the backward from the outputs to the level-k norms (node v runs ``b_v`` more backwards, the
number of backward levels with a norm before it). So per node the passes add
``(fwd_v x (a_v + Kb) + bwd_v x b_v) x infl / P`` (:func:`norm_passes`). The levels are taken over
the whole graph: a stage that ends before the model's last norm needs fewer backward passes than
charged (an upper bound); the model wholly on sequential tiles is counted exactly. An inference
plan runs the forward passes only, and BatchNorm there uses its running statistics. Memory: one
sub-tile's graph lives at a time in every pass, as in the backward without norms; a norm's
backward holds its normalised input beside its gradients, and a backward statistics pass keeps
the norm's output to take the gradient at, so a norm's workspace grows by twice its output on
the sub-tile (:func:`_xhat_bytes`; measured peaks 0.96-1.03x the plan, docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nowdl.geometry import split_bounds
from nowdl.partitioner.costs.costmodel import Costs
from nowdl.partitioner.costs.problem import NodeVectors, Problem
from nowdl.partitioner.costs.seqnorms.schedule import (
    NormSchedule,
    norm_depths,
    norm_schedule,
    reached,
)

__all__ = ["margins", "window_margins", "inflation", "stage_reach_px", "window_inflation", "image_pools", "sequential_vectors",
           "sequential_problem", "time_terms", "NormPasses", "norm_passes", "schedule_of"]


def _spatial(shape: Sequence[int] | None) -> list[int]:
    return [int(d) for d in shape[2:]] if shape is not None and len(shape) >= 3 else []


def image_pools(costs: Costs) -> list[int]:
    """Indices of the nodes that average over the whole image ([Note: whole values on tiles]), which
    stages with sequential tiles cannot hold."""
    return [i for i, n in enumerate(costs.profile.nodes)
            if (r := costs.rules.get(n.name)) is not None and r.tileable and r.kind == "pooled"]


def margins(costs: Costs) -> list[tuple[float, ...]]:
    """Per node, the pixels per side (per spatial dim, at its output's resolution) that the rest
    of the tileable region reads around a tile of its output ([Note: sequential tiles cost])."""
    prof = costs.profile
    nodes = prof.nodes
    consumers: list[list[int]] = [[] for _ in nodes]
    for u, v in costs.edges:
        consumers[u].append(v)
    out: list[tuple[float, ...]] = [()] * len(nodes)
    for v in range(len(nodes) - 1, -1, -1):
        mine = _spatial(nodes[v].out_shape)
        need = [0.0] * len(mine)
        for c in consumers[v]:
            rule = costs.rules.get(nodes[c].name)
            theirs = _spatial(nodes[c].out_shape)
            if nodes[c].op == "output" or rule is None or not rule.tileable or len(theirs) != len(mine):
                continue
            halo = list(rule.halo) + [rule.halo[-1] if rule.halo else 0] * len(mine)
            for d in range(len(mine)):
                later = out[c][d] if d < len(out[c]) else 0.0
                need[d] = max(need[d], math.ceil(later * mine[d] / max(1, theirs[d])) + halo[d])
        out[v] = tuple(need)
    return out


def window_margins(costs: Costs) -> list[tuple[float, ...]]:
    """Per node, the margin of the window the runtime runs a sub-tile on, at the node's resolution:
    the largest margin of :func:`margins` over the nodes, in the finest resolution's pixels, scaled
    to each node (the runtime widens the stage's input by the stage's whole reach, and every node
    then computes over that window, not only over what later nodes read)."""
    nodes = costs.profile.nodes
    shapes = [_spatial(n.out_shape) for n in nodes]
    nd = max((len(s) for s in shapes), default=0)
    ref = [max((s[d] for s in shapes if len(s) == nd), default=1) for d in range(nd)]
    reach = [0.0] * nd
    for s, m in zip(shapes, margins(costs), strict=True):
        if len(s) == nd and len(m) == nd:
            reach = [max(r, mi * rd / max(1, si)) for r, mi, rd, si in zip(reach, m, ref, s, strict=True)]
    return [tuple(r * si / max(1, rd) for r, si, rd in zip(reach, s, ref, strict=True)) if len(s) == nd else ()
            for s in shapes]


def inflation(shape: Sequence[int] | None, grid: Sequence[int], margin: Sequence[float]) -> float:
    """A tile's area with its margin over its area, for an output of ``shape`` cut by ``grid``
    (the margin stops at the image's border)."""
    sp = _spatial(shape)
    if not sp:
        return 1.0
    g = [1] * (len(sp) - len(grid)) + list(grid)[-len(sp):]
    f = 1.0
    for n, gi, m in zip(sp, g, list(margin) + [0.0] * len(sp), strict=False):
        side = n / max(1, gi)
        if gi > 1 and side > 0:
            f *= min(float(n), side + 2 * m) / side
    return f


def _reference(costs: Costs) -> tuple[list[int], list[int]]:
    """The finest spatial shape among the nodes and the alignment (lcm of the nodes' whole scales)."""
    shapes = [_spatial(n.out_shape) for n in costs.profile.nodes]
    nd = max((len(s) for s in shapes), default=0)
    ref = [max((s[d] for s in shapes if len(s) == nd), default=1) for d in range(nd)]
    align = [1] * nd
    for s in shapes:
        if len(s) == nd:
            align = [math.lcm(a, max(1, round(r / max(1, si)))) for a, r, si in zip(align, ref, s, strict=True)]
    return ref, align


def stage_reach_px(costs: Costs, ref: Sequence[int]) -> list[int]:
    """Per spatial dim, how far (reference pixels) an output pixel of the tileable region depends on
    inputs beyond its footprint, summed along the worst path as the runtime's ``stage_reach`` does:
    each windowed op adds its ``SpatialRule.reach`` (else its halo) in its input's pixels."""
    nodes = costs.profile.nodes
    producers: list[list[int]] = [[] for _ in nodes]
    for u, v in costs.edges:
        producers[v].append(u)
    nd = len(ref)
    acc: list[list[float]] = [[0.0] * nd for _ in nodes]
    for v, n in enumerate(nodes):
        ins = [u for u in producers[v] if len(_spatial(nodes[u].out_shape)) == nd]
        if not ins or len(_spatial(n.out_shape)) != nd:
            continue
        rule = costs.rules.get(n.name)
        step = list((rule.reach or rule.halo) if rule is not None and rule.tileable else ())
        step = (step + [step[-1] if step else 0.0] * nd)[:nd]
        size = _spatial(nodes[ins[0]].out_shape)
        acc[v] = [max(acc[u][d] for u in ins) + float(step[d]) * ref[d] / max(1, size[d]) for d in range(nd)]
    return [math.ceil(max((a[d] for a in acc), default=0.0) - 1e-9) for d in range(nd)]


def window_inflation(costs: Costs, grid: Sequence[int], *, mean: bool = False) -> float:
    """The largest sub-tile window's area over a tile's (``mean``: the windows' mean area), for the
    whole ``grid`` of tiles (P x T), at the finest resolution ([Note: sequential tiles window])."""
    ref, align = _reference(costs)
    if not ref:
        return 1.0
    reach = stage_reach_px(costs, ref)
    g = [1] * (len(ref) - len(grid)) + list(grid)[-len(ref):]
    f = 1.0
    for n, gi, r, a in zip(ref, g, reach, align, strict=True):
        if gi <= 1:
            continue
        widths = []
        for c in range(gi):
            lo, hi = split_bounds(n, gi, c)
            start = max(0, lo - r) // a * a
            widths.append(min(n, start + -(-(hi + r - start) // a) * a) - start)
        f *= (sum(widths) / gi if mean else max(widths)) / (n / gi)
    return f


def sequential_vectors(costs: Costs, base: NodeVectors, parts: int, tiles: int, grid: Sequence[int],
                       inflight: int) -> NodeVectors:
    """Per-node vectors of a stage of ``parts`` parts running ``tiles`` tiles per GPU over the
    whole ``grid`` (P x T tiles), from its ``base`` vectors (P-part tiles, or plain for one
    part); ``inflight``: micro-batches the stage holds ([Note: sequential tiles cost])."""
    nodes = costs.profile.nodes
    held = 0.0  # inference: the stage input's share that every live set counts, held whole
    outputs: set[int] = set()  # inference: nodes whose output tiles are the model's outputs
    if costs.inference:
        held = sum(float(o) for n, o in zip(nodes, base.out, strict=True) if n.op == "placeholder")
        outputs = {u for u, v in costs.edges if nodes[v].op == "output" and nodes[u].op != "placeholder"}
    act, time, ws = [], [], []
    passes = norm_passes(costs)
    reach = window_margins(costs) if costs.inference else margins(costs)
    window = window_inflation(costs, grid)  # training: every node computes over the runtime's window
    window_mean = window_inflation(costs, grid, mean=True)  # time: all T windows, one after another
    sched = _schedule(costs, passes, parts, window_mean, inflight)
    for i, (n, a, t, w, m) in enumerate(zip(nodes, base.act, base.time, base.workspace, reach, strict=True)):
        f = inflation(n.out_shape, grid, m) if costs.inference or not _spatial(n.out_shape) else window
        halo_s = max(0.0, t - n.time_s / parts)  # what the P-part stage pays between GPUs
        if costs.inference:
            act.append(float(base.out[i]) if i in outputs else 0.0)
            time.append(halo_s + n.fwd_s * (1 + _fwd_extra(passes, sched, i)) * f / parts + _host_s(sched, i))
            ws.append(max(0.0, w - held) * f / tiles + held)
            continue
        whole = n.op in ("placeholder", "output")  # the input tile; the loss on the whole output
        act.append(float(a) if whole else a * f / tiles / max(1, inflight))
        tf = window_mean if f == window else f
        extra = n.fwd_s * _fwd_extra(passes, sched, i) + n.bwd_s * _bwd_extra(passes, sched, i)
        time.append(halo_s + (2 * n.fwd_s + n.bwd_s + extra) * tf / parts + _host_s(sched, i))
        held_norm = _xhat_bytes(n, base.out[i]) if i in passes.norms else 0.0
        ws.append(float(w) if n.op == "output" else (w + held_norm) * f / tiles)
    return NodeVectors(act=act, time=time, workspace=ws, out=list(base.out))


def _schedule(costs: Costs, passes: NormPasses, parts: int, window: float, inflight: int = 1) -> NormSchedule:
    """The norm schedule of a stage of ``parts`` GPUs ([Note: layer-wise norms cost])."""
    extra = [x.fwd_s * f + x.bwd_s * b for x, f, b in zip(costs.profile.nodes, passes.fwd, passes.bwd, strict=True)]
    return norm_schedule(costs, passes.norms, extra, parts, window, inflight)


def schedule_of(costs: Costs, parts: int, grid: Sequence[int], inflight: int = 1) -> NormSchedule:
    """The norm schedule a stage of ``parts`` GPUs over the whole ``grid`` (P x T tiles) runs."""
    return _schedule(costs, norm_passes(costs), parts, window_inflation(costs, grid, mean=True), inflight)


def _fwd_extra(passes: NormPasses, sched: NormSchedule, i: int) -> float:
    """Node ``i``'s extra forwards: the passes' (layer-wise: the norms' sums in the backward)."""
    return float(sched.sums[i]) if sched.mode == "layerwise" else passes.fwd[i]


def _bwd_extra(passes: NormPasses, sched: NormSchedule, i: int) -> float:
    """Node ``i``'s extra backwards: the passes' (none layer-wise)."""
    return 0.0 if sched.mode == "layerwise" else passes.bwd[i]


def _host_s(sched: NormSchedule, i: int) -> float:
    return sched.host_node_s[i] if sched.mode == "layerwise" else 0.0


def _xhat_bytes(node: Any, out: float) -> float:
    """What a norm's backward holds beside its gradients on a sub-tile ([Note: norm passes cost]):
    its normalised input (its output's bytes, float32 for a bf16/fp16 output) and, in a backward
    statistics pass, its output, kept to take the gradient at."""
    return float(out) * (3.0 if str(node.out_dtype).replace("torch.", "") in ("bfloat16", "float16") else 2.0)


def sequential_problem(costs: Costs, problem: Problem, *, stages: Sequence[int], parts: Sequence[int],
                       tiles: int, grids: Sequence[Sequence[int]]) -> Problem:
    """``problem`` with ``stages`` running ``tiles`` tiles per GPU: their vectors from
    :func:`sequential_vectors` (``grids[s]``: stage s's whole grid of P x T tiles), each marked
    spatial, and the whole-image averages kept out of every spatial stage."""
    if tiles <= 1:
        return problem
    variants = dict(problem.variants)
    specs = list(problem.stages)
    for s in stages:
        spec = specs[s]
        base_name = spec.variant if parts[s] > 1 else "plain"
        name = f"seq:{base_name}x{tiles}/{spec.inflight}"
        if name not in variants:
            variants[name] = sequential_vectors(costs, problem.variants[base_name], parts[s], tiles, grids[s],
                                                spec.inflight)
        specs[s] = dataclasses.replace(spec, variant=name, spatial=True)
    pools = set(image_pools(costs))
    tileable = list(problem.tileable) or [True] * problem.n
    tileable = [t and i not in pools for i, t in enumerate(tileable)]
    return dataclasses.replace(problem, variants=variants, stages=specs, tileable=tileable)


def time_terms(costs: Costs, nodes: Sequence[int], parts: int, grid: Sequence[int], inflight: int = 1) -> dict[str, float]:
    """The parts of a sequential-tile stage's time (per micro-batch, per GPU) beyond its nodes'
    work: ``seq_recompute_s``, ``seq_margin_s``, ``norm_passes_s`` ([Note: sequential tiles cost])
    and, layer-wise, ``norm_host_s`` (its host copies, [Note: layer-wise norms cost])."""
    passes = norm_passes(costs)
    window = window_inflation(costs, grid, mean=True)
    sched = _schedule(costs, passes, parts, window, inflight)
    reach = window_margins(costs) if costs.inference else []
    out = {"seq_recompute_s": 0.0, "seq_margin_s": 0.0, "norm_passes_s": 0.0}
    if sched.mode == "layerwise":
        out["norm_host_s"] = 0.0
    for i in nodes:
        n = costs.profile.nodes[i]
        if sched.mode == "layerwise":
            out["norm_host_s"] += _host_s(sched, i)
        if not _spatial(n.out_shape):
            continue
        f = inflation(n.out_shape, grid, reach[i]) if costs.inference else window
        if not costs.inference:
            out["seq_recompute_s"] += n.fwd_s * f / parts
        out["seq_margin_s"] += (n.fwd_s + (0.0 if costs.inference else n.bwd_s)) * (f - 1) / parts
        out["norm_passes_s"] += (n.fwd_s * _fwd_extra(passes, sched, i) + n.bwd_s * _bwd_extra(passes, sched, i)) * f / parts
    return out


@dataclass(frozen=True)
class NormPasses:
    """Per node: extra forwards and backwards the statistics passes run it; the pass counts."""

    fwd: list[float]
    bwd: list[float]
    forward_passes: int
    backward_passes: int
    norms: frozenset[int] = frozenset()  # the norms that take the image's statistics


def _norm_nodes(costs: Costs) -> set[int]:
    out = set()
    for i, n in enumerate(costs.profile.nodes):
        r = costs.rules.get(n.name)
        if r is None or not r.tileable or r.kind != "norm":
            continue
        if costs.inference and "BatchNorm" in n.target:  # eval: its running statistics, a pointwise map
            continue
        out.add(i)
    return out


def norm_passes(costs: Costs) -> NormPasses:
    """The :class:`NormPasses` of ``costs``'s graph ([Note: norm passes cost])."""
    nodes = costs.profile.nodes
    n = len(nodes)
    norms = _norm_nodes(costs)
    if not norms:
        return NormPasses([0.0] * n, [0.0] * n, 0, 0)
    prods, cons, depth = norm_depths(costs, norms)
    back = [0] * n
    for v in range(n - 1, -1, -1):
        back[v] = max((back[c] for c in cons[v]), default=0) + (v in norms)
    kf = max(depth[v] for v in norms)
    kb = 0 if costs.inference else max(back[v] for v in norms)
    a, b = [0] * n, [0] * n
    for k in range(1, kf + 1):
        for u in reached([v for v in norms if depth[v] == k], prods):
            a[u] += 1
    for k in range(1, kb + 1):
        for u in reached([c for v in norms if back[v] == k for c in cons[v]], cons):
            b[u] += 1
    return NormPasses([float(x + kb) for x in a], [float(x) for x in b], kf, kb, frozenset(norms))

