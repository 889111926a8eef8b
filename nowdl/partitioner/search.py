"""Configuration search: bound every candidate, solve only the ones that can win, emit a Plan.

[Note: configuration search] Every candidate configuration (stages, micro-batches,
replicas, dp, spatial layout) gets cheap bounds first ([Note: candidate bounds]): an upper
bound on its throughput and a lower bound on its memory. Candidates are then taken best
bound first and solved by ``solve(..., ilp=False)``: the exact DP over ideals where the
graph allows (then the candidate's value is proven), else a heuristic split (DP over a
topological order, MASTER descent; where none fits the cap, a MILP of at most
``SCREEN_MILP_S`` seconds). The search stops as soon as no remaining candidate's
bound can beat the best proven-achievable throughput of a candidate that leaves no GPU idle
(with balance "compute" a heuristic's time is achievable, so it prunes too). Only
candidates whose value is not proven and that may beat the best proven one go to the MILP
(at most ``FINALISTS``), each started from its heuristic split, best first: each may use what
is left of ``time_limit`` (which bounds the whole search) but ``FINALIST_RESERVE_S`` for each
one after it, and its MILP stops once within ``mip_gap``.
The best candidate is the one with no idle GPU and the highest predicted throughput (then
the least memory); one that idles a GPU is chosen only when every candidate does, and the
plan then says so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from nowdl.errors import InfeasibleError, NowdlError
from nowdl.partitioner.assemble import SearchResult, build_plan
from nowdl.partitioner.bounds import Bounds, candidate_bounds
from nowdl.partitioner.config import Candidate, PlanRequest, enumerate_candidates
from nowdl.partitioner.costmodel import (
    Costs,
    build_problem,
    grad_sync_s,
    message_latency_s,
    predict_step,
)
from nowdl.partitioner.lpbound import memory_floor
from nowdl.partitioner.plan import format_bytes
from nowdl.partitioner.problem import Partition, Problem
from nowdl.partitioner.solve import SolveCache, final_split, proven, solve
from nowdl.partitioner.spread import idle_stages, idle_warning

__all__ = ["search", "SearchResult", "FINALISTS", "FINALIST_RESERVE_S", "SCREEN_MILP_S", "build_plan", "timed_search"]

log = logging.getLogger(__name__)

FINALISTS = 3  # candidates solved by the MILP at most (their values not proven by the DP)
FINALIST_RESERVE_S = 2.0  # seconds kept for each later finalist while an earlier one runs; less: no MILP
# [Note: HiGHS overrun] HiGHS checks its time limit between phases, and its lifting for probing
# (HiGHS >= 1.11) neither checks it nor calls the interrupt callbacks: at the root of SwinUNETR's
# 8-stage MILP (4,811 columns) it ran 6.4 s past a 1.96 s limit, making plan() 35.6 s against
# its 30. A finalist left less than FINALIST_RESERVE_S keeps its screened split instead, when that
# fits the cap (one that does not still gets its MILP, for at least 0.5 s). (Turning
# the lifting off cures the overrun, but any explicit mip_lifting_for_probing gave a wrong
# "optimal" tie-break on a 6-node test problem in HiGHS 1.15.1, and it slows AmoebaNet-D's
# proof: within 1% in 20.7 s with it, 1.22% after 38 s without.)
SCREEN_MILP_S = 3.0  # a screening solve whose heuristics fit nothing under the cap tries the MILP this long
_REL = 1e-9


@dataclass
class _Eval:
    """One solved candidate."""

    cand: Candidate
    problem: Problem
    bounds: Bounds
    part: Partition
    pred: dict[str, float]
    exact: bool  # the split is the candidate's proven lexicographic optimum
    final: bool  # the split will not change (no MILP would improve it)
    fits: bool  # within the memory cap
    idle: bool  # some stage gets less than 5 % of the busiest one's work

    def key(self) -> tuple[bool, float, float]:
        return (self.idle, -self.pred["throughput"], self.part.bottleneck_mem)

    def achievable(self, balance: str, costs: Costs, batch: int) -> float:
        """A throughput this candidate's final plan reaches at least (0: unknown)."""
        if self.final:
            return self.pred["throughput"]
        if balance != "compute":
            return 0.0  # the MILP's memory optimum may be slower than the heuristic split
        c = self.cand
        params = sum(n.param_bytes for n in costs.profile.nodes)
        sync = grad_sync_s(costs, c, [params] * c.stages, [params] * c.stages)  # an upper bound
        lat = max(message_latency_s(costs, c, self.part.stage_of)) * c.replicas  # this split's ([Note: message latency])
        step = (c.micro_batches + c.stages - 1) * (self.part.bottleneck_time + lat) + sync
        return batch * c.micro_batches * c.replicas * c.dp / step if step > 0 else math.inf


def _as_memory(p: Problem) -> Problem:
    return p if p.objective == "memory" else dataclasses.replace(p, objective="memory")


def _uncapped(p: Problem) -> Problem:
    return dataclasses.replace(p, mem_cap=None)


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


