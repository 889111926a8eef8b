"""Configuration search: screen every candidate configuration, solve the best ones exactly, emit a Plan.

Screening uses the exact DP over a topological order on the coarsened graph (fast); the
best few candidates by predicted throughput are then solved by the ILP over the whole DAG
and the best of those becomes the plan. Every pinned setting narrows the candidate list.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from nowdl.errors import InfeasibleError, NowdlError
from nowdl.partitioner.config import Candidate, PlanRequest, enumerate_candidates
from nowdl.partitioner.costmodel import Costs, build_problem, predict_step, stage_sums
from nowdl.partitioner.plan import PLAN_VERSION, Plan, RankPlan, StagePlan, TensorPlan, format_bytes
from nowdl.partitioner.problem import Partition, Problem
from nowdl.partitioner.spatial import slice_grid

__all__ = ["search", "SearchResult", "FINALISTS"]

log = logging.getLogger(__name__)

FINALISTS = 3  # candidates solved by the ILP after screening


@dataclass(frozen=True)
class SearchResult:
    candidate: Candidate
    partition: Partition
    predicted: dict[str, float]
    screened: int


def _screen(costs: Costs, cand: Candidate, objective: str) -> tuple[Partition, dict[str, float]] | None:
    from nowdl.partitioner.coarsen import coarsen, expand
    from nowdl.partitioner.dp import solve_dp

    problem = build_problem(costs, cand, objective)
    problem = _uncapped(problem)
    small, groups = coarsen(problem)
    try:
        part = expand(solve_dp(small), groups, problem)
    except (InfeasibleError, NowdlError):
        return None
    return part, predict_step(costs, cand, part, _batch(costs))


def _uncapped(p: Problem) -> Problem:
    return Problem(names=p.names, edges=p.edges, static=p.static, variants=p.variants, stages=p.stages,
                   tileable=p.tileable, ranks=p.ranks, objective=p.objective, mem_cap=None, pinned=p.pinned)


def _batch(costs: Costs) -> int:
    shapes = costs.profile.input_shapes
    return int(shapes[0][0]) if shapes and shapes[0] else 1


def _tileable_ends(costs: Costs) -> tuple[bool, bool]:
    """Does the graph start with tileable ops, and does it end with them (UNet decoder)?"""
    prof = costs.profile
    rules = costs.rules
    compute = [n for n in prof.nodes if n.op not in ("placeholder", "output", "get_attr")]
    if not compute:
        return False, False
    front = rules[compute[0].name].tileable if compute[0].name in rules else False
    out_inputs = [u for u, v in prof.edges if prof[v].op == "output"]
    back = bool(out_inputs) and all(rules.get(u) is not None and rules[u].tileable for u in out_inputs)
    if back:
        # every node must be tileable for a mirrored decoder region to make sense (fully convolutional)
        back = all(rules[n.name].tileable for n in compute if n.name in rules)
    return front, back


def search(
    costs: Costs,
    req: PlanRequest,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> SearchResult:
    """Pick the configuration with the highest predicted throughput that fits the memory cap.

    Raises:
        InfeasibleError: no configuration fits; says the smallest memory that would fit with
            ``req.gpus`` GPUs and the smallest GPU count that would fit the cap.
        NowdlError: the pinned settings allow no configuration for this GPU count.
    """
    from nowdl.partitioner.solve import solve

    front, back = _tileable_ends(costs)
    cands = list(enumerate_candidates(req, tileable_front=front, tileable_back=back, max_stages=_max_stages(costs),
                                      micro_batch=_batch(costs)))
    if not cands:
        raise NowdlError(_no_candidate_message(req, front, _first_untileable(costs, front)))
    fits: list[tuple[float, int, Candidate]] = []
    over: list[tuple[float, int, Candidate]] = []  # over the cap by the DP; the ILP may still fit
    best_mem = math.inf
    for i, cand in enumerate(cands):
        r = _screen(costs, cand, req.balance)
        if progress is not None:
            progress(i + 1, len(cands))
        if r is None:
            continue
        part, pred = r
        best_mem = min(best_mem, part.bottleneck_mem)
        if costs.mem_cap is None or part.bottleneck_mem <= costs.mem_cap:
            fits.append((-pred["throughput"], i, cand))
        else:
            over.append((part.bottleneck_mem, i, cand))
    finalists = [c for _, _, c in sorted(fits)[:FINALISTS]] or [c for _, _, c in sorted(over)[:FINALISTS]]
    results: list[SearchResult] = []
    min_mem_seen = best_mem
    deadline = time.perf_counter() + req.time_limit  # one budget for all finalists' ILPs
    for i, cand in enumerate(finalists):
        problem = build_problem(costs, cand, req.balance)
        share = max(0.5, (deadline - time.perf_counter()) / (len(finalists) - i))
        try:
            part = solve(problem, time_limit=share)
        except InfeasibleError as e:
            log.info("candidate %s does not fit: %s", cand, e)
            continue
        min_mem_seen = min(min_mem_seen, part.bottleneck_mem)
        results.append(SearchResult(cand, part, predict_step(costs, cand, part, _batch(costs)), len(cands)))
    if not results:
        raise InfeasibleError(_infeasible_message(costs, req, min_mem_seen))
    results.sort(key=lambda r: (-r.predicted["throughput"], r.partition.bottleneck_mem))
    return results[0]


def _max_stages(costs: Costs) -> int:
    return max(1, sum(1 for n in costs.profile.nodes if n.op not in ("placeholder", "output", "get_attr")))


def _first_untileable(costs: Costs, front: bool) -> str:
    """Why the model cannot be spatial to its end: the first node that cannot run on tiles."""
    for n in costs.profile.nodes:
        rule = costs.rules.get(n.name)
        if n.op not in ("placeholder", "output", "get_attr") and rule is not None and not rule.tileable:
            where = "is the model's first operation" if not front else "ends the spatial region"
            return f" Node {n.name!r} {where}: {rule.reason}."
    return ""


def _no_candidate_message(req: PlanRequest, front: bool, untileable: str = "") -> str:
    pins = {k: getattr(req, k) for k in ("stages", "dp", "replicas", "spatial_parts", "spatial_stages", "global_batch") if getattr(req, k)}
    why = ""
    if (req.spatial_parts or req.spatial_stages) and not front:
        why = " The model's first operation cannot run on image tiles, so no spatial stage is possible." + untileable
    elif req.spatial_parts not in (None, 1) or req.spatial_stages:
        why = (" Spatial stages need a non-spatial stage after them unless the whole model runs on tiles."
               + untileable)
    return (
        f"no configuration of {req.gpus} GPUs matches the pinned settings {pins}: ranks per pipeline "
        "(stages, plus (parts - 1) for each spatial stage) times dp must equal gpus." + why +
        " Drop a pinned setting or change gpus."
    )


def _infeasible_message(costs: Costs, req: PlanRequest, min_mem: float) -> str:
    cap = costs.mem_cap or 0.0
    heaviest = max(costs.profile.nodes, key=lambda n: n.static_bytes)
    if heaviest.static_bytes > cap:
        return (
            f"nothing fits in {format_bytes(cap)} per GPU: node {heaviest.name} ({heaviest.target}) alone "
            f"holds {format_bytes(heaviest.static_bytes)} of weights, gradients and optimizer state, "
            "which no pipeline or spatial split divides; with the best configuration of "
            f"{req.gpus} GPUs the fullest GPU needs {format_bytes(min_mem)}. Raise the cap to at least "
            f"{format_bytes(min_mem)} (--gpu-memory), or use a lighter optimizer (--optimizer sgd)."
        )
    need_gpus = _smallest_gpus(costs, req)
    gpu_txt = f"at least {need_gpus} GPUs would fit it" if need_gpus else "no GPU count up to 4096 fits it (the largest single node does not fit)"
    return (
        f"nothing fits in {format_bytes(cap)} per GPU with {req.gpus} GPUs: the best configuration "
        f"needs {format_bytes(min_mem)} on its fullest GPU. Raise the cap to at least "
        f"{format_bytes(min_mem)} (--gpu-memory), or use more GPUs: {gpu_txt}."
    )


def _smallest_gpus(costs: Costs, req: PlanRequest) -> int | None:
    front, back = _tileable_ends(costs)
    g = req.gpus * 2
    while g <= 4096:
        try:
            r = PlanRequest(gpus=g, balance="memory", micro_batches=req.micro_batches, schedule=req.schedule,
                            replicas=req.replicas, slice=req.slice, time_limit=req.time_limit)
        except NowdlError:
            return None
        cands = [c for c in enumerate_candidates(r, tileable_front=front, tileable_back=back, max_stages=_max_stages(costs))
                 if c.dp == 1 and c.replicas == 1]
        if not cands:
            return None
        # the deepest pipeline and the widest spatial split are the memory-lean ones
        cands.sort(key=lambda c: (-(c.stages * c.parts), c.micro_batches))
        for c in cands[:4]:
            s = _screen(costs, c, "memory")
            if s is not None and costs.mem_cap is not None and s[0].bottleneck_mem <= costs.mem_cap:
                return g
        g *= 2
    return None


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
) -> Plan:
    """Assemble the Plan (stages, rank map, cross-stage tensors, predictions) for a solved search."""
    cand, part = result.candidate, result.partition
    prof = costs.profile
    k = cand.stages
    parts = cand.stage_parts()
    groups = cand.group_sizes()
    rpp = sum(groups)
    group_start = [sum(groups[:j]) for j in range(k)]
    sums = stage_sums(costs, cand, part.stage_of)
    sp_dims = max(1, len(prof.input_shapes[0]) - 2) if prof.input_shapes else 2
    stage_nodes: list[list[str]] = [[] for _ in range(k)]
    for i, n in enumerate(prof.nodes):
        stage_nodes[part.stage_of[i]].append(n.name)
    stages = []
    for s in range(k):
        comm = part.stage_time[s] - (sums[s]["fwd_s"] + sums[s]["bwd_s"])
        stages.append(StagePlan(
            index=s, nodes=stage_nodes[s], ranks=list(range(group_start[s], group_start[s] + parts[s])),
            parts=parts[s], slice=cand.slice if parts[s] > 1 else None,
            grid=list(slice_grid(cand.slice, parts[s], sp_dims)) if parts[s] > 1 else [],
            params=sum(params_per_node.get(n, 0) for n in stage_nodes[s]),
            param_bytes=int(sums[s]["param_bytes"]),
            predicted={
                "peak_bytes": part.stage_mem[s], "static_bytes": sums[s]["static_bytes"],
                "act_bytes": sums[s]["act_bytes"], "fwd_s": sums[s]["fwd_s"], "bwd_s": sums[s]["bwd_s"],
                "comm_s": max(0.0, comm), "time_s": part.stage_time[s],
                "inflight": float(cand.inflight()[s]),
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
                    rank=d * rpp + group_start[j] + q, dp=d, stages=held,
                    predicted_peak_bytes=sum(part.stage_mem[h["stage"]] for h in held),
                    predicted_time_s=sum(part.stage_time[h["stage"]] for h in held),
                ))
    consumers: dict[int, set[int]] = {}
    index = {n.name: i for i, n in enumerate(prof.nodes)}
    for u, v in prof.edges:
        su, sv = part.stage_of[index[u]], part.stage_of[index[v]]
        if sv > su:
            consumers.setdefault(index[u], set()).add(sv)
    tensors = []
    for ui in sorted(consumers):
        n = prof.nodes[ui]
        tensors.append(TensorPlan(producer=n.name, from_stage=part.stage_of[ui], to_stages=sorted(consumers[ui]),
                                  shape=list(n.out_shape or []), dtype=n.out_dtype, bytes=int(n.out_bytes)))
    spatial = ({"stages": cand.spatial_stages(), "parts": cand.parts, "slice": cand.slice,
                "stage_parts": [parts[s] for s in cand.spatial_stages()]} if cand.parts > 1 else {})
    config = {
        "gpus": req.gpus, "balance": req.balance, "stages": k, "micro_batches": cand.micro_batches,
        "schedule": cand.schedule, "replicas": cand.replicas, "dp": cand.dp, "spatial": spatial,
        "gpu_memory": costs.mem_cap,
        "pinned": {key: getattr(req, key) for key in ("stages", "micro_batches", "schedule", "replicas", "dp",
                                                     "spatial_parts", "spatial_stages", "slice") if getattr(req, key) is not None},
    }
    return Plan(
        model=dict(model_info), profile=dict(profile_info), config=config, stages=stages, ranks=ranks,
        tensors=tensors, schedule={"name": cand.schedule, "micro_batches": cand.micro_batches,
                                   "inflight": cand.inflight()},
        predicted=dict(result.predicted),
        solver={"name": part.solver, "status": part.status, "gap": part.gap, "seconds": round(solver_seconds, 3),
                "ilp_seconds": round(part.seconds, 3), "candidates": result.screened},
        version=PLAN_VERSION, created_by=created_by,
    )


def timed_search(costs: Costs, req: PlanRequest, progress: Callable[[int, int], None] | None = None) -> tuple[SearchResult, float]:
    t0 = time.perf_counter()
    r = search(costs, req, progress=progress)
    return r, time.perf_counter() - t0
