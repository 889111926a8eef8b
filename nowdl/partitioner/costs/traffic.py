"""Traffic across node boundaries: what a plan sends between nodes per step, and its rank -> node map.

Counted per optimizer step (every micro-batch of every replica and data-parallel copy):

* halo: a tile group spanning nodes sends, per micro-batch, each rank's halo bytes (forward
  and backward) for the share of neighbouring tile pairs that sit on different nodes;
* boundary: a tensor crossing stages, forward activation and backward gradient, for the share
  of receiving tiles whose sender sits on another node;
* dp all-reduce: a hierarchical all-reduce over N nodes moves 2 (N-1) x the gradient bytes
  across nodes (each node's ring step carries one shard of 1/L of it, L ranks per node);
* MASTER: a stage whose two replicas sit on different nodes exchanges its gradients both ways.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nowdl.partitioner.config.candidate import Candidate
from nowdl.partitioner.spatial.tileable import SpatialRule, halo_elements, slice_grid
from nowdl.units import format_bytes

if TYPE_CHECKING:
    from nowdl.partitioner.costs.costmodel import Costs
    from nowdl.plan.plan import Plan

__all__ = ["halo_bytes", "cross_node_bytes", "node_of_rank", "format_node_map", "together_groups"]

_KINDS = ("halo", "boundary", "dp_allreduce", "master")


def halo_bytes(costs: Costs, cand: Candidate, stage_of: Sequence[int]) -> list[float]:
    """Halo bytes one rank of each stage sends and receives per micro-batch (forward + backward)."""
    from nowdl.partitioner.costs.costmodel import dtype_bytes, spatial_dims_of

    prof = costs.profile
    parts = cand.stage_parts()
    producers: dict[str, str] = {}
    for u, v in prof.edges:
        producers.setdefault(v, u)
    out = [0.0] * cand.stages
    for i, n in enumerate(prof.nodes):
        s = stage_of[i]
        rule: SpatialRule | None = costs.rules.get(n.name)
        if parts[s] <= 1 or rule is None or not rule.tileable or not rule.halo or not any(rule.halo):
            continue
        src = producers.get(n.name)
        shape = prof[src].out_shape if src is not None and src in prof else None
        if src is None or shape is None or len(shape) < 3:
            continue
        grid = slice_grid(cand.slice, parts[s], spatial_dims_of(prof))
        out[s] += 2.0 * halo_elements(shape, grid, rule.halo) * dtype_bytes(prof[src].out_dtype)
    return out


def node_of_rank(plan: Plan) -> list[int]:
    """The node of every rank: the plan's map, or one node for plans made before topologies."""
    topo = plan.topology or {}
    got = topo.get("node_of_rank")
    if isinstance(got, list) and len(got) == int(plan.config["gpus"]):
        return [int(n) for n in got]
    return [0] * int(plan.config["gpus"])


def _where(plan: Plan) -> dict[tuple[int, int, int], list[int]]:
    found: dict[tuple[int, int, int], dict[int, int]] = {}
    for r in plan.ranks:
        for h in r.stages:
            found.setdefault((r.dp, int(h.get("replica", 0)), int(h["stage"])), {})[int(h.get("part", 0))] = r.rank
    return {key: [v[q] for q in sorted(v)] for key, v in found.items()}


def together_groups(plan: Plan) -> list[list[int]]:
    """Tile groups and MASTER pairs that the plan keeps inside one node (its costs assume so)."""
    node = node_of_rank(plan)
    where = _where(plan)
    out: list[list[int]] = []
    for (d, rep, s), ranks in sorted(where.items()):
        if len(ranks) > 1 and len({node[r] for r in ranks}) == 1:
            out.append(ranks)
        if rep == 0 and (d, 1, s) in where:
            pair = sorted({*ranks, *where[(d, 1, s)]})
            if len(pair) > 1 and len({node[r] for r in pair}) == 1 and pair not in out:
                out.append(pair)
    return out


def _neighbour_share(ranks: Sequence[int], grid: Sequence[int], node: Sequence[int]) -> float:
    """Share of neighbouring tile pairs (corners included) whose ranks are on different nodes."""
    coords = list(itertools.product(*[range(g) for g in grid]))
    if len(coords) != len(ranks):
        return 1.0 if len({node[r] for r in ranks}) > 1 else 0.0
    pairs = cross = 0
    for a, b in itertools.combinations(range(len(coords)), 2):
        if max(abs(x - y) for x, y in zip(coords[a], coords[b], strict=True)) == 1:
            pairs += 1
            cross += node[ranks[a]] != node[ranks[b]]
    return cross / pairs if pairs else 0.0


