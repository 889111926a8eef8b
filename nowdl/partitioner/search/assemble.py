"""The Plan of a finished search: stages, rank map, cross-stage tensors, predictions, solver."""

from __future__ import annotations

from dataclasses import dataclass, field

from nowdl.partitioner.config.candidate import Candidate, PlanRequest
from nowdl.partitioner.costs.costmodel import (
    Costs,
    build_problem,
    layout_of,
    message_latency_s,
    stage_sums,
)
from nowdl.partitioner.costs.levers import lever_figures
from nowdl.partitioner.costs.memory_breakdown import stage_memory
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.segments import segment_figures
from nowdl.partitioner.costs.seqnorms.schedule import refuse_layerwise
from nowdl.partitioner.costs.sequential_tiles import schedule_of, time_terms
from nowdl.partitioner.costs.traffic import cross_node_bytes, halo_bytes, together_groups
from nowdl.partitioner.search.candidate_problem import stage_grids
from nowdl.partitioner.search.halo_fusion import Fusion
from nowdl.partitioner.spatial.tileable import slice_grid
from nowdl.plan.plan import PLAN_VERSION, Plan, RankPlan, StagePlan, TensorPlan

__all__ = ["SearchResult", "build_plan"]


@dataclass(frozen=True)
class SearchResult:
    """The chosen configuration, its split and prediction, and how the search went."""

    candidate: Candidate
    partition: Partition
    predicted: dict[str, float]
    screened: int  # candidate configurations enumerated
    stats: dict[str, object] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    costs: Costs | None = None  # the costs at the chosen micro-batch size, when not the profiled one
    batch_note: str = ""  # the global batch and why ([Note: micro-batch size] in batch_split.py)
    problem: Problem | None = None  # the chosen candidate's problem (sequential tiles: its vectors)


