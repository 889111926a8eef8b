"""Shorter recompute: a stage the lever rounds recompute or offload recomputes only a prefix of
its nodes where that fits the cap and adds less time.

[Note: shorter recompute] Once [Note: choosing levers] (search/levers.py) has fitted a candidate
under the memory cap, each stage that "auto" gave a lever (not one the user forced; not spatial,
not sequential tiles, holding more than one micro-batch) is looked at again on the same split:
among recomputing a prefix of its nodes of every length n ([Note: recompute segments] in
costs/segments.py), the whole stage, and host offload, it takes the one that fits with the least
added time. A prefix's added time is its nodes' forward time (``recompute_vectors``), which
grows with n, and its peak ``inflight x kept + prefix`` shrinks with n, so the shortest prefix
that fits is the one to take: it is found by bisection, among the prefixes that add less time
than the stage's present lever (the whole stage's forward, or the offload's exposed copies), on
the whole candidate's rank peaks (MASTER: a rank holds two stages), and the split is then kept
(no MILP moves it). A stage where no such prefix
fits keeps its lever, so a plan where the whole stage or no lever was the best choice does not
change. The stages are taken in order, each on the candidate the one before left. Candidates
with ``recompute`` other than "auto" are left as they are ("on" and a list recompute whole
stages).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol, TypeVar

from nowdl.partitioner.config.candidate import Candidate, PlanRequest
from nowdl.partitioner.config.lever_options import forced_stages
from nowdl.partitioner.costs.costmodel import Costs, predict_step, stage_sums
from nowdl.partitioner.costs.levers import offload_time_s, recompute_vectors
from nowdl.partitioner.costs.no_idle import idle_stages
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.structure import make_partition
from nowdl.partitioner.search.batch_split import CostsByBatch
from nowdl.partitioner.search.bounds import Bounds, candidate_bounds
from nowdl.partitioner.search.candidate_problem import candidate_problem
from nowdl.partitioner.search.levers import host_fits

__all__ = ["shorten_recompute", "prefix_times"]

_REL = 1e-6


class Evaluated(Protocol):
    """What this module reads and replaces of a solved candidate (``best_plan._Eval``)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    cand: Candidate
    problem: Problem
    part: Partition
    bounds: Bounds
    fits: bool


E = TypeVar("E", bound=Evaluated)


def prefix_times(costs: Costs, problem: Problem, stage_nodes: list[int], inflight: int) -> list[float]:
    """``out[n]``: seconds per micro-batch that recomputing the first n of ``stage_nodes`` adds."""
    plain = problem.variants["plain"]
    whole = recompute_vectors(costs.profile, plain, inflight)
    out = [0.0]
    for v in stage_nodes:
        out.append(out[-1] + whole.time[v] - plain.time[v])
    return out


def _at_split(by_batch: CostsByBatch, req: PlanRequest, ev: E, cand: Candidate) -> E:
    """``ev`` with ``cand``'s levers on ``ev``'s split (evaluated, not solved again)."""
    costs, problem = candidate_problem(by_batch, cand, req.balance)
    old = ev.part
    part = make_partition(problem, old.stage_of, solver=old.solver, status=old.status, gap=old.gap,
                          seconds=old.seconds)
    fits = (costs.mem_cap is None or part.bottleneck_mem <= costs.mem_cap * (1 + _REL)) and host_fits(
        costs, cand, part.stage_of)
    # final: the MILP does not move this split (a prefix is cut at a node index, which a moved
    # boundary could leave empty)
    return dataclasses.replace(ev, cand=cand, costs=costs, problem=problem, part=part, fits=fits, exact=False, final=True,
                               bounds=candidate_bounds(costs, cand, problem, cand.micro_batch_size),
                               pred=predict_step(costs, cand, part, cand.micro_batch_size),
                               idle=bool(idle_stages(problem, part.stage_of)))


def shorten_recompute(by_batch: CostsByBatch, req: PlanRequest, ev: E) -> E:
    """[Note: shorter recompute] ``ev`` (a fitted candidate) with each lever "auto" gave turned
    into the shortest recomputed prefix that fits and adds less time; ``ev`` where none does."""
    cand = ev.cand
    costs = by_batch(cand.micro_batch_size)
    if (not ev.fits or costs.mem_cap is None or req.recompute != "auto" or cand.tiles_per_gpu > 1
            or cand.schedule == "zb" or not (cand.recompute or cand.offload)):
        return ev
    k, parts, inflight = cand.stages, cand.stage_parts(), cand.inflight()
    forced = set(forced_stages(req.recompute, k)) | set(forced_stages(req.offload, k))
    best = ev
    for s in sorted((set(cand.recompute) | set(cand.offload)) - forced):
        if parts[s] > 1 or inflight[s] <= 1:
            continue
        c = best.cand
        nodes = [v for v, t in enumerate(best.part.stage_of) if t == s]
        times = prefix_times(costs, best.problem, nodes, inflight[s])
        if s in c.recompute:
            now = times[-1]
        else:
            now = offload_time_s(c, stage_sums(costs, c, best.part.stage_of), costs.host_link_bw)[s]
        cheaper = [n for n in range(1, len(nodes)) if times[n] < now * (1 - 1e-9)]

        def trial(n: int, c: Candidate = c, nodes: list[int] = nodes, s: int = s, base: E = best) -> E:
            segs = tuple(sorted({**dict(c.segments), s: nodes[n]}.items()))
            return _at_split(by_batch, req, base, dataclasses.replace(
                c, recompute=tuple(sorted({*c.recompute, s})), offload=tuple(x for x in c.offload if x != s),
                segments=segs))

        if not cheaper:
            continue
        top = trial(cheaper[-1])
        if not top.fits:
            continue
        lo, hi, found = 0, len(cheaper) - 1, top  # cheaper[hi] fits; find the shortest that does
        while lo < hi:
            mid = (lo + hi) // 2
            got = trial(cheaper[mid])
            if got.fits:
                hi, found = mid, got
            else:
                lo = mid + 1
        best = found
    return best