def cross_node_bytes(plan: Plan, halo: Sequence[float] | None = None) -> dict[str, float]:
    """Bytes per step sent across node boundaries, by kind (halo, boundary, dp_allreduce, master, total).

    ``halo``: per-stage halo bytes per rank and micro-batch (default: the plan's
    ``stages[i].predicted["halo_bytes"]``, absent in older plans: 0).
    """
    node = node_of_rank(plan)
    where = _where(plan)
    m = int(plan.config["micro_batches"])
    hb = list(halo) if halo is not None else [float(s.predicted.get("halo_bytes", 0.0)) for s in plan.stages]
    out = dict.fromkeys(_KINDS, 0.0)
    for (_, _, s), ranks in where.items():
        st = plan.stages[s]
        if len(ranks) > 1 and hb[s]:
            out["halo"] += hb[s] * len(ranks) * _neighbour_share(ranks, st.grid or [len(ranks)], node) * m
    for t in plan.tensors:
        for j in t.to_stages:
            for (d, rep, s), src in where.items():
                if s != t.from_stage or (d, rep, j) not in where:
                    continue
                dst = where[(d, rep, j)]
                far = sum(node[r] != node[src[min(q, len(src) - 1)]] for q, r in enumerate(dst))
                out["boundary"] += 2.0 * t.bytes * far / len(dst) * m
    copies = {(rep, s, q) for (_, rep, s), ranks in where.items() for q in range(len(ranks))}
    for rep, s, q in copies:
        members = {node[where[(d, rep, s)][q]] for d in range(int(plan.config["dp"])) if (d, rep, s) in where}
        out["dp_allreduce"] += 2.0 * (len(members) - 1) * plan.stages[s].param_bytes
    for (d, rep, s), ranks in where.items():
        if rep == 0 and (d, 1, s) in where:
            other = where[(d, 1, s)]
            out["master"] += sum(2.0 * plan.stages[s].param_bytes for q, r in enumerate(ranks)
                                 if q < len(other) and node[r] != node[other[q]])
    out["total"] = sum(out[k] for k in _KINDS)
    return out


def _span(ranks: Sequence[int]) -> str:
    rs = sorted(ranks)
    if rs == list(range(rs[0], rs[-1] + 1)) and len(rs) > 2:
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs))


def format_node_map(plan: Plan, *, max_nodes: int = 64) -> str:
    """The rank -> node map and the bytes per step that cross node boundaries, as text."""

    topo: dict[str, Any] = plan.topology or {}
    node = node_of_rank(plan)
    n_nodes = max(node) + 1
    head = (f"topology: {topo.get('nodes', 1)} node(s) x {topo.get('gpus_per_node', len(node))} GPUs"
            + (f" ({topo.get('name')}; intra {topo['intra']['bw'] / 1e9:.3g} GB/s, inter {topo['inter']['bw'] / 1e9:.3g} GB/s"
               + (f"; measured all-reduce {topo['allreduce']['bw'] / 1e9:.3g} GB/s + "
                  f"{topo['allreduce']['latency_s'] * 1e6:.0f} us, halo latency {topo['intra']['latency_s'] * 1e6:.0f} us"
                  if "allreduce" in topo else "") + ")"
               if "intra" in topo else " (plan made before topologies: one node holds every rank)"))
    lines = [head]
    held: dict[int, list[str]] = {}
    by_rank = {r.rank: r for r in plan.ranks}
    for n in range(min(n_nodes, max_nodes)):
        ranks = [r for r in range(len(node)) if node[r] == n]
        what: dict[tuple[int, int, int], list[int]] = {}
        for r in ranks:
            for h in by_rank[r].stages:
                what.setdefault((by_rank[r].dp, int(h.get("replica", 0)), int(h["stage"])), []).append(int(h.get("part", 0)))
        items = []
        for (d, rep, s), qs in sorted(what.items()):
            tiles = f" tiles {_span(qs)}" if plan.stages[s].parts > 1 else ""
            items.append(f"dp{d}{'' if plan.config['replicas'] == 1 else f'/r{rep}'}:s{s}{tiles}")
        held[n] = items
        shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
        lines.append(f"node {n}: ranks {_span(ranks)}: {shown}")
    if n_nodes > max_nodes:
        lines.append(f"... {n_nodes - max_nodes} more nodes")
    cross = cross_node_bytes(plan)
    lines.append("bytes per step crossing node boundaries: "
                 + ", ".join(f"{k.replace('_', ' ')} {format_bytes(cross[k])}" for k in _KINDS)
                 + f" (total {format_bytes(cross['total'])})")
    return "\n".join(lines)
