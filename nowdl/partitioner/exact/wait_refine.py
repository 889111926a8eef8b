"""The anytime split's last step where long-skip gradient waits raise its bottleneck.

[Note: wait refinement] The heuristics of [Note: anytime split] (the beam, the contracted and
coarse ideal DPs, the local walks) price a stage by its two cuts, so they optimise the problem
without its long-skip gradient waits ([Note: long-skip gradient waits]) and are judged with
them. Where the waits raise the best split's primary value (by more than ``WAIT_MATTERS``),
two searches that charge them follow, as search 1, 2, 1 again, within ``budget_s``:

1. the search over chains of ideals with the waits ([Note: wait search]) on the graph
   coarsened *around the split*: a group is only merged into its single consumer group of the
   same stage, lightest pairs first (so the split stays a chain of the coarse graph's ideals,
   the search's incumbent, and every cut keeps its fine neighbourhood), the most groups whose
   coarse graph has at most ``FOCUS_CAP`` ideals (binary search); level 1 within ``WAIT_GAP``
   of its bound: the optimum *with the waits* over the splits that keep every group whole;
2. the window refinement of its split ([Note: window refinement]): each cut moved anywhere
   between its neighbours, every candidate scored with the waits by a batched ``evaluate()``.

Each search starts where the previous ended (the window finds cuts the coarse graph hides, and
the second coarse search moves several cuts at once where the window moves one). Each split is
judged on the whole problem and kept only when better, so the result is never worse than the
split it started from. On AmoebaNet-D (1024², K = 8, memory) the three take the anytime split
from 1.031x to 1.010x of the proven optimum (1.025x, 1.018x, 1.010x) for 4-8 s more CPU
(docs/benchmarks.md, Table 3). A heuristic: the caller reports its
gap against the assignment LP's bound.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import time

from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.skip_waits import has_waits, without_waits
from nowdl.partitioner.costs.structure import make_partition, objective_values, one_to_one
from nowdl.partitioner.exact.coarse_dp import densest_lattice
from nowdl.partitioner.exact.coarse_groups import expand
from nowdl.partitioner.exact.coarsen import coarsen, merge_start
from nowdl.partitioner.exact.downsets import Lattice
from nowdl.partitioner.exact.wait_search import solve_waits
from nowdl.partitioner.exact.window_dp import refine_cuts

__all__ = ["refine_waits", "refine_winner", "waits_matter", "split_coarsening", "FOCUS_CAP", "WAIT_GAP", "WAIT_MATTERS"]

log = logging.getLogger(__name__)

FOCUS_CAP = 1800  # ideals of the coarse graph searched with its waits (AmoebaNet-D: about 150 groups, 1-2 s)
WAIT_GAP = 0.002  # level 1 of that search stops within this of its bound
WAIT_MATTERS = 1e-3  # the waits must raise the split's primary value by more than this share


def waits_matter(problem: Problem, part: Partition) -> bool:
    """Whether the long-skip waits raise ``part``'s primary value by more than ``WAIT_MATTERS``."""
    if not has_waits(problem):
        return False
    plain = without_waits(problem)
    lower = objective_values(plain, make_partition(plain, part.stage_of))[0]
    return objective_values(problem, part)[0] > lower * (1 + WAIT_MATTERS)


def _key(problem: Problem, part: Partition) -> tuple[bool, tuple[float, ...]]:
    cap = problem.mem_cap
    return (cap is not None and part.bottleneck_mem > cap * (1 + 1e-9), objective_values(problem, part))


def split_coarsening(problem: Problem, stage_of: list[int], max_nodes: int) -> tuple[Problem, list[list[int]]]:
    """Merge each group into its single consumer group of the same stage of ``stage_of``,
    lightest pairs first (never past half a stage), down to ``max_nodes`` groups or until no such
    link is left. Returns the coarse problem and its groups (original indices)."""
    g, loads, tot_mem, tot_time = merge_start(problem)
    limit = 1.0 / (2 * problem.k)
    heap: list[tuple[float, int, int, int, int]] = []

    def push(u: int) -> None:
        if not g.alive[u] or len(g.succs[u]) != 1:
            return
        c = next(iter(g.succs[u]))
        if stage_of[g.exit[u]] != stage_of[g.exit[c]] or not g.compatible(u, c):
            return
        (mu, tu), (mc, tc) = g.load(u), g.load(c)
        w = max((mu + mc) / tot_mem, (tu + tc) / tot_time)
        if w <= limit:
            heapq.heappush(heap, (w, u, c, g.version[u], g.version[c]))

    for u in range(problem.n):
        push(u)
    count = problem.n
    while count > max_nodes and heap:
        _, u, c, vu, vc = heapq.heappop(heap)
        if vu != g.version[u] or vc != g.version[c] or not g.alive[u]:
            continue
        g.merge(c, u, g.exit[c])
        count -= 1
        push(c)
        for q in sorted(g.preds[c]):
            push(q)
    return g.build()