def _evaluate(costs: Costs, cand: Candidate, problem: Problem, bounds: Bounds, cache: SolveCache,
              batch: int, time_limit: float = 30.0, mip_gap: float = 1e-6) -> _Eval | None:
    """Solve a candidate without the MILP; None when pins/tileability allow no split.

    ``time_limit`` bounds the MILP that screening falls back to when no heuristic split fits the
    cap (MASTER): one that cannot find a split in time counts as not fitting."""
    try:
        part = solve(problem, ilp=False, cache=cache, time_limit=time_limit, mip_gap=mip_gap)
        fits = True
    except InfeasibleError:
        try:
            part = solve(_uncapped(problem), ilp=False, cache=cache, time_limit=time_limit, mip_gap=mip_gap)
        except InfeasibleError:
            return None
        fits = False
    if costs.mem_cap is not None and part.bottleneck_mem > costs.mem_cap * (1 + 1e-6):
        fits = False
    idle = bool(idle_stages(problem, part.stage_of))
    return _Eval(cand, problem, bounds, part, predict_step(costs, cand, part, batch),
                 exact=proven(part), final=final_split(part), fits=fits, idle=idle)


def _finish(costs: Costs, ev: _Eval, time_limit: float, cache: SolveCache, batch: int,
            mip_gap: float = 1e-6) -> _Eval | None:
    """The MILP on a candidate, started from its heuristic split."""
    try:
        part = solve(ev.problem, time_limit=time_limit, cache=cache, start=ev.part, mip_gap=mip_gap)
    except InfeasibleError as e:
        log.info("candidate %s does not fit: %s", ev.cand, e)
        return None
    fits = costs.mem_cap is None or part.bottleneck_mem <= costs.mem_cap * (1 + 1e-6)
    return dataclasses.replace(ev, part=part, pred=predict_step(costs, ev.cand, part, batch),
                               exact=proven(part), final=True, fits=fits,
                               idle=bool(idle_stages(ev.problem, part.stage_of)))


