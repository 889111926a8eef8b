"""How the configuration search keeps to its time limit, and what it says when the limit cuts it short.

[Note: search deadline] ``PlanRequest.time_limit`` bounds the whole search (``plan()`` gives it
what tracing and profiling left). No new work starts after ``t0 + time_limit``: no candidate's
bounds, no candidate's solve, no lever round, no pool of sequential-tile candidates, no MILP
finalist and no MASTER gap solve. What runs when the deadline passes finishes, so the search
can end late by (the documented slack):

- one candidate's solve in progress: the exact DP over ideals or a heuristic split, 0.1 to 1 s
  on ResNet-110-v2 (371 nodes, 16 stages, loaded 2-core machine), or a screening MILP of at most
  ``SCREEN_MILP_S`` (best_plan.py), HiGHS's own overrun aside ([Note: HiGHS overrun]);
- a refusal's figures (the leanest split, the GPU count that fits: [Note: infeasible figures]),
  which get what is left of the limit but at least ``REFUSAL_S`` seconds.

A recompute/offload round ([Note: choosing levers]) takes a candidate whose heuristic
least-memory split (without the cap) is over the cap as not fitting, without the screening
MILP that looks for a capped split the heuristics missed (MASTER): on ResNet-110-v2 at 8192² on
16 GPUs with a free batch, four such MILPs took 26 s of a 52 s search (their model building
is not under HiGHS's time limit). Such a candidate can still get the MILP as a finalist when
nothing fits by the heuristics.

A search cut short returns the best plan it found, with a warning saying how many candidates it
tried; one that found none that fits is refused, saying the limit ran out and what to try
(:func:`out_of_time_message`), not that nothing fits.

[Note: leanest tiles first] A sequential-tile candidate with T tiles per GPU holds at most what
the same configuration holds with fewer tiles: each node of a stage in turn keeps
``act x inflation / T`` (and its workspace likewise), which falls as T doubles ([Note:
sequential tiles cost]), and nothing else changes, provided the larger T keeps every node
tileable that the smaller one does (smaller tiles can exclude ops too small for them,
``candidate_problem.too_small``). So where the proven least memory of a configuration at its
largest T exceeds the cap, every T it dominates is over the cap as well and is not tried
(:class:`TileGroups`). On ResNet-110-v2 at 8192² on 16 GPUs (BatchNorm ends every sequential
stage after the stem) this skips 45 of 54 sequential-tile solves.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from nowdl.errors import InfeasibleError
from nowdl.partitioner.config.candidate import Candidate, PlanRequest
from nowdl.partitioner.costs.costmodel import Costs
from nowdl.partitioner.costs.memory_breakdown import stage_memory
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.structure import one_to_one
from nowdl.partitioner.exact.wait_refine import refine_winner
from nowdl.partitioner.search.batch_split import CostsByBatch
from nowdl.partitioner.search.bounds import Bounds, candidate_bounds
from nowdl.partitioner.search.candidate_problem import candidate_problem
from nowdl.partitioner.search.model_space import uncapped
from nowdl.partitioner.solver import SolveCache, proven, solve
from nowdl.plan.plan import format_bytes

__all__ = ["REFINE_S_PER_NODE", "finishing_split", "REFUSAL_S", "refusal_budget", "out_of_time_message", "out_of_time_warning", "TileGroups", "least_memory", "ease", "bound_easiest_first",
           "over_cap_proven", "heuristic_over"]

REFUSAL_S = 2.0  # seconds a refusal's figures get at least, past the deadline if need be
REFINE_S_PER_NODE = 0.0025  # the anytime winner's wait refinement, at most, per node ([Note: winner refinement])


def refusal_budget(deadline: float, most: float) -> float:
    """Seconds for a refusal's figures: what is left before ``deadline``, at least ``REFUSAL_S``,
    at most ``most``."""
    return min(most, max(REFUSAL_S, deadline - time.perf_counter()))


def finishing_split(costs: Costs, cand: Candidate, problem: Problem, part: Partition, req: PlanRequest,
                    cache: SolveCache, deadline: float) -> Partition | None:
    """The chosen candidate's split improved with what is left of the time limit, or None.

    [Note: winner refinement] A MASTER split of the exact DP's lattice gets the MILP for its
    gap. In the anytime search (no MILP) the screening solves leave out the wait refinement
    ([Note: wait refinement]: seconds each, on every candidate); the chosen split gets it once,
    for ``REFINE_S_PER_NODE`` seconds per node at most (AmoebaNet-D's 1,095 nodes: 2.7 s), where
    its long-skip waits raise it. The refinement lowers the solvers' bound of the fullest stage;
    balancing memory, it is kept only where the peak the plan reports (that bound less what the
    stage has freed by then, ``stage_memory``) does not rise.
    """
    left = deadline - time.perf_counter()
    if left <= 0:
        return None
    if part.status == "heuristic" and part.solver == "ideals":
        return solve(problem, cache=cache, start=part, mip_gap=req.mip_gap, time_limit=left)
    if req.milp or part.status == "optimal" or cand.recompute or cand.offload or cand.tiles_per_gpu > 1:
        return None  # levers and sequential tiles change the plan's peaks past what _plan_peak reads
    got = refine_winner(problem, part, budget_s=min(left, REFINE_S_PER_NODE * problem.n))
    if got is None or (req.balance == "memory" and _plan_peak(costs, cand, got) > _plan_peak(costs, cand, part)):
        return None
    return got


def _plan_peak(costs: Costs, cand: Candidate, part: Partition) -> float:
    """The fullest stage's peak as the plan reports it, one stage per rank."""
    mem = stage_memory(costs, cand, part.stage_of)
    return max(part.stage_mem[s] - mem[s]["freed_bytes"] for s in range(cand.stages))


def _limit_text(req: PlanRequest) -> str:
    x = req.time_limit
    return f"{x:.1f} s" if x >= 1 else f"{x:.2g} s"


def out_of_time_message(req: PlanRequest, tried: int, total: int, leanest: tuple[float, str],
                        cap: float | None) -> str:
    """The refusal of a search whose time limit ran out before any candidate fitted: the limit,
    how far it got, the leanest split it made, and what to try."""
    lean = (f"; the leanest split it made needs {format_bytes(leanest[0])} on its fullest GPU ({leanest[1]})"
            if math.isfinite(leanest[0]) and leanest[1] else "")
    cap_txt = f"{format_bytes(cap)} per GPU" if cap is not None else "the memory cap"
    return (f"time limit: the search ran out of its {_limit_text(req)} after trying {tried} of {total} candidate "
            f"configurations of {req.gpus} GPUs, none of which fits {cap_txt}{lean}; the other {total - tried} "
            "were not tried, so a plan may still exist: raise the time limit (--time-limit 120, "
            "PlannerOptions(time_limit=120)), or pin part of the configuration (--stages, --spatial-parts, "
            "--tiles-per-gpu, --recompute/--offload) so that fewer candidates are searched, or use more GPUs")


def out_of_time_warning(req: PlanRequest, tried: int, total: int) -> str:
    """The plan's warning when the time limit cut the search short."""
    return (f"the search ran out of its {_limit_text(req)} time limit after trying {tried} of {total} candidate "
            "configurations: this plan is the best of those; a larger time limit (--time-limit, "
            "PlannerOptions(time_limit=...)) may find a faster one")


class TileGroups:
    """[Note: leanest tiles first]: which sequential-tile candidates a larger T proves over the cap.

    ``entries`` maps each candidate of a pool to its Problem; ``lean_over(problem)`` says whether
    a problem's proven least peak memory exceeds the cap (False when not proven)."""

    def __init__(self, entries: dict[Candidate, Problem], lean_over: Callable[[Problem], bool]) -> None:
        self._problems = entries
        self._lean_over = lean_over
        self._largest: dict[Candidate, Candidate] = {}
        for c in entries:
            if c.tiles_per_gpu > 1:
                key = _group(c)
                top = self._largest.get(key)
                if top is None or c.tiles_per_gpu > top.tiles_per_gpu:
                    self._largest[key] = c
        self._over: dict[Candidate, bool] = {}

    def dominated_over(self, cand: Candidate) -> bool:
        """Whether ``cand`` (T > 1) is over the cap because its group's largest T is (solving that
        one, once, if need be)."""
        if cand.tiles_per_gpu <= 1:
            return False
        top = self._largest.get(_group(cand))
        if top is None or top == cand:
            return False
        if top not in self._over:
            self._over[top] = self._lean_over(self._problems[top])
        if not self._over[top]:
            return False
        mine, theirs = self._problems[cand], self._problems[top]
        n = mine.n
        return all(t or not m for m, t in zip(mine.tileable or [True] * n, theirs.tileable or [True] * n, strict=True))


def least_memory(problem: Problem, cache: SolveCache, time_limit: float, mip_gap: float, *,
                 heuristic_fit: bool = False) -> Partition | None:
    """The proven least-memory split of a memory-objective ``problem`` without its cap, by the exact
    DP over ideals (one stage per rank); None when that is not what ``solve`` gives. Where it fits
    the cap it is the capped problem's optimum too (every split the cap removes needs more), and
    where it does not, nothing fits: one solve where the capped one, its explanation and the
    uncapped one took three. ``heuristic_fit``: also return the anytime split of a graph too wide
    for the exact DP when it fits under the cap ([Note: uncapped heuristic split])."""
    if problem.mem_cap is None or not one_to_one(problem):
        return None
    try:
        part = solve(uncapped(problem), ilp=False, cache=cache, time_limit=time_limit, mip_gap=mip_gap)
    except InfeasibleError:
        return None
    if proven(part) and part.solver == "ideals":
        return part
    # [Note: uncapped heuristic split] The anytime split minimises the same bottleneck with or
    # without the cap, and the cap removes only splits above it: a heuristic split well under the
    # cap is what solving the capped problem again would search for, at twice the time (SwinUNETR,
    # UNet++, UNETR in bench_planner's Table 3).
    return part if heuristic_fit and part.bottleneck_mem * (1 + 1e-8) <= problem.mem_cap else None


def heuristic_over(problem: Problem, cache: SolveCache, time_limit: float, mip_gap: float) -> Partition | None:
    """The heuristic least-memory split of ``problem`` without its cap where it is over the cap,
    else None: a lever round takes such a candidate as not fitting without the screening MILP
    ([Note: search deadline])."""
    if problem.mem_cap is None:
        return None
    memory = problem if problem.objective == "memory" else dataclasses.replace(problem, objective="memory")
    try:
        part = solve(uncapped(memory), ilp=False, cache=cache, time_limit=time_limit, mip_gap=mip_gap)
    except InfeasibleError:
        return None
    return part if part.bottleneck_mem > problem.mem_cap * (1 + 1e-6) else None


def over_cap_proven(problem: Problem, cache: SolveCache, deadline: float, mip_gap: float) -> bool:
    """Whether ``problem``'s proven least peak memory exceeds its cap (False when unproven or
    past the deadline)."""
    cap = problem.mem_cap
    if cap is None or time.perf_counter() > deadline:
        return False
    memory = problem if problem.objective == "memory" else dataclasses.replace(problem, objective="memory")
    part = least_memory(memory, cache, max(0.5, deadline - time.perf_counter()), mip_gap)
    return part is not None and part.bottleneck_mem > cap * (1 + 1e-9)


def _group(c: Candidate) -> Candidate:
    return dataclasses.replace(c, tiles_per_gpu=1)


def ease(cand: Candidate) -> tuple[int, int, int, int]:
    """[Note: easy candidates first] The order candidates are bounded in: data parallel copies of
    one whole stage first (their split is the whole graph, found at once), then fewer stages,
    fewer tiles and no mirror. Under a time limit that ends the bounding, the candidates bounded
    are the ones that fit soonest, and the search goes on to solve them: it answers with the best
    of those and the number left untried, never with nothing tried while one of them fits."""
    return cand.stages, cand.parts, cand.replicas, cand.tiles_per_gpu


def bound_easiest_first(pool: list[Candidate], by_batch: CostsByBatch, balance: str, deadline: float
                        ) -> tuple[list[tuple[Candidate, Costs, Problem, Bounds]], int]:
    """Each candidate of ``pool`` with its costs, Problem and bounds, in :func:`ease`'s order, until
    ``deadline`` (after at least one); the candidates left unbounded ([Note: easy candidates first])."""
    entries: list[tuple[Candidate, Costs, Problem, Bounds]] = []
    for n, cand in enumerate(sorted(pool, key=ease)):
        if time.perf_counter() > deadline and entries:
            return entries, len(pool) - n
        cc, problem = candidate_problem(by_batch, cand, balance)
        try:
            entries.append((cand, cc, problem, candidate_bounds(cc, cand, problem, cand.micro_batch_size)))
        except InfeasibleError:  # pins and tileability allow no split
            continue
    return entries, 0
