"""Halo fusion in the plan: which runs of a spatial stage exchange one deeper halo.

[Note: fusion cost] Unfused, each conv/pool of a run exchanges its own halo (forward, and its
gradient in backward) and overlaps it with its own compute: it costs the halo time the cost
model charges it (``exposed_halo_s`` in ``nowdl.partitioner.costs.costmodel``, [Note: halo overlap
cost]; a one-way exchange is ``latency + halo bytes / link``). Fused
(:func:`nowdl.runtime.spatial.fusion.fused_forward`), the run exchanges once, a deeper halo that its
first op overlaps the same way, and recomputes the overlap: the first op's exposed time for
the deep halo ``+ extra x run compute``, where ``extra`` is the fraction of output recomputed
beyond the tiles. The planner fuses a
run when the second is smaller ("auto"); ``"off"`` never fuses; an integer N fuses every run
into chains of up to N convs/pools whatever the cost (the seeds' ``--fused-layers N``).
A run is a chain of call_module nodes of one spatial stage, each feeding only the next, all
fusable (conv, pool, pointwise activations; a norm, an add or a concat ends it).

[Note: fused workspace] A fused run's first op is a window op on the deep window (tile plus
the run's halo): its backward allocates the window's gradient and its input gradient over the
window, besides the output gradient, where an unfused padded conv makes a tile-sized input
gradient only. :func:`fused_workspace` charges that op ``backward gradients / P + window +
halo`` (bench_spatial's Table 6, UNet at 256², whole model on 2 tiles: the fused run after the
concat held 2.06 + 2.06 + 1.01 MiB where the unfused plan charged 3.0, and the fused run
measured 14.20 MiB against 13.15 unfused); ``assemble.charge_fused_workspace`` raises the
plan's predicted peaks by it once the runs are chosen (after the split: the solvers and the
memory cap do not see it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from nowdl.errors import NowdlError
from nowdl.geometry import chain_geometry, fusable
from nowdl.partitioner.costs.costmodel import (
    HALO_LATENCY_S,
    border_fraction,
    dtype_bytes,
    exposed_halo_s,
    grad_workspace,
)
from nowdl.partitioner.spatial.tileable import SpatialRule, halo_elements, spatial_rules
from nowdl.profiler.cost import Profile

__all__ = ["fusion_runs", "choose_fusion", "fused_workspace", "fusion", "check_policy", "FUSION_POLICIES", "StageLayout",
           "Fusion"]

FUSION_POLICIES = ("auto", "off")

StageLayout = tuple[list[str], int, list[int]]  # a stage's nodes, tiles and tile grid
Fusion = Callable[[Profile, Sequence[StageLayout]], tuple[list[list[list[str]]], dict[str, float]]]
"""What ``build_plan`` asks of halo fusion: per stage, its fused runs, and per run's first node its workspace."""


def _windowed(m: nn.Module) -> bool:
    return isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
                          nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d))


def fusion_runs(gm: fx.GraphModule, nodes: Sequence[str]) -> list[list[str]]:
    """Maximal fusable runs among ``nodes`` (one stage), each with at least two convs/pools."""
    mods = dict(gm.named_modules())
    members = set(nodes)
    by_name = {n.name: n for n in gm.graph.nodes}

    def ok(n: fx.Node) -> bool:
        return n.name in members and n.op == "call_module" and fusable(mods[str(n.target)])

    runs: list[list[str]] = []
    seen: set[str] = set()
    for name in nodes:
        n = by_name.get(name)
        if n is None or name in seen or not ok(n):
            continue
        prev = n.all_input_nodes[0] if len(n.all_input_nodes) == 1 else None
        if prev is not None and ok(prev) and list(prev.users) == [n]:
            continue  # not the start of a run
        run = [n]
        while len(run[-1].users) == 1:
            nxt = next(iter(run[-1].users))
            if not ok(nxt) or nxt.all_input_nodes != [run[-1]]:
                break
            run.append(nxt)
        seen.update(r.name for r in run)
        if sum(_windowed(mods[str(r.target)]) for r in run) >= 2:
            runs.append([r.name for r in run])
    return runs


def _split(run: list[str], windowed: dict[str, bool], most: int) -> list[list[str]]:
    """Cut a run into chains of at most ``most`` convs/pools (pointwise ops ride along)."""
    out: list[list[str]] = []
    cur: list[str] = []
    count = 0
    for name in run:
        if windowed[name] and count == most:
            out.append(cur)
            cur, count = [], 0
        cur.append(name)
        count += int(windowed[name])
    out.append(cur)
    return [c for c in out if sum(windowed[n] for n in c) >= 2]


@dataclass(frozen=True)
class _Graph:
    """What the cost of a chain needs from the traced graph, looked up once per plan."""

    nodes: dict[str, fx.Node]
    mods: dict[str, nn.Module]
    rules: dict[str, SpatialRule]

    def module(self, name: str) -> nn.Module:
        return self.mods[str(self.nodes[name].target)]

    def source(self, name: str) -> str:
        return self.nodes[name].all_input_nodes[0].name