def search(
    costs: Costs,
    req: PlanRequest,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> SearchResult:
    """Pick the configuration with the highest predicted throughput that fits the memory cap.

    See [Note: configuration search].

    Raises:
        InfeasibleError: no configuration fits; says the smallest memory that would fit with
            ``req.gpus`` GPUs and the smallest GPU count that would fit the cap.
        NowdlError: the pinned settings allow no configuration for this GPU count.
    """
    t0 = time.perf_counter()
    front, back = _tileable_ends(costs)
    batch = _batch(costs)
    cands = list(enumerate_candidates(req, tileable_front=front, tileable_back=back,
                                      max_stages=_max_stages(costs, req), micro_batch=batch))
    if not cands:
        raise NowdlError(_no_candidate_message(req, front, _first_untileable(costs, front)))
    entries: list[tuple[Candidate, Problem, Bounds]] = []
    for cand in cands:
        problem = build_problem(costs, cand, req.balance)
        try:
            entries.append((cand, problem, candidate_bounds(costs, cand, problem, batch)))
        except InfeasibleError:  # pins and tileability allow no split
            continue
    order = sorted(range(len(entries)), key=lambda i: (-entries[i][2].throughput_ub, i))
    cache = SolveCache()
    evals: list[_Eval] = []
    best_lb = 0.0
    pruned = over = 0
    floors: dict[int, float] = {}  # lower bounds over the cap of the candidates they rule out
    for done, i in enumerate(order):
        cand, problem, b = entries[i]
        if progress is not None:
            progress(done + 1, len(order))
        if b.throughput_ub < best_lb * (1 - _REL):
            pruned = len(order) - done
            break
        if costs.mem_cap is not None:  # no split fits: the nodes' own costs, or the assignment LP, say so
            floor = memory_floor(_as_memory(problem), costs.mem_cap * (1 + _REL), b.mem_lb)
            if floor > costs.mem_cap * (1 + _REL):
                floors[i] = floor
                over += 1
                continue
        screen = min(SCREEN_MILP_S, max(0.5, t0 + req.time_limit - time.perf_counter()))
        ev = _evaluate(costs, cand, problem, b, cache, batch, screen, req.mip_gap)
        if ev is None:
            continue
        evals.append(ev)
        if ev.fits and not ev.idle:
            best_lb = max(best_lb, ev.achievable(req.balance, costs, batch))
    if progress is not None and pruned:
        progress(len(order), len(order))
    screen_s = time.perf_counter() - t0
    results = _finalists(costs, req, evals, cache, batch, deadline=t0 + req.time_limit)
    fitting = [e for e in results if e.fits]
    if not fitting:
        # the least a screened split needs, or a bound of one the bounds ruled out (> the cap)
        min_mem = min([e.part.bottleneck_mem for e in results] + list(floors.values()), default=math.inf)
        if not results and not floors:
            min_mem = min((e[2].mem_lb for e in entries), default=math.inf)
        raise InfeasibleError(_infeasible_message(costs, req, min_mem))
    best = min(fitting, key=lambda e: e.key())
    if best.part.status == "heuristic" and best.part.solver == "ideals":  # MASTER: its gap
        part = solve(best.problem, cache=cache, start=best.part, mip_gap=req.mip_gap)
        best = dataclasses.replace(best, part=part, pred=predict_step(costs, best.cand, part, batch))
        results = [best if e.cand == best.cand else e for e in results]
        fitting = [e for e in results if e.fits]
    # could a candidate whose split is not proven optimal beat the choice? only if its bound says so
    doubt = [e for e in fitting if not e.exact and e is not best and not e.idle
             and e.bounds.throughput_ub > best.pred["throughput"] * (1 + _REL)]
    choice = "proven"
    if doubt:
        edge = max(e.bounds.throughput_ub for e in doubt) / best.pred["throughput"] - 1
        choice = f"{len(doubt)} candidate(s) not proven could be up to {edge:.1%} faster by their bounds"
    stats: dict[str, object] = {
        "enumerated": len(cands), "evaluated": len(evals), "pruned_by_bound": pruned,
        "over_cap_by_bound": over, "proven": sum(1 for e in results if e.exact),
        "milp": sum(1 for e in results if e.part.solver in ("highs", "cbc")),
        "choice": choice, "screen_s": round(screen_s, 3),
        "total_s": round(time.perf_counter() - t0, 3),
    }
    warnings: list[str] = []
    if best.idle:
        msg = idle_warning(best.problem, best.part.stage_of, costs.names, balance=req.balance,
                           pinned=req.stages is not None)
        if msg:
            log.warning("%s", msg)
            warnings.append(msg)
    log.info("search: %d candidates, %d solved (%d proven), %d pruned by bounds, in %.2f s",
             len(cands), len(evals), stats["proven"], pruned, time.perf_counter() - t0)
    return SearchResult(best.cand, best.part, best.pred, len(cands), stats, warnings)


def _finalists(costs: Costs, req: PlanRequest, evals: list[_Eval], cache: SolveCache,
               batch: int, *, deadline: float) -> list[_Eval]:
    """Run the MILP on the unproven candidates that may beat the best proven one, sharing
    what is left of the search's time limit best first (one left with less than
    FINALIST_RESERVE_S keeps its screened split if that fits the cap, else gets 0.5 s at least)."""
    fits = [e for e in evals if e.fits]
    final = [e for e in fits if e.final]
    best_final = min(final, key=lambda e: e.key()) if final else None
    if fits:
        # also the DP splits that long-skip waits left unproven ([Note: long-skip gradient
        # waits]) whose bound may beat the best: their MILP is small (the DP's lattice was)
        todo = sorted((e for e in fits if not e.final and (
            best_final is None or e.key() < best_final.key() or (
                e.part.solver.endswith("+waits") and not e.idle
                and e.bounds.throughput_ub > best_final.pred["throughput"] * (1 + _REL)))),
            key=lambda e: e.key())[:FINALISTS]
    else:  # nothing fits by the heuristics: the MILP may still fit the leanest ones
        todo = sorted((e for e in evals if not e.final), key=lambda e: e.part.bottleneck_mem)[:FINALISTS]
    if not todo:
        return evals
    out = [e for e in evals if all(e is not t for t in todo)]
    for i, ev in enumerate(todo):
        done_best = max((e.achievable(req.balance, costs, batch) for e in out
                         if e.fits and not e.idle), default=0.0)
        if ev.bounds.throughput_ub < done_best * (1 - _REL):  # cannot win any more: keep as is
            out.append(ev)
            continue
        # the most promising first, with all that is left but a reserve for each one after it:
        # its MILP stops at mip_gap, handing what it did not need on (AmoebaNet-D at 8 stages
        # needed 20 s of HiGHS for 1 %, where two thirds of the budget gave it 15 s and 1.3 %)
        later = len(todo) - 1 - i
        share = deadline - time.perf_counter() - later * FINALIST_RESERVE_S
        if share < FINALIST_RESERVE_S and ev.fits:  # [Note: HiGHS overrun]: keep the screened split
            out.append(ev)
            continue
        done = _finish(costs, ev, max(0.5, share), cache, batch, req.mip_gap)
        out.append(done if done is not None else dataclasses.replace(ev, fits=False))
    return out


def _max_stages(costs: Costs, req: PlanRequest | None = None) -> int:
    """Stages a search may try: one per compute node; a pinned count may go up to one per node
    (the plan then warns about the idle GPUs)."""
    compute = max(1, sum(1 for n in costs.profile.nodes if n.op not in ("placeholder", "output", "get_attr")))
    if req is not None and req.stages is not None:
        return max(compute, min(req.stages, len(costs.profile.nodes)))
    return compute


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
    cache = SolveCache()
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
            try:
                part = solve(_uncapped(build_problem(costs, c, "memory")), ilp=False, cache=cache)
            except InfeasibleError:
                continue
            if costs.mem_cap is not None and part.bottleneck_mem <= costs.mem_cap:
                return g
        g *= 2
    return None


def timed_search(costs: Costs, req: PlanRequest, progress: Callable[[int, int], None] | None = None) -> tuple[SearchResult, float]:
    t0 = time.perf_counter()
    r = search(costs, req, progress=progress)
    return r, time.perf_counter() - t0
