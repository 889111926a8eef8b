"""The planner's entry point: coarsen, solve exactly where cheap (ideal DP), else the MILP.

Order of attack for one problem (one candidate configuration):

1. exact coarsening (``coarsen``: merges no optimum needs apart, but for stages of zero-cost
   nodes: [Note: empty stages], checked after the ideal DP);
2. if the graph has few ideals, the DP over ideals ([Note: ideal DP]): the exact
   lexicographic optimum over all convex splits when every rank holds one stage; with
   MASTER pairing exact for few ideals (``master_exact.pair_dp``), else the MASTER descent with a
   Lagrangian lower bound (status "feasible" with its gap). Done, no MILP: on these graphs
   HiGHS neither improved the descent's split nor its bound in 30 s (ResNet-140, K = 8);
3. otherwise the better of the DP over a beam of ideals with thin frontiers ([Note: ideal
   beam]) and the DP over one topological order (MASTER descent for paired ranks); with
   ``LOCAL_MIN_S`` or more for the MILP also the DP over a greedily coarsened graph ([Note:
   coarse ideal DP]); the better of the two starts, each walked downhill by the DP over the
   ideals near its cuts ([Note: local ideals], together at most ``LOCAL_SHARE`` of the time
   limit), is the MILP's start, bound and fallback (``ilp``).

``SolveCache`` keeps the lattice and pair matrices between the candidates of one search
(they share the graph and, for plain stages, the cost vectors).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from nowdl.errors import InfeasibleError
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.skip_waits import has_waits, without_waits
from nowdl.partitioner.costs.structure import (
    check_problem,
    make_partition,
    objective_values,
    one_to_one,
    stage_ranges,
)
from nowdl.partitioner.exact.coarse_check import solve_unmerged
from nowdl.partitioner.exact.coarse_dp import coarse_split
from nowdl.partitioner.exact.coarsen import coarsen as coarsen_problem
from nowdl.partitioner.exact.coarsen import compose_groups, expand
from nowdl.partitioner.exact.ideal_dp import (
    BEAM_CAP,
    IDEAL_CAP,
    Lattice,
    beam_ideals,
    bound_master,
    enumerate_ideals,
    solve_ideals,
)
from nowdl.partitioner.exact.local_search import improve_split
from nowdl.partitioner.exact.order_dp import solve_dp
from nowdl.partitioner.exact.sese import sese_split
from nowdl.partitioner.exact.wait_refine import refine_waits
from nowdl.partitioner.exact.wait_search import solve_waits
from nowdl.partitioner.milp.lp_bound import assignment_lower_bound
from nowdl.partitioner.milp.solve import solve_ilp

__all__ = ["solve", "SolveCache", "final_split", "proven", "with_lower_bound", "LOCAL_SHARE", "LOCAL_MIN_S",
           "ANYTIME_LOCAL_S"]

log = logging.getLogger(__name__)

LOCAL_SHARE = 0.25  # of a MILP-bound solve's time limit, at most, for the local search first
LOCAL_MIN_S = 8.0  # below this time limit the MILP gets it all (a round takes 1-2 s on 1,000 nodes)
ANYTIME_LOCAL_S = 1.0  # the anytime split's local search, at most, per start walked downhill
ANYTIME_PER_SIDE = 300  # ideals on each side of a cut for the winner's last walk
WAIT_SHARE = 0.5  # of the time limit, at most, for the anytime split's wait refinement
WAIT_MIN_S = 5.0  # below this time limit (plan()'s screening solves: 3 s) no wait refinement

# [Note: anytime split] Where the graph has too many ideals, screening (``ilp=False``) returns
# the best of three splits, each exact over a family the others miss: the beam of thin cuts
# (the DP over one topological order only where the beam has no split), the DP over the ideals
# with the single-exit regions contracted ([Note: SESE contraction]) and the DP over a greedily
# coarsened graph ([Note: coarse ideal DP]); the best two are walked downhill by the DP over the
# ideals near their cuts ([Note: local ideals]) for ANYTIME_LOCAL_S / 2 to ANYTIME_LOCAL_S each
# (by what the time limit leaves), then the better end point once more with ANYTIME_PER_SIDE
# ideals a side; where the long-skip waits raise it and the time limit is at least WAIT_MIN_S,
# the searches that charge them for up to WAIT_SHARE of it ([Note: wait refinement]; the
# configuration search gives its chosen split that refinement once instead: [Note: winner
# refinement]). The split returned without the MILP carries the assignment LP's bound ([Note:
# assignment LP bound]): status "feasible" and its gap, never "optimal" unless that bound proves
# it. On the MONAI nets of docs/models.md (SwinUNETR, UNETR at K = 4, 8; UNet++ at K = 4) this
# split was within 0.7% of HiGHS's split proven within 1%, UNet++ at K = 8 9% above it; the
# configuration search runs the MILP only when asked (``PlanRequest.milp``: an explicit time
# limit, or ``exact``).

@dataclass
class SolveCache:
    """Lattices (by graph) and ideal pair matrices shared between solves of one graph."""

    lattices: dict[tuple[object, ...], Lattice | None] = field(default_factory=dict)
    bases: dict[tuple[object, ...], object] = field(default_factory=dict)
    # splits by problem (see problem_key) and settings: candidates whose problems are equal (1F1B
    # with m >= K micro-batches holds min(m, K - s) on stage s for every such m) are solved once
    splits: dict[tuple[object, ...], tuple[Partition, bool]] = field(default_factory=dict)

    def lattice(self, problem: Problem, cap: int = IDEAL_CAP) -> Lattice | None:
        key = (problem.n, tuple(sorted(set(problem.edges))), cap)
        if key not in self.lattices:
            self.lattices[key] = enumerate_ideals(problem, cap)
        return self.lattices[key]

    def beam(self, problem: Problem, cap: int = BEAM_CAP) -> Lattice:
        """Some ideals (``beam_ideals``: about ``cap``) for a graph with too many."""
        key = ("beam", problem.n, tuple(sorted(set(problem.edges))), cap,
               tuple(tuple(v.out) for _, v in sorted(problem.variants.items())))
        lat = self.lattices.get(key)
        if lat is None:
            lat = self.lattices[key] = beam_ideals(problem, cap)
        return lat


def problem_key(problem: Problem) -> tuple[object, ...]:
    """Everything the solvers read from a problem, as a hashable value.

    The first stage receives nothing and the last sends nothing, so their receive and send
    factors do not matter (1F1B's first stage posts more receives with more micro-batches)."""
    stages = list(problem.stages)
    stages[0] = dataclasses.replace(stages[0], recv_held=0.0)
    stages[-1] = dataclasses.replace(stages[-1], send_held=0.0)
    variants = tuple(sorted((name, tuple(v.act), tuple(v.time), tuple(v.workspace), tuple(v.out))
                            for name, v in problem.variants.items()))
    return (tuple(problem.names), tuple(problem.edges), tuple(problem.static), variants,
            tuple(stages), tuple(problem.tileable), tuple(tuple(r) for r in problem.ranks),
            problem.objective, problem.mem_cap, tuple(sorted(problem.pinned.items())),
            tuple(tuple(t) for t in problem.tied))


def proven(part: Partition) -> bool:
    """The split is the proven optimum over all convex splits: status "optimal" from the DP
    over ideals or the MILP ("optimal" from the DP over one order only counts for K = 1)."""
    if part.status != "optimal":
        return False
    return not part.solver.startswith("dp") or max(part.stage_of, default=0) == 0


def final_split(part: Partition) -> bool:
    """A split the MILP would not improve: proven optimal, or from the DP over ideals (the
    MASTER descent, whose split and Lagrangian bound HiGHS did not beat in 30 s on
    ResNet-140 at K = 8)."""
    return proven(part) or part.solver == "ideals"


def _best(problem: Problem, parts: list[Partition | None]) -> Partition | None:
    """The lexicographically best of some splits (None entries: nothing found)."""
    found = [p for p in parts if p is not None]
    if not found:
        return None
    cap = problem.mem_cap
    fits = [p for p in found if cap is None or p.bottleneck_mem <= cap * (1 + 1e-9)] or found
    return min(fits, key=lambda p: objective_values(problem, p))


def _gib(x: float) -> str:
    return f"{x:.6g} bytes ({x / 2**30:.3f} GiB)"


def _ideal_cap_message(problem: Problem, lat: Lattice, cache: SolveCache) -> str:
    relaxed = dataclasses.replace(problem, objective="memory", mem_cap=None)
    best = solve_ideals(relaxed, lat, bases=cache.bases)
    cap = float(problem.mem_cap or 0.0)
    config = f"{problem.n} nodes in {problem.k} stages on {len(problem.rank_stages())} GPUs"
    if best is None:  # pragma: no cover - pins/tileability were checked before
        return f"No partition keeps every GPU within the memory cap of {_gib(cap)} ({config})."
    need = best.bottleneck_mem
    return (
        f"No partition keeps every GPU within the memory cap of {_gib(cap)} ({config}): the "
        f"smallest achievable largest per-GPU memory for this configuration is {_gib(need)} "
        f"(proven optimal). Raise mem_cap to at least {_gib(need)}, or use more GPUs/stages so "
        "each holds less."
    )


def solve(
    problem: Problem,
    *,
    time_limit: float = 30.0,
    solver: str = "auto",
    coarsen: bool = True,
    max_nodes: int | None = None,
    threads: int = 1,
    ilp: bool = True,
    cache: SolveCache | None = None,
    start: Partition | None = None,
    mip_gap: float = 1e-6,
) -> Partition:
    """Partition a problem's DAG into pipeline stages: what the rest of nowdl calls.

    Exact coarsening (see ``coarsen``); then the exact DP over ideals when the graph has
    few of them and every rank holds one stage (where long-skip gradient waits raise its split,
    the search over chains of ideals of [Note: wait search], with ``ilp``); otherwise the MILP,
    started from the best heuristic split (which is also its fallback); then the assignment mapped back and
    re-evaluated on the original problem. Every path applies the lexicographic levels of
    [Note: lexicographic levels] (primary, secondary, spread of the work).

    Example:
        >>> part = solve(problem, time_limit=10)
        >>> part.stage_of, part.status, part.bottleneck_mem

    Args:
        problem: the problem.
        time_limit: seconds for the local search and the MILP (model building and solves).
        solver: "auto" (HiGHS, else CBC), "highs" or "cbc".
        coarsen: merge nodes first where that provably loses nothing.
        max_nodes: if given, also merge greedily down to this many nodes (faster, not
            exact: an optimal status then reads "coarse-optimal").
        threads: solver threads (1 is deterministic).
        ilp: False stops at the heuristic split where no exact DP applies (screening).
        cache: lattices and pair matrices to share with other solves of the same graph.
        start: a known split of ``problem`` (from ``ilp=False``, say): the MILP starts from it
            instead of recomputing a heuristic one.
        mip_gap: the MILP stops once proven within this relative gap (status "optimal", the
            gap reached in ``gap``); the exact DP is exact whatever it is.

    Returns:
        The Partition of the original problem, evaluated with ``evaluate()``; solver
        "ideals" (exact DP over ideals), "ideals+waits" (that DP's split with the waits: proven
        by the chain search, or "feasible" with the DP's bound when screening), "beam", "dp",
        "highs" or "cbc".

    Raises:
        ValueError: if the problem or an argument is malformed.
        InfeasibleError: if no placement respects pins/tileability or fits ``mem_cap``.
    """
    t0 = time.perf_counter()
    check_problem(problem)
    if not time_limit > 0:
        raise ValueError(f"time_limit must be > 0 seconds (got {time_limit})")
    stage_ranges(problem)  # structural infeasibility raises here, naming the node
    cache = cache if cache is not None else SolveCache()
    key = (problem_key(problem), solver, coarsen, max_nodes, mip_gap)
    done = cache.splits.get(key)
    if done is not None and (done[1] or not ilp or proven(done[0])):
        log.info("solve: the same problem was solved before (%s %s)", done[0].solver, done[0].status)
        return dataclasses.replace(done[0], seconds=time.perf_counter() - t0)
    part = _solve(problem, time_limit=time_limit, solver=solver, coarsen=coarsen, max_nodes=max_nodes,
                  threads=threads, ilp=ilp, cache=cache, start=start, mip_gap=mip_gap)
    cache.splits[key] = (part, ilp)
    part = dataclasses.replace(part, seconds=time.perf_counter() - t0)
    log.info(
        "solve: %s %s (gap %.3g) in %.2f s: max rank memory %.4g GiB, max rank time %.4g s",
        part.solver, part.status, part.gap, part.seconds, part.bottleneck_mem / 2**30,
        part.bottleneck_time,
    )
    return part


def _check_waits(problem: Problem, part: Partition, mip_gap: float) -> tuple[Partition, float | None]:
    """The exact DP over ideals optimises ``problem`` without its long-skip gradient waits
    (a stage's cost there is a function of its two cuts: [Note: long-skip gradient waits]).
    Its split is still optimal when the waits leave its primary bottleneck unchanged (or within
    ``mip_gap``, the MILP's own stop, reported as the gap); else it
    is a start for the MILP, which charges them, and its value without them a lower bound.
    Returns the split (solver "ideals+waits", status "feasible" with that gap, when the waits
    matter) and the bound (None when they do not)."""
    plain = without_waits(problem)
    lower, _ = objective_values(plain, make_partition(plain, part.stage_of))
    value, _ = objective_values(problem, part)
    if value <= lower * (1 + max(mip_gap, 1e-9)):  # within the MILP's own stopping gap
        return dataclasses.replace(part, solver="ideals", status="optimal", gap=max(0.0, 1 - lower / value)), None
    log.info("solve: long-skip gradient waits raise the ideals split's bottleneck %.6g -> %.6g", lower, value)
    return dataclasses.replace(part, solver="ideals+waits", status="feasible",
                               gap=max(0.0, 1 - lower / value)), lower


def with_lower_bound(problem: Problem, part: Partition) -> Partition:
    """A heuristic split with the assignment LP's lower bound ([Note: assignment LP bound]):
    status "feasible" and its gap, "optimal" when the bound meets the split's value."""
    value, _ = objective_values(problem, part)
    try:
        lower = assignment_lower_bound(problem)
    except Exception:  # pragma: no cover - HiGHS missing or failing: no bound to report
        log.info("solve: no LP bound for the heuristic split", exc_info=True)
        return part
    gap = max(0.0, 1 - lower / value) if value > 0 else 0.0
    return dataclasses.replace(part, status="optimal" if gap <= 1e-9 else "feasible", gap=gap)


def _anytime(work: Problem, known: Partition | None, time_limit: float) -> Partition | None:
    """[Note: anytime split]: the best of the beam/order split ``known`` and the contracted
    and coarsened ideal DPs, the best two walked downhill."""
    t0 = time.perf_counter()
    found = [p for p in (known, sese_split(work), coarse_split(work)) if p is not None]
    if not found:
        return known
    cap = work.mem_cap
    found.sort(key=lambda p: (cap is not None and p.bottleneck_mem > cap * (1 + 1e-9),
                              objective_values(work, p)))
    # each walk gets its own second, whatever the DPs before took (a round is about 0.4 s of
    # CPU on AmoebaNet-D's 1,095 nodes): without it the coarse DP's start stays 3% higher there
    share = max(ANYTIME_LOCAL_S / 2, min(ANYTIME_LOCAL_S, time_limit / 8 - (time.perf_counter() - t0) / 2))
    walked: list[Partition | None] = [improve_split(work, p, budget_s=share) for p in found[:2]]
    best = _best(work, walked + list(found))
    # then the winner in a wider neighbourhood (UNETR K = 4: 150 ideals a side stop 1.8% above
    # HiGHS's split proven within 1%, 300 reach it in 0.9 s of CPU)
    best = best if best is None else improve_split(work, best, budget_s=share, per_side=ANYTIME_PER_SIDE)
    # then, where the long-skip waits raise it, the searches that charge them ([Note: wait refinement])
    return best if best is None or time_limit < WAIT_MIN_S else refine_waits(work, best, budget_s=WAIT_SHARE * time_limit)


def _solve(problem: Problem, *, time_limit: float, solver: str, coarsen: bool, max_nodes: int | None,
           threads: int, ilp: bool, cache: SolveCache, start: Partition | None, mip_gap: float) -> Partition:
    """``solve`` without the memo (its arguments, checked)."""
    t0 = time.perf_counter()
    if problem.k == 1:  # one stage holds everything: nothing to choose
        part = make_partition(problem, [0] * problem.n, solver="single-stage", status="optimal")
        if problem.mem_cap is not None and part.bottleneck_mem > problem.mem_cap * (1 + 1e-9):
            raise InfeasibleError(
                f"No partition keeps every GPU within the memory cap of {_gib(problem.mem_cap)} "
                f"(1 stage): the one stage needs {_gib(part.bottleneck_mem)}. Raise mem_cap to at "
                "least that, or use more GPUs/stages so each holds less.")
        return dataclasses.replace(part, seconds=time.perf_counter() - t0)
    work, groups, exact = problem, [[v] for v in range(problem.n)], True
    if coarsen:
        work, groups = coarsen_problem(problem)
        if work.n < problem.k:  # merging would leave a stage empty (a few zero-cost nodes): solve as is
            work, groups = problem, [[v] for v in range(problem.n)]
    if max_nodes is not None and work.n > max_nodes:
        small, inner = coarsen_problem(work, max_nodes=max_nodes)
        if small.n < work.n:
            groups = compose_groups(groups, inner)
            work, exact = small, False
    if work.n < problem.n:
        log.info("solve: %d nodes -> %d (%s)", problem.n, work.n,
                 "exact merges" if exact else "greedy merges: not exact")
    known: Partition | None = None
    lat_none = False
    if start is not None:  # the same coarsening: every group sits in one stage
        known = make_partition(work, [start.stage_of[g[0]] for g in groups], solver=start.solver,
                               status=start.status)
    else:
        lat = cache.lattice(work)
        if lat is not None:
            known = solve_ideals(work, lat, bases=cache.bases)
            if exact and work.n < problem.n and solve_unmerged(work, lat, known, lambda: cache.lattice(problem),
                                                                bases=cache.bases):
                log.info("solve: the coarse split is not proven for the whole graph ([Note: empty stages])")
                return _solve(problem, time_limit=time_limit, solver=solver, coarsen=False, max_nodes=max_nodes,
                              threads=threads, ilp=ilp, cache=cache, start=None, mip_gap=mip_gap)
            if known is None and one_to_one(work):
                raise InfeasibleError(_ideal_cap_message(work, lat, cache))
        else:  # too many ideals: the best of a beam of thin cuts and one topological order
            beam = solve_ideals(work, cache.beam(work), bases=cache.bases)
            order: Partition | None = None
            try:  # the anytime split starts from the beam's where there is one ([Note: anytime split])
                order = solve_dp(work, explain=False) if beam is None or ilp else None
            except InfeasibleError:
                if beam is None and not ilp:  # screening: the caller explains a failure
                    raise
            known, lat_none = _best(work, [beam, order]), True
            if not ilp:  # screening, the anytime split: [Note: anytime split]
                known = _anytime(work, known, time_limit)
    if known is not None and ilp and known.solver == "ideals" and known.status == "heuristic":
        lat = cache.lattice(work)
        if lat is not None:
            known = bound_master(work, lat, known, bases=cache.bases)
    waits_lb = None
    # the DP's split (or a screened one, "ideals+waits" not yet proven): are the waits charged?
    dp_split = known is not None and (known.solver == "ideals" or (known.solver == "ideals+waits"
                                                                   and known.status != "optimal"))
    if known is not None and dp_split and one_to_one(work) and has_waits(work):
        known, waits_lb = _check_waits(work, known, mip_gap)
        # screening (ilp=False) keeps the DP's split and bound: the search decides which
        # candidates are worth this
        lat = cache.lattice(work) if waits_lb is not None and ilp else None
        charged = (solve_waits(work, lat, known, gap=mip_gap, bases=cache.bases, time_limit=time_limit / 3)
                   if lat is not None else None)  # the MILP keeps the rest of the time
        if charged is not None:  # the waits charged exactly by a search over the chains of ideals
            log.info("solve: the chains of ideals with their waits: %.6g in %.2f s", charged.bottleneck_mem
                     if work.objective == "memory" else charged.bottleneck_time, charged.seconds)
            known, waits_lb = charged, None
        elif lat is not None:
            log.info("solve: the search over the chains of ideals ran out of its budget: the MILP decides")
    if known is not None and (final_split(known) or not ilp):
        part = known
        if part.status == "heuristic" and not ilp and lat_none:
            part = with_lower_bound(work, part)
    else:
        # a better start also narrows the MILP (not needed after the exact DP: its split is
        # optimal but for the waits, and the MILP closes that in about a second on a UNet)
        if known is not None and time_limit >= LOCAL_MIN_S and waits_lb is None:
            t1 = time.perf_counter()
            # each start walked downhill (AmoebaNet-D, compute: the coarse DP's start is worse
            # than the beam's, 15.14 against 15.09 ms, but walks to 14.81 where the beam's
            # stops at 14.87)
            starts = [known] + [c for c in [coarse_split(work)] if c is not None]
            share = LOCAL_SHARE * time_limit / len(starts)
            known = _best(work, [improve_split(work, st, budget_s=share) for st in starts]) or known
            time_limit = max(0.05, time_limit - (time.perf_counter() - t1))
        part = solve_ilp(work, time_limit=time_limit, solver=solver, threads=threads, start=known,
                         explain=ilp, mip_gap=mip_gap)  # screening (ilp=False): the caller explains a failure
        if waits_lb is not None and part.status == "feasible":  # the DP's optimum bounds it too
            value, _ = objective_values(work, part)
            part = dataclasses.replace(part, gap=min(part.gap, max(0.0, 1 - waits_lb / value)))
    if work is not problem:
        part = expand(part, groups, problem, exact=exact)
    return part
