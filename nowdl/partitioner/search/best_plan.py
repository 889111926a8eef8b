"""Configuration search: bound every candidate, solve only the ones that can win, emit a Plan.

[Note: configuration search] Every candidate configuration gets cheap bounds first, easiest
first ([Note: candidate bounds], [Note: easy candidates first]): an upper bound on its throughput
and a lower bound on its memory. One single-stage candidate is solved first, then the rest best
bound first by ``solve(..., ilp=False)``: the exact DP over ideals where the
graph allows (then the candidate's value is proven), else a heuristic split (DP over a
topological order, MASTER descent; where none fits the cap, a MILP of at most
``SCREEN_MILP_S`` seconds). The search stops as soon as no remaining candidate's
bound can beat the best proven-achievable throughput of a candidate that leaves no GPU idle
(with balance "compute" a heuristic's time is achievable, so it prunes too). Only
candidates whose value is not proven and that may beat the best proven one go to the MILP
(at most ``FINALISTS``), each started from its heuristic split, best first: each may use what
is left of ``time_limit`` (which bounds the whole search: [Note: search deadline] in deadline.py)
but ``FINALIST_RESERVE_S`` for each one after it, and its MILP stops once within ``mip_gap``.
The best candidate is the one with no idle GPU and the highest predicted throughput (then the
least memory); one that idles a GPU is chosen only when every candidate does, and the plan says so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from nowdl.errors import InfeasibleError, NowdlError
from nowdl.partitioner.config.candidate import Candidate, PlanRequest, enumerate_candidates
from nowdl.partitioner.costs.costmodel import (
    Costs,
    grad_sync_s,
    message_latency_s,
    predict_step,
    stage_sums,
)
from nowdl.partitioner.costs.levers import offload_time_s
from nowdl.partitioner.costs.no_idle import idle_stages, idle_warning
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.milp.lp_bound import memory_floor
from nowdl.partitioner.search.assemble import SearchResult, build_plan
from nowdl.partitioner.search.batch_split import CostsByBatch, batch_choice
from nowdl.partitioner.search.bounds import Bounds, candidate_bounds
from nowdl.partitioner.search.candidate_problem import candidate_problem
from nowdl.partitioner.search.deadline import (
    TileGroups,
    bound_easiest_first,
    finishing_split,
    heuristic_over,
    least_memory,
    out_of_time_message,
    out_of_time_warning,
    over_cap_proven,
)
from nowdl.partitioner.search.infeasible import (
    check_tiles_per_gpu,
    describe,
    first_untileable,
    no_candidate_message,
    refusal,
)
from nowdl.partitioner.search.levers import (
    LEVER_SHARE,
    check_offload_possible,
    fit_with_levers,
    floors_over,
    host_fits,
    host_message,
    with_forced,
)
from nowdl.partitioner.search.model_space import batch_of as _batch
from nowdl.partitioner.search.model_space import image_of as _image
from nowdl.partitioner.search.model_space import max_stages as _max_stages
from nowdl.partitioner.search.model_space import tileable_ends as _tileable_ends
from nowdl.partitioner.search.model_space import uncapped as _uncapped
from nowdl.partitioner.search.segments import shorten_recompute
from nowdl.partitioner.solver import SolveCache, final_split, proven, solve

LOOSE_BOUND = 0.5  # a throughput bound more than 50% above the choice is not worth a figure

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
    costs: Costs  # at the candidate's micro-batch size
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

    def achievable(self, balance: str) -> float:
        """A throughput this candidate's final plan reaches at least (0: unknown)."""
        if self.final:
            return self.pred["throughput"]
        if balance != "compute":
            return 0.0  # the MILP's memory optimum may be slower than the heuristic split
        c, costs = self.cand, self.costs
        params = sum(n.param_bytes for n in costs.profile.nodes)
        sync = grad_sync_s(costs, c, [params] * c.stages, [params] * c.stages)  # an upper bound
        lat = max(message_latency_s(costs, c, self.part.stage_of)) * c.replicas  # this split's ([Note: message latency])
        lat += max(offload_time_s(c, stage_sums(costs, c, self.part.stage_of), costs.host_link_bw)) * c.replicas
        step = (c.micro_batches + c.stages - 1) * (self.part.bottleneck_time + lat) + sync
        return c.global_batch() / step if step > 0 else math.inf


def _as_memory(p: Problem) -> Problem:
    return p if p.objective == "memory" else dataclasses.replace(p, objective="memory")


