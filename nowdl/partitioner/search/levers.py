"""Which stages of a candidate recompute or offload: what the user forces, and what "auto" adds.

[Note: choosing levers] The objective stays the search's: the highest predicted throughput
under the memory cap (balance "memory" or "compute" only changes how each candidate is split).
A candidate first gets the stages the user forces ("on" or a list, [Note: lever settings] in
config/lever_options.py) and is solved. Where it does not fit and a setting is "auto", every
stage on a rank over the cap takes a lever, the one that adds less time by the current split's
figures: recomputation (its forward again, [Note: recompute cost] in costs/levers.py) where
the stage holds more than one micro-batch, or host offload (the exposed copy time, [Note: host
offload]) where the spec has host memory left for it; a stage that still does not fit after
recomputation is offloaded instead. The candidate is solved again with those levers (the split
may move), at most ``2 x K`` rounds, until it fits or no over-cap stage has a lever left. A
candidate that fits without levers never gets one, with either balance: levers only buy memory.
Before any solve, a candidate is dropped when even its leanest lever choice cannot fit
(``floor_candidate``: every free stage offloaded where "auto" offload has host memory, else
recomputed), so levers never make the search skip what it skipped before. Lever rounds start
only within the first ``LEVER_SHARE`` of the search's time limit (the candidates are taken best
throughput bound first), so a search with levers keeps to its limit about as well as one
without.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from nowdl.errors import NowdlError
from nowdl.partitioner.config.candidate import Candidate, PlanRequest
from nowdl.partitioner.config.lever_options import LeverSetting, forced_stages
from nowdl.partitioner.costs.costmodel import Costs, build_problem, stage_sums
from nowdl.partitioner.costs.levers import host_bytes, offload_time_s
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.milp.lp_bound import memory_floor
from nowdl.partitioner.search.bounds import candidate_bounds
from nowdl.plan.plan import format_bytes

__all__ = ["LEVER_SHARE", "with_forced", "floor_candidate", "floors_over", "fit_with_levers", "host_fits", "host_message", "check_offload_possible"]

_REL = 1e-6
LEVER_SHARE = 0.75  # of the search's time limit: no new lever round starts after it


class Solved(Protocol):
    """What the lever loop reads of a solved candidate (``best_plan._Eval``)."""

    cand: Candidate
    problem: Problem
    part: Partition
    fits: bool


def check_offload_possible(costs: Costs, req: PlanRequest) -> None:
    """Refuse a forced offload when the device spec has no host memory to offload to.

    Raises:
        NowdlError: ``req.offload`` is "on" or a list and ``costs.host_memory`` or
            ``costs.host_link_bw`` is None.
    """
    if req.offload not in ("auto", "off") and not (costs.host_memory and costs.host_link_bw):
        raise NowdlError(f"offload={_show(req.offload)} needs host memory, but the device spec has none (host_memory "
                         "0 or absent, no host_link_bw, or a CPU spec): pass offload='off' (--offload off) and "
                         "recompute='auto', or add \"host_memory\" (bytes per node) and \"host_link_bw\" (bytes/s) to "
                         "the spec JSON, or use a built-in GPU spec (h100: 2 TiB per 8 GPUs)")


def with_forced(req: PlanRequest, cand: Candidate) -> Candidate | None:
    """``cand`` with the stages the user forces to recompute or offload; None when a forced
    stage index does not exist in it (K too small) or the schedule is zero bubble."""
    rc = forced_stages(req.recompute, cand.stages)
    off = forced_stages(req.offload, cand.stages)
    for setting, got in ((req.recompute, rc), (req.offload, off)):
        if isinstance(setting, tuple) and len(got) < len(setting):
            return None
    if (rc or off) and cand.schedule == "zb":
        return None  # the deferred weight gradients are not modelled with levers
    return dataclasses.replace(cand, recompute=rc, offload=off) if rc or off else cand


def _free(req: PlanRequest, cand: Candidate) -> list[int]:
    """Stages "auto" may still give a lever to."""
    if cand.schedule == "zb" or "auto" not in (req.recompute, req.offload):
        return []
    return [s for s in range(cand.stages) if s not in cand.recompute and s not in cand.offload]


def floor_candidate(costs: Costs, req: PlanRequest, cand: Candidate) -> Candidate:
    """``cand`` with every free stage on its leanest lever, for the memory floor before solving
    (offload where "auto" offload has host memory, else recompute where "auto"): a lower bound
    only (the host limit and the copies' time are not looked at)."""
    free = _free(req, cand)
    if not free:
        return cand
    if req.offload == "auto" and costs.host_memory:
        return dataclasses.replace(cand, offload=tuple(sorted({*cand.offload, *free})))
    if req.recompute == "auto":
        return dataclasses.replace(cand, recompute=tuple(sorted({*cand.recompute, *free})))
    return cand


def floors_over(costs: Costs, req: PlanRequest, cand: Candidate, problem: Problem, mem_lb: float,
                batch: int) -> tuple[bool, bool]:
    """(no lever choice can fit ``cand`` under the cap, ``cand`` cannot fit without the levers
    "auto" may add), by the memory floor (``milp.lp_bound.memory_floor``) of ``problem`` and of
    :func:`floor_candidate`'s problem. Needs ``costs.mem_cap``."""
    cap = (costs.mem_cap or 0.0) * (1 + 1e-9)
    memory = problem if problem.objective == "memory" else dataclasses.replace(problem, objective="memory")
    if memory_floor(memory, cap, mem_lb) <= cap:
        return False, False
    lean = floor_candidate(costs, req, cand)
    if lean == cand:
        return True, True
    lean_p = build_problem(costs, lean, "memory")
    return memory_floor(lean_p, cap, candidate_bounds(costs, lean, lean_p, batch).mem_lb) > cap, True


def host_fits(costs: Costs, cand: Candidate, stage_of: list[int]) -> bool:
    """Whether every rank's offloaded activations fit its share of host memory."""
    if not cand.offload:
        return True
    limit = costs.host_memory or 0.0
    return max(host_bytes(cand, stage_sums(costs, cand, stage_of))) <= limit * (1 + _REL)


def host_message(costs: Costs, req: PlanRequest, cand: Candidate, stage_of: list[int]) -> str:
    """Why ``cand``'s offloaded activations do not fit host memory: the constraint, the figures and
    the smallest fixes first."""
    need = max(host_bytes(cand, stage_sums(costs, cand, stage_of)))
    share = costs.host_memory or 0.0
    fixes = [f"give the spec a host_memory at least {need / share:.2f}x its present one" if share > 0
             else "give the spec a host_memory", "use more GPUs (each then holds fewer activations)"]
    if req.recompute != "off" and any(cand.inflight()[s] > 1 for s in cand.offload):
        fixes.append("recompute the stages that hold several micro-batches instead (recompute='auto')")
    if req.offload not in ("auto", "off"):
        fixes.append("offload fewer stages (a shorter offload list)")
    return (f"host memory: offloading the saved activations of stage(s) {list(cand.offload)} needs "
            f"{format_bytes(need)} of host memory per GPU, more than the {format_bytes(share)} per GPU the device "
            f"spec leaves for offload (80% of its host_memory shared by the node's GPUs; offload={_show(req.offload)}): "
            + ", or ".join(fixes))


def _over_stages(problem: Problem, part: Partition, cap: float) -> list[int]:
    over: set[int] = set()
    for r, held in enumerate(problem.rank_stages()):
        if part.rank_mem[r] > cap * (1 + _REL):
            over.update(held)
    return sorted(over)


def _next_levers(costs: Costs, req: PlanRequest, ev: Solved) -> Candidate | None:
    """The candidate with a lever added (or recompute turned to offload) on each over-cap stage,
    and offload turned to recompute where a rank's offloaded activations overflow its host share."""
    cand = ev.cand
    cap = costs.mem_cap
    if cap is None:
        return None
    sums = stage_sums(costs, cand, ev.part.stage_of)
    inflight = cand.inflight()
    k = cand.stages
    rc, off = set(cand.recompute), set(cand.offload)
    forced = set(forced_stages(req.recompute, k)) | set(forced_stages(req.offload, k))
    can_off = req.offload == "auto" and bool(costs.host_memory) and bool(costs.host_link_bw)
    limit = (costs.host_memory or 0.0) * (1 + _REL)
    changed = False
    for j, held in enumerate(host_bytes(cand, sums)):  # host overflow: recompute instead where that saves
        for s in sorted(({j, k - 1 - j} if cand.replicas == 2 else {j}) & off - forced):
            if held > limit and req.recompute == "auto" and inflight[s] > 1:
                off.discard(s)
                rc.add(s)
                changed = True
    for s in _over_stages(ev.problem, ev.part, cap):
        if s in forced or s in off:
            continue
        trial = dataclasses.replace(cand, offload=tuple(sorted(off | {s})), recompute=())
        host_ok = can_off and max(host_bytes(trial, sums)) <= limit
        off_cost = offload_time_s(trial, sums, costs.host_link_bw)[s] if host_ok else float("inf")
        rc_ok = req.recompute == "auto" and s not in rc and inflight[s] > 1
        rc_cost = sums[s]["fwd_s"] if rc_ok else float("inf")
        if rc_cost == off_cost == float("inf"):
            continue
        if rc_cost <= off_cost:
            rc.add(s)
        else:
            rc.discard(s)
            off.add(s)
        changed = True
    if not changed:
        return None
    return dataclasses.replace(cand, recompute=tuple(sorted(rc)), offload=tuple(sorted(off)))


def _show(setting: LeverSetting) -> str:
    return repr(setting) if isinstance(setting, str) else repr(list(setting))


S = TypeVar("S", bound=Solved)


def fit_with_levers(costs: Costs, req: PlanRequest, ev: S, solve: Callable[[Candidate], S | None], *,
                    deadline: float = float("inf")) -> S:
    """[Note: choosing levers] ``ev`` (a candidate that does not fit) with levers added on its
    over-cap stages until it fits; the last try when nothing more helps (``fits`` False). No
    round starts after ``deadline`` (``time.perf_counter()`` seconds): candidates are taken best
    bound first, so the time goes to those that may win."""
    best = ev
    for _ in range(2 * ev.cand.stages):
        if time.perf_counter() > deadline:
            break
        cand = _next_levers(costs, req, best)
        if cand is None:
            break
        nxt = solve(cand)
        if nxt is None:
            break
        best = nxt
        if best.fits:
            break
    return best