def _lattice(problem: Problem, stage_of: list[int], cap: int) -> tuple[Problem, list[list[int]], Lattice] | None:
    """The coarsening around ``stage_of`` with the most groups and at most ``cap`` ideals."""
    return densest_lattice(lambda m: split_coarsening(problem, stage_of, m), max(8, 2 * problem.k), problem.n, cap)


def _focus(problem: Problem, part: Partition, time_limit: float) -> Partition | None:
    """Step 1 of [Note: wait refinement] around ``part``: the coarse optimum with its waits,
    mapped back (solver "focus"); None when no coarsening has few enough ideals or the search
    ran out of ``time_limit``."""
    found = _lattice(problem, part.stage_of, FOCUS_CAP)
    if found is None:
        return None
    small, groups, lat = found
    start = make_partition(small, [part.stage_of[grp[0]] for grp in groups])
    got = solve_waits(small, lat, start, gap=WAIT_GAP, time_limit=time_limit, exact_first=False)
    if got is None:
        return None
    stage_of = expand(got, groups, problem, exact=False).stage_of
    return make_partition(problem, stage_of, solver=part.solver.split("+")[0] + "+focus", status="heuristic",
                          gap=math.nan)


def refine_waits(problem: Problem, part: Partition, *, budget_s: float) -> Partition:
    """``part`` improved by the searches of [Note: wait refinement] that charge the long-skip
    waits, for about ``budget_s`` seconds; ``part`` itself when the waits do not raise its
    primary value, nothing improves, or the ranks hold two stages each (MASTER)."""
    if not one_to_one(problem) or problem.k < 3 or budget_s <= 0 or not waits_matter(problem, part):
        return part
    t0 = time.perf_counter()
    best, steps = part, 0

    def left() -> float:
        return budget_s - (time.perf_counter() - t0)

    for step in ("focus", "window", "focus"):
        if left() <= 0:
            break
        steps += 1
        if step == "window":
            best = refine_cuts(problem, best, budget_s=left())
            continue
        got = _focus(problem, best, left())
        if got is not None and _key(problem, got) < _key(problem, best):
            best = got
    log.info("wait refinement: %.6g -> %.6g in %d step(s), %.2f s", objective_values(problem, part)[0],
             objective_values(problem, best)[0], steps, time.perf_counter() - t0)
    return best if _key(problem, best) < _key(problem, part) else part


def refine_winner(problem: Problem, part: Partition, *, budget_s: float) -> Partition | None:
    """``refine_waits`` for a search's chosen split: on ``problem`` merged where no optimum
    needs nodes apart (``coarsen``, when ``part`` keeps each merged group in one stage), mapped
    back. None when the waits do not raise it or nothing improves; else status "feasible" with
    its gap to the bound ``part`` reported ("heuristic" when it had none)."""
    if budget_s <= 0 or not one_to_one(problem) or problem.k < 3 or not waits_matter(problem, part):
        return None
    work, groups = coarsen(problem, warn=False)
    if work.n < problem.k or any(len({part.stage_of[v] for v in g}) > 1 for g in groups):
        work, groups = problem, [[v] for v in range(problem.n)]
    start = make_partition(work, [part.stage_of[g[0]] for g in groups], solver=part.solver, status=part.status,
                           gap=part.gap)
    got = refine_waits(work, start, budget_s=budget_s)
    full = expand(got, groups, problem)
    old, new = objective_values(problem, part)[0], objective_values(problem, full)[0]
    if got is start or not new < old:
        return None
    lower = old * (1 - part.gap) if math.isfinite(part.gap) else math.nan
    gap = max(0.0, 1 - lower / new) if math.isfinite(lower) and new > 0 else math.nan
    return dataclasses.replace(full, status="heuristic" if math.isnan(gap) else "feasible", gap=gap)