def _gain(g: _Graph, chain: list[str], prof: Profile, grid: Sequence[int], link_bw: float,
          latency_s: float = HALO_LATENCY_S) -> float:
    """Seconds saved per micro-batch by fusing ``chain`` (negative: fusion is slower)."""
    first = g.source(chain[0])
    if first not in prof or not prof[first].out_shape:
        return -math.inf
    shape = list(prof[first].out_shape or [])
    item = dtype_bytes(prof[first].out_dtype)
    try:
        geo = chain_geometry([g.module(c) for c in chain], shape[2:], grid)
    except (ValueError, NotImplementedError):
        return -math.inf
    parts = math.prod(grid)

    def exposed(c: str, rule: SpatialRule, sshape: Sequence[int], halo: Sequence[int]) -> float:
        one_way = latency_s + halo_elements(sshape, grid, halo) * item / link_bw
        n = prof[c] if c in prof else None
        return exposed_halo_s(rule, one_way, n.fwd_s / parts if n else 0.0, n.bwd_s / parts if n else 0.0,
                               bool(n and n.param_bytes > 0), border_fraction(sshape, grid, halo))

    unfused = 0.0
    for c in chain:
        src = g.source(c)
        sshape = prof[src].out_shape if src in prof else None
        if _windowed(g.module(c)) and sshape:
            unfused += exposed(c, g.rules[c], sshape, g.rules[c].halo)
    deep = tuple(max(lo, hi) for lo, hi in geo["halo"])
    compute = sum(prof[c].time_s for c in chain if c in prof) / parts
    # the run's first op is a window op on the deep window: it overlaps the deep exchange
    fused = exposed(chain[0], g.rules[chain[0]], shape, deep) + float(geo["extra_fraction"]) * compute
    return unfused - fused


def check_policy(policy: object) -> str | int:
    """``policy`` if it is a valid halo_fusion setting ("auto", "off", N >= 2; "N" from a CLI)."""
    if isinstance(policy, str) and policy.isdigit():
        policy = int(policy)
    if isinstance(policy, bool) or not (policy in FUSION_POLICIES or (isinstance(policy, int) and policy >= 2)):
        raise NowdlError(f"halo_fusion must be 'auto', 'off' or an integer N >= 2 (fuse up to N convs/pools per "
                         f"exchange), got {policy!r}")
    return policy  # type: ignore[return-value]


def choose_fusion(gm: fx.GraphModule, stages: Sequence[StageLayout], prof: Profile, link_bw: float, policy: str | int,
                  latency_s: float = HALO_LATENCY_S) -> list[list[list[str]]]:
    """Per stage (nodes, tiles, grid), its fused runs, following ``policy``; a halo exchange costs
    ``latency_s`` plus its bytes at ``link_bw`` (a calibrated spec's figures).

    Raises:
        NowdlError: an unknown policy.
    """
    policy = check_policy(policy)
    g = _Graph({n.name: n for n in gm.graph.nodes}, dict(gm.named_modules()), spatial_rules(gm))
    out: list[list[list[str]]] = []
    for nodes, parts, grid in stages:
        fused: list[list[str]] = []
        out.append(fused)
        if parts <= 1 or policy == "off":
            continue
        for run in fusion_runs(gm, nodes):
            windowed = {name: _windowed(g.module(name)) for name in run}
            if isinstance(policy, int):
                fused.extend(_split(run, windowed, policy))
                continue
            best: list[list[str]] = []
            best_gain = 0.0
            for most in range(2, len(run) + 1):
                chains = _split(run, windowed, most)
                gain = sum(_gain(g, c, prof, grid, link_bw, latency_s) for c in chains)
                if gain > best_gain:
                    best, best_gain = chains, gain
            fused.extend(best)
    return out


def fused_workspace(gm: fx.GraphModule, stages: Sequence[StageLayout], fused: Sequence[Sequence[list[str]]],
                    prof: Profile) -> dict[str, float]:
    """Per fused run (``fused[s]``, the runs of stage ``s``), its first node's backward workspace
    per tile rank, in bytes ([Note: fused workspace])."""
    g = _Graph({n.name: n for n in gm.graph.nodes}, dict(gm.named_modules()), {})
    grads = dict(zip((n.name for n in prof.nodes), grad_workspace(prof), strict=True))
    out: dict[str, float] = {}
    for (_, parts, grid), runs in zip(stages, fused, strict=True):
        for chain in runs if parts > 1 else []:
            src = g.source(chain[0])
            shape = list(prof[src].out_shape or []) if src in prof else []
            if len(shape) < 3 or chain[0] not in grads:
                continue
            try:
                geo = chain_geometry([g.module(c) for c in chain], shape[2:], grid)
            except (ValueError, NotImplementedError):
                continue
            deep = tuple(max(lo, hi) for lo, hi in geo["halo"])
            halo = halo_elements(shape, grid, deep) * dtype_bytes(prof[src].out_dtype)
            out[chain[0]] = grads[chain[0]] / parts + prof[src].out_bytes / parts + 2 * halo
    return out


def fusion(gm: fx.GraphModule, policy: str | int, link_bw: float, latency_s: float = HALO_LATENCY_S) -> Fusion:
    """The halo fusion of a plan ([Note: fusion cost], [Note: fused workspace]), for ``build_plan``:
    the runs of each stage under ``policy`` and their workspace, computed once."""
    policy = check_policy(policy)

    def runs_and_workspace(prof: Profile, stages: Sequence[StageLayout]) -> tuple[list[list[list[str]]], dict[str, float]]:
        fused = choose_fusion(gm, stages, prof, link_bw, policy, latency_s)
        return fused, fused_workspace(gm, stages, fused, prof)

    return runs_and_workspace