def build_plan(
    costs: Costs,
    req: PlanRequest,
    result: SearchResult,
    *,
    model_info: dict[str, object],
    profile_info: dict[str, object],
    solver_seconds: float,
    created_by: str,
    params_per_node: dict[str, int],
    fusion: Fusion | None = None,
) -> Plan:
    """Assemble the Plan (stages, rank map, cross-stage tensors, predictions) for a solved search.

    The plan is made from the costs at the chosen micro-batch size (``result.costs``), so its
    tensors and recorded inputs carry that many samples. ``fusion`` (``halo_fusion.fusion``)
    chooses each spatial stage's fused halo runs; their workspace is charged in the stages'
    memory ([Note: fused workspace] in partitioner/search/halo_fusion.py)."""
    cand, part = result.candidate, result.partition
    if result.costs is not None:
        costs = result.costs
        model_info = {**model_info, "inputs": costs.profile.input_shapes}
    prof = costs.profile
    k = cand.stages
    parts = cand.stage_parts()
    groups = cand.group_sizes()
    lay = layout_of(costs, cand)  # [Note: placement]: on one node, rank = d x rpp + slot start + q
    rank_of = lay.rank_of
    sums = stage_sums(costs, cand, part.stage_of)
    seq = _sequential_stages(cand)
    sp_dims = max(1, len(prof.input_shapes[0]) - 2) if prof.input_shapes else 2
    stage_nodes: list[list[str]] = [[] for _ in range(k)]
    for i, n in enumerate(prof.nodes):
        stage_nodes[part.stage_of[i]].append(n.name)
    grids = [list(slice_grid(cand.slice, parts[s], sp_dims)) if parts[s] > 1 or s in seq else [] for s in range(k)]
    fused: list[list[list[str]]] = [[] for _ in range(k)]
    fused_ws: dict[str, float] = {}
    if fusion is not None:
        fused, fused_ws = fusion(prof, [(stage_nodes[s], parts[s], grids[s]) for s in range(k)])
        # a stage of sequential tiles fuses its halos whole ([Note: sequential tiles cost]): no run's workspace
        fused_ws = {n: w for s in range(k) if s not in seq for run in fused[s] for n, w in fused_ws.items() if n == run[0]}
    mem = stage_memory(costs, cand, part.stage_of, fused_ws)  # [Note: memory breakdown]
    if seq and result.problem is not None:
        _sequential_terms(result.problem, part.stage_of, seq, mem, sums)
    halo = halo_bytes(costs, cand, part.stage_of)
    stages = []
    lat = message_latency_s(costs, cand, part.stage_of)  # [Note: message latency]
    lever = lever_figures(build_problem(costs, cand, "memory"), cand, part.stage_of, sums, costs.host_link_bw)
    segs = segment_figures(prof, cand.segments, part.stage_of, cand.inflight(), lever)  # [Note: recompute segments]
    time_s = [part.stage_time[s] + lat[s] + lever[s]["offload_s"] for s in range(k)]
    # [Note: freed by the peak]; the solvers' bound does not hold the fused runs' workspace: added here
    peak = [part.stage_mem[s] + mem[s]["fused_bytes"] - mem[s]["freed_bytes"] for s in range(k)]
    whole = stage_grids(costs, cand) if seq else []
    inflight = cand.inflight()
    terms = [time_terms(costs, [i for i, st in enumerate(part.stage_of) if st == s], parts[s], whole[s], inflight[s])
             if s in seq else {} for s in range(k)]  # [Note: sequential tiles cost]
    norms = [schedule_of(costs, parts[s], whole[s], inflight[s]) if s in seq else None for s in range(k)]
    for s, sched in enumerate(norms):  # [Note: layer-wise norms cost]
        if sched is not None:
            refuse_layerwise(costs, sched, s)
            if sched.mode == "layerwise":
                terms[s]["norm_host_bytes"] = sched.host_bytes
    for s in range(k):
        comm = time_s[s] - (sums[s]["fwd_s"] + sums[s]["bwd_s"] + lever[s]["recompute_s"] + lever[s]["offload_s"]
                            + sum(v for key, v in terms[s].items() if key.endswith("_s")))
        stages.append(StagePlan(
            index=s, nodes=stage_nodes[s], ranks=[rank_of[(0, s, q)] for q in range(parts[s])],
            parts=parts[s], slice=cand.slice if parts[s] > 1 or s in seq else None, grid=grids[s], fused=fused[s],
            tiles_per_gpu=cand.tiles_per_gpu if s in seq else 1,
            params=sum(params_per_node.get(n, 0) for n in stage_nodes[s]),
            param_bytes=int(sums[s]["param_bytes"]),
            recompute=s in cand.recompute, offload=s in cand.offload, recompute_segment=segs[s],
            norm_schedule=getattr(norms[s], "mode", ""),
            predicted={
                "peak_bytes": peak[s], "static_bytes": sums[s]["static_bytes"],
                "act_bytes": sums[s]["act_bytes"], "fwd_s": sums[s]["fwd_s"], "bwd_s": sums[s]["bwd_s"],
                "comm_s": max(0.0, comm), "time_s": time_s[s],
                "inflight": float(cand.inflight()[s]), "deferred": float(cand.deferred()[s]), "halo_bytes": halo[s],
                **mem[s], **lever[s], **terms[s],
            },
        ))
    ranks: list[RankPlan] = []
    for d in range(cand.dp):
        for j in range(k):
            for q in range(groups[j]):
                held = []
                if q < parts[j]:
                    held.append({"replica": 0, "stage": j, "part": q})
                if cand.replicas == 2 and q < parts[k - 1 - j]:
                    held.append({"replica": 1, "stage": k - 1 - j, "part": q})
                ranks.append(RankPlan(
                    rank=rank_of[(d, j, q)], dp=d, stages=held,
                    predicted_peak_bytes=sum(peak[h["stage"]] for h in held),
                    predicted_time_s=sum(time_s[h["stage"]] for h in held),
                ))
    ranks.sort(key=lambda r: r.rank)
    consumers: dict[int, set[int]] = {}
    for u, v in costs.edges:
        su, sv = part.stage_of[u], part.stage_of[v]
        if sv > su:
            consumers.setdefault(u, set()).add(sv)
    tensors = []
    for ui in sorted(consumers):
        n = prof.nodes[ui]
        tensors.append(TensorPlan(producer=n.name, from_stage=part.stage_of[ui], to_stages=sorted(consumers[ui]),
                                  shape=list(n.out_shape or []), dtype=n.out_dtype, bytes=int(n.out_bytes)))
    spatial: dict[str, object] = ({"stages": cand.spatial_stages(), "parts": cand.parts, "slice": cand.slice,
                                   "stage_parts": [parts[s] for s in cand.spatial_stages()]} if cand.parts > 1 else {})
    if seq:
        spatial = {"stages": sorted(seq), "parts": cand.parts, "slice": cand.slice,
                   "stage_parts": [parts[s] for s in sorted(seq)], "tiles_per_gpu": cand.tiles_per_gpu}
    config = {
        "gpus": req.gpus, "balance": req.balance, "stages": k, "micro_batches": cand.micro_batches,
        "micro_batch_size": cand.micro_batch_size, "global_batch": cand.global_batch(),
        "batch_choice": result.batch_note,
        "schedule": cand.schedule, "replicas": cand.replicas, "dp": cand.dp, "spatial": spatial,
        "gpu_memory": costs.mem_cap,
        "recompute": _setting(req.recompute), "offload": _setting(req.offload),
        "host_memory": costs.host_memory, "host_link_bw": costs.host_link_bw,
        "pinned": {key: getattr(req, key) for key in ("stages", "micro_batches", "schedule", "replicas", "dp",
                                                     "spatial_parts", "spatial_stages", "slice", "global_batch", "micro_batch_size",
                                                     "tiles_per_gpu") if getattr(req, key) is not None},
    }
    topology = lay.topo.to_dict()
    topology["node_of_rank"] = [lay.node(r.rank) for r in ranks]
    plan = Plan(
        model=dict(model_info), profile=dict(profile_info), config=config, stages=stages, ranks=ranks,
        tensors=tensors, schedule={"name": cand.schedule, "micro_batches": cand.micro_batches,
                                   "inflight": cand.inflight()},
        predicted={**result.predicted, "peak_bytes": max(r.predicted_peak_bytes for r in ranks)},
        solver={"name": part.solver, "status": part.status, "gap": part.gap, "seconds": round(solver_seconds, 3),
                "ilp_seconds": round(part.seconds, 3), "candidates": result.screened,
                "search": dict(result.stats)},
        version=PLAN_VERSION, created_by=created_by, warnings=list(result.warnings), topology=topology,
    )
    plan.topology["together"] = together_groups(plan)
    plan.topology["cross_node_bytes"] = cross_node_bytes(plan)
    return plan


def _setting(v: object) -> object:
    """A lever setting as JSON: "auto", "on", "off" or a list of stages."""
    return list(v) if isinstance(v, tuple) else v


def _sequential_stages(cand: Candidate) -> set[int]:
    """Stages running tiles one after another on each GPU."""
    return set(cand.tiled_stages()) if cand.tiles_per_gpu > 1 else set()


def _sequential_terms(problem: Problem, stage_of: list[int], seq: set[int], mem: list[dict[str, float]],
                      sums: list[dict[str, float]]) -> None:
    """Saved bytes, workspace and act of the stages in ``seq`` from the problem's sequential-tile
    vectors (one tile's working set; [Note: sequential tiles cost]), in place; nothing is freed
    by their peak but what the vectors say."""
    for s in seq:
        vec = problem.variants[problem.stages[s].variant]
        nodes = [v for v, st in enumerate(stage_of) if st == s]
        saved = sum(vec.act[v] for v in nodes)
        mem[s].update(saved_bytes=saved, workspace_bytes=max((vec.workspace[v] for v in nodes), default=0.0),
                      freed_bytes=0.0)
        sums[s]["act_bytes"] = saved