def _evaluate(costs: Costs, cand: Candidate, problem: Problem, bounds: Bounds, cache: SolveCache,
              time_limit: float = 30.0, mip_gap: float = 1e-6, milp: bool = True) -> _Eval | None:
    """Solve a candidate without the MILP; None when pins/tileability allow no split. ``time_limit``
    bounds the MILP that screening falls back to when no heuristic split fits the cap (MASTER): one
    that cannot find a split in time counts as not fitting; ``milp=False``: no such MILP where the
    heuristic least-memory split is over the cap ([Note: search deadline])."""
    part = least_memory(problem, cache, time_limit, mip_gap, heuristic_fit=True) if problem.objective == "memory" else None
    part = part or (None if milp else heuristic_over(problem, cache, time_limit, mip_gap))
    fits = part is not None and part.bottleneck_mem <= (costs.mem_cap or math.inf)
    if part is None or (fits and part.bottleneck_mem * (1 + 1e-8) > (costs.mem_cap or math.inf)):
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
    return _Eval(cand, costs, problem, bounds, part, predict_step(costs, cand, part, cand.micro_batch_size),
                 exact=proven(part), final=final_split(part), fits=fits, idle=idle)


def _finish(ev: _Eval, time_limit: float, cache: SolveCache, mip_gap: float = 1e-6) -> _Eval | None:
    """The MILP on a candidate, started from its heuristic split."""
    costs = ev.costs
    try:
        part = solve(ev.problem, time_limit=time_limit, cache=cache, start=ev.part, mip_gap=mip_gap)
    except InfeasibleError as e:
        log.info("candidate %s does not fit: %s", ev.cand, e)
        return None
    if not host_fits(costs, ev.cand, part.stage_of):  # offloads over the host memory: the screened split
        return dataclasses.replace(ev, final=True)
    fits = costs.mem_cap is None or part.bottleneck_mem <= costs.mem_cap * (1 + 1e-6)
    return dataclasses.replace(ev, part=part, pred=predict_step(costs, ev.cand, part, ev.cand.micro_batch_size),
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
    check_tiles_per_gpu(req, _image(costs), front)
    cands = list(enumerate_candidates(req, tileable_front=front, tileable_back=back,
                                      max_stages=_max_stages(costs, req), micro_batch=batch, image=_image(costs)))
    if not cands:
        raise NowdlError(no_candidate_message(req, front, first_untileable(costs, front), costs=costs))
    check_offload_possible(costs, req)
    cands = [c for c in (with_forced(req, c) for c in cands) if c is not None]  # [Note: choosing levers]
    if not cands:
        raise NowdlError(f"recompute={req.recompute!r}, offload={req.offload!r}: no candidate configuration has the "
                         "stages they name (zero bubble takes neither): name stages below the pipeline depth, "
                         "pin --stages, or use schedule 1f1b or gpipe")
    by_batch = CostsByBatch(costs, batch)
    cache = SolveCache()
    # [Note: sequential tiles last] tiles run in turn on a GPU never make a configuration faster
    # (the forward runs twice): with tiles_per_gpu "auto" they are searched only when nothing
    # fits without them or fits only with recompute/offload (then the faster one wins), so
    # plans that fit stay as they were
    first = [c for c in cands if c.tiles_per_gpu == 1]
    later = [c for c in cands if c.tiles_per_gpu > 1]
    pools = [first, later] if first and later else [cands]
    evals: list[_Eval] = []
    results: list[_Eval] = []
    pruned = over = untried = 0
    host_refused: dict[Candidate, str] = {}  # offloads over the host memory ([Note: host offload])
    deadline = t0 + req.time_limit  # [Note: search deadline]
    for i, pool in enumerate(pools):
        if time.perf_counter() > deadline:
            untried += sum(len(q) for q in pools[i:])
            break
        pool_evals, p, o, u = _screen(req, pool, by_batch, cache, t0, progress, host_refused)
        evals += pool_evals
        pruned, over, untried = pruned + p, over + o, untried + u
        results += _finalists(req, pool_evals, cache, deadline=deadline)
        if any(e.fits and not (e.cand.recompute or e.cand.offload) for e in results):
            break  # else sequential tiles compete with recompute/offload on predicted throughput
    screen_s = time.perf_counter() - t0
    fitting = [e for e in results if e.fits]
    if not fitting:  # the leanest split screened, and more: [Note: infeasible figures]
        lean = min(results, key=lambda e: e.part.bottleneck_mem, default=None)
        searched = (lean.part.bottleneck_mem, describe(lean.cand, req.gpus)) if lean is not None else (math.inf, "")
        why_host = host_refused.get(lean.cand) if lean is not None else None  # it fits the GPU, not the host
        if why_host and searched[0] <= (costs.mem_cap or 0.0) * (1 + _REL) and not untried:
            raise InfeasibleError(why_host)
        if host_refused and req.offload not in ("auto", "off"):
            raise InfeasibleError(next(iter(host_refused.values())))
        if untried:
            raise InfeasibleError(out_of_time_message(req, len(cands) - untried, len(cands), searched, costs.mem_cap))
        raise refusal(costs, req, searched, cache, deadline)  # the lattices, splits
    best = min(fitting, key=lambda e: e.key())
    part = finishing_split(best.costs, best.cand, best.problem, best.part, req, cache, deadline)  # [Note: winner refinement]
    if part is not None and host_fits(best.costs, best.cand, part.stage_of):  # not offloads over the host memory
        best = dataclasses.replace(best, part=part, pred=predict_step(best.costs, best.cand, part,
                                                                      best.cand.micro_batch_size))
        results = [best if e.cand == best.cand else e for e in results]
        fitting = [e for e in results if e.fits]
    # could a candidate whose split is not proven optimal beat the choice? only if its bound says so
    doubt = [e for e in fitting if not e.exact and e is not best and not e.idle
             and e.bounds.throughput_ub > best.pred["throughput"] * (1 + _REL)]
    choice = "proven"
    if doubt:  # a bound that allows more than LOOSE_BOUND says nothing: no figure then
        edge = max(e.bounds.throughput_ub for e in doubt) / best.pred["throughput"] - 1
        many = f"{len(doubt)} other configuration{'s' if len(doubt) > 1 else ''} not solved to optimality"
        choice = (f"{many} might be up to {edge:.0%} faster, by their bounds" if edge <= LOOSE_BOUND else
                  f"{many}: their bounds are too loose to say whether one is faster (nowdl plan --exact solves them)")
    stats: dict[str, object] = {
        "enumerated": len(cands), "evaluated": len(evals), "pruned_by_bound": pruned, "over_cap_by_bound": over,
        "proven": sum(1 for e in results if e.exact), "milp": sum(1 for e in results if e.part.solver in ("highs", "cbc")),
        "choice": choice, "screen_s": round(screen_s, 3), "total_s": round(time.perf_counter() - t0, 3),
    }
    warnings: list[str] = []
    if untried:  # [Note: search deadline]
        stats["untried"], warnings = untried, [out_of_time_warning(req, len(cands) - untried, len(cands))]
        log.warning("%s", warnings[-1])
    if best.idle:
        msg = idle_warning(best.problem, best.part.stage_of, costs.names, balance=req.balance,
                           pinned=req.stages is not None)
        if msg:
            log.warning("%s", msg)
            warnings.append(msg)
    log.info("search: %d candidates, %d solved (%d proven), %d pruned by bounds, in %.2f s",
             len(cands), len(evals), stats["proven"], pruned, time.perf_counter() - t0)
    return SearchResult(best.cand, best.part, best.pred, len(cands), stats, warnings,
                        costs=best.costs if best.costs is not costs else None, batch_note=batch_choice(req, best.cand),
                        problem=best.problem)


def _screen(req: PlanRequest, pool: list[Candidate], by_batch: CostsByBatch, cache: SolveCache, t0: float,
            progress: Callable[[int, int], None] | None,
            host_refused: dict[Candidate, str]) -> tuple[list[_Eval], int, int, int]:
    """Bound every candidate of ``pool`` and solve, best bound first, those that can still win ([Note:
    configuration search]) until the deadline; the solved ones, and how many the bounds pruned or
    proved over the cap, and how many the deadline left untried ([Note: search deadline])."""
    deadline = t0 + req.time_limit
    entries, unbounded = bound_easiest_first(pool, by_batch, req.balance, deadline)
    pos = {c: n for n, c in enumerate(pool)}  # ties keep the enumeration's order, as do the results
    order = sorted(range(len(entries)), key=lambda i: (-entries[i][3].throughput_ub, pos[entries[i][0]]))
    easy = [i for i in order if entries[i][0].stages == 1][:1]
    order = easy + [i for i in order if i not in easy]
    evals: list[_Eval] = []
    at: dict[int, int] = {}  # id of an eval -> its candidate's place in the pool
    best_lb = 0.0
    pruned = over = untried = 0
    tiles = TileGroups({e[0]: e[2] for e in entries}, lambda p: over_cap_proven(p, cache, deadline, req.mip_gap))
    for done, i in enumerate(order):
        cand, cc, problem, b = entries[i]
        if progress is not None:
            progress(done + 1, len(order))
        if b.throughput_ub < best_lb * (1 - _REL):
            pruned = len(order) - done
            break
        if time.perf_counter() > deadline and (best_lb > 0 or cand.stages > 1):
            untried = len(order) - done  # past the limit only single-stage splits, until one fits
            break
        if tiles.dominated_over(cand):  # [Note: leanest tiles first]
            over += 1
            continue
        base_over = False  # no split fits without the levers "auto" may add
        if cc.mem_cap is not None:  # no split fits: the nodes' own costs, or the assignment LP, say so
            if cand.tiles_per_gpu > 1:  # sequential tiles keep no activations: no lever applies
                floor = memory_floor(_as_memory(problem), cc.mem_cap * (1 + _REL), b.mem_lb)
                lean_over = floor > cc.mem_cap * (1 + _REL)
            else:
                lean_over, base_over = floors_over(cc, req, cand, problem, b.mem_lb, cand.micro_batch_size)
            if lean_over:
                over += 1
                continue
        lever_deadline = t0 + LEVER_SHARE * req.time_limit
        if base_over and time.perf_counter() > lever_deadline:
            continue  # only levers could fit it, and their time is spent
        screen = min(SCREEN_MILP_S, max(0.5, t0 + req.time_limit - time.perf_counter()))

        def solve_levers(c: Candidate, screen: float = screen, milp: bool = False) -> _Eval | None:
            c_costs, p = candidate_problem(by_batch, c, req.balance)
            e = _evaluate(c_costs, c, p, candidate_bounds(c_costs, c, p, c.micro_batch_size), cache, screen,
                          req.mip_gap, milp)
            if e is None or host_fits(c_costs, c, e.part.stage_of):
                return e
            host_refused[c] = host_message(c_costs, req, c, e.part.stage_of)
            return dataclasses.replace(e, fits=False)

        ev = solve_levers(cand, milp=True) if cand.offload else _evaluate(  # known over: its leanest split, no MILP
            cc, cand, _uncapped(problem) if base_over else problem, b, cache, screen, req.mip_gap)
        if ev is not None and not ev.fits and cand.tiles_per_gpu == 1:  # levers while LEVER_SHARE is left
            ev = shorten_recompute(by_batch, req, fit_with_levers(cc, req, ev, solve_levers, deadline=lever_deadline))
        if ev is None:
            continue
        evals.append(ev)
        at[id(ev)] = pos[cand]
        if ev.fits and not ev.idle:
            best_lb = max(best_lb, ev.achievable(req.balance))
    if progress is not None and (pruned or untried):
        progress(len(order), len(order))
    evals.sort(key=lambda e: at[id(e)])
    return evals, pruned, over, untried + unbounded



def _finalists(req: PlanRequest, evals: list[_Eval], cache: SolveCache, *, deadline: float) -> list[_Eval]:
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
        done_best = max((e.achievable(req.balance) for e in out
                         if e.fits and not e.idle), default=0.0)
        if ev.bounds.throughput_ub < done_best * (1 - _REL):  # cannot win any more: keep as is
            out.append(ev)
            continue
        # the most promising first, with all that is left but a reserve for each one after it:
        # its MILP stops at mip_gap, handing what it did not need on (AmoebaNet-D at 8 stages
        # needed 20 s of HiGHS for 1 %, where two thirds of the budget gave it 15 s and 1.3 %)
        later = len(todo) - 1 - i
        share = deadline - time.perf_counter() - later * FINALIST_RESERVE_S
        if (share < FINALIST_RESERVE_S and ev.fits) or time.perf_counter() > deadline:
            out.append(ev)  # [Note: HiGHS overrun]: keep the screened split ([Note: search deadline])
            continue
        done = _finish(ev, max(0.5, share), cache, req.mip_gap)
        out.append(done if done is not None else dataclasses.replace(ev, fits=False))
    return out


def timed_search(costs: Costs, req: PlanRequest, progress: Callable[[int, int], None] | None = None) -> tuple[SearchResult, float]:
    t0 = time.perf_counter()
    r = search(costs, req, progress=progress)
    return r, time.perf_counter() - t0
