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
from nowdl.partitioner.costs.costmodel import (
    Costs,
    build_problem,
    grad_sync_s,
    message_latency_s,
    predict_step,
)
from nowdl.partitioner.costs.no_idle import idle_stages, idle_warning
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.milp.lp_bound import memory_floor
from nowdl.partitioner.search.assemble import SearchResult, build_plan
from nowdl.partitioner.search.bounds import Bounds, candidate_bounds
from nowdl.partitioner.search.config import Candidate, PlanRequest, enumerate_candidates
from nowdl.partitioner.search.infeasible import (
    describe,
    first_untileable,
    infeasible_message,
    no_candidate_message,
)
from nowdl.partitioner.search.model_space import batch_of as _batch
from nowdl.partitioner.search.model_space import max_stages as _max_stages
from nowdl.partitioner.search.model_space import tileable_ends as _tileable_ends
from nowdl.partitioner.search.model_space import uncapped as _uncapped
from nowdl.partitioner.solver import SolveCache, final_split, proven, solve

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
        raise NowdlError(no_candidate_message(req, front, first_untileable(costs, front)))
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
    if not fitting:  # the leanest split screened, and more: [Note: infeasible figures]
        lean = min(results, key=lambda e: e.part.bottleneck_mem, default=None)
        searched = (lean.part.bottleneck_mem, describe(lean.cand, req.gpus)) if lean is not None else (math.inf, "")
        raise InfeasibleError(infeasible_message(costs, req, searched, cache))  # the graph's lattices, solved splits
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
    if not req.milp:  # anytime: only the long-skip waits' small MILPs ([Note: anytime split])
        todo = [e for e in todo if e.part.solver.endswith("+waits")]
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


def timed_search(costs: Costs, req: PlanRequest, progress: Callable[[int, int], None] | None = None) -> tuple[SearchResult, float]:
    t0 = time.perf_counter()
    r = search(costs, req, progress=progress)
    return r, time.perf_counter() - t0
