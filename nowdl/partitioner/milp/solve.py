"""Solving the partitioning MILP: primary bottleneck, then the later lexicographic levels.

The model is ``ilp_model``'s [Note: ILP formulation]; ``ilp_run`` runs it on HiGHS or CBC.
``solve_ilp`` minimises the primary bottleneck (MIP start and fallback: the best known split,
by default the DP over a topological order), then, while time remains, the levels of
[Note: lexicographic levels]: the other bottleneck with the primary held, then the spread
(the least busy stage's work maximised, ``z <= work_s`` for every stage) when a stage would
otherwise idle.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import pulp

from nowdl.errors import InfeasibleError
from nowdl.partitioner.chain.chain_dp import spread_ok
from nowdl.partitioner.costs.no_idle import stage_work
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.structure import (
    check_problem,
    make_partition,
    objective_values,
    stage_ranges,
)
from nowdl.partitioner.exact.order_dp import solve_dp
from nowdl.partitioner.milp.lp_bound import assignment_lower_bound
from nowdl.partitioner.milp.model import ConstantViolation, IlpModel, build_ilp
from nowdl.partitioner.milp.run import Run, available_solvers, pick_solver, run_model
from nowdl.partitioner.milp.stage_windows import load_windows

__all__ = ["solve_ilp", "build_ilp", "IlpModel", "available_solvers", "load_windows"]

log = logging.getLogger(__name__)

_TIE_REL = 1e-7  # the later levels may lose this much (relative) on the levels they hold
_CAP_REL = 1e-6  # a returned plan may exceed mem_cap by this much (solver tolerance)


def _within_cap(problem: Problem, part: Partition) -> bool:
    return problem.mem_cap is None or part.bottleneck_mem <= problem.mem_cap * (1 + _CAP_REL)


def _better(problem: Problem, a: Partition, b: Partition) -> bool:
    """True if a is lexicographically better than b (primary, then secondary)."""
    pa, sa = objective_values(problem, a)
    pb, sb = objective_values(problem, b)
    tol = 1e-9 * max(abs(pa), abs(pb), 1e-300)
    if pa < pb - tol:
        return True
    if pa > pb + tol:
        return False
    return sa < sb * (1 - 1e-9)


def _gib(x: float) -> str:
    return f"{x:.6g} bytes ({x / 2**30:.3f} GiB)"


def _short_cap_message(problem: Problem) -> str:
    return (f"No partition keeps every GPU within the memory cap of {_gib(float(problem.mem_cap or 0.0))} "
            f"({problem.n} nodes in {problem.k} stages)")


def _cap_message(problem: Problem, time_limit: float, solver: str, threads: int) -> str:
    cap = float(problem.mem_cap or 0.0)
    relaxed = dataclasses.replace(problem, objective="memory", mem_cap=None)
    ranks = problem.rank_stages()
    paired = any(len(set(r)) > 1 for r in ranks)
    config = f"{problem.n} nodes in {problem.k} stages on {len(ranks)} GPUs" + (
        " with paired (MASTER) stages" if paired else ""
    )
    try:
        best = solve_ilp(relaxed, time_limit=time_limit, solver=solver, threads=threads)
    except (InfeasibleError, RuntimeError, ValueError) as exc:  # pragma: no cover
        return (
            f"No partition keeps every GPU within the memory cap of {_gib(cap)} ({config}); "
            f"the minimum could not be computed ({exc}). Raise the cap or use more GPUs/stages."
        )
    need = best.bottleneck_mem
    head = (
        f"No partition keeps every GPU within the memory cap of {_gib(cap)} ({config}): the "
        "smallest achievable largest per-GPU memory for this configuration is "
    )
    tail = "or use more GPUs/stages so each holds less."
    if best.status == "optimal":
        return f"{head}{_gib(need)} (proven optimal). Raise mem_cap to at least {_gib(need)}, {tail}"
    lb = need * (1 - best.gap) if math.isfinite(best.gap) else math.nan
    if not math.isfinite(lb):
        return (
            f"{head}at most {_gib(need)} (best found in {time_limit:g} s, bound unknown). Raise "
            f"mem_cap to {_gib(need)}, {tail}"
        )
    return (
        f"{head}between {_gib(lb)} and {_gib(need)} (the solver stopped after {time_limit:g} s). "
        f"Raise mem_cap to at least {_gib(lb)} (a cap of {_gib(need)} is known to fit), {tail}"
    )


def solve_ilp(
    problem: Problem,
    *,
    time_limit: float = 30.0,
    solver: str = "auto",
    threads: int = 1,
    mip_gap: float = 1e-6,
    warm_start: bool = True,
    start: Partition | None = None,
    spread: bool = True,
    explain: bool = True,
) -> Partition:
    """Optimal convex split of the DAG into K stages by MILP (see [Note: ILP formulation]).

    Minimises the bottleneck of ``problem.objective`` over ranks subject to ``mem_cap``, then
    (when the first solve was proven optimal and time remains) the other bottleneck with the
    first held at its optimum, then the spread of the work (see [Note: lexicographic levels]).
    The best known split (``start``, else the DP over a topological order) gives the MIP
    start, the bound that narrows every node's stages, and the fallback, so the result is
    never worse than it.

    Example:
        >>> part = solve_ilp(problem, time_limit=10)
        >>> part.status, part.bottleneck_mem

    Args:
        problem: the problem.
        time_limit: seconds for the whole call (model building and both solves).
        solver: "auto" (HiGHS if available, else CBC), "highs" or "cbc".
        threads: solver threads (1 keeps the run deterministic).
        mip_gap: relative gap at which the solver may call a solution optimal.
        warm_start: start the solver from the best known split.
        start: a known split of this problem (a heuristic's); None: run the DP for one.
        spread: solve the spread level (no idle GPU) after the tie-break.
        explain: when nothing fits the cap, solve again without it to say what would fit
            (False: a short message; the configuration search screens many candidates).

    Returns:
        The Partition (evaluated with ``evaluate()``): status "optimal" when the solver
        proved the primary optimum (within ``mip_gap``), "feasible" when it stopped at the
        time limit (``gap`` then holds its relative gap, against ``assignment_lower_bound`` when
        the solver has no bound yet); solver "highs" or
        "cbc", or "dp (fallback ...)" when the MILP found nothing.

    Raises:
        ValueError: if the problem or an argument is malformed.
        InfeasibleError: if no placement respects pins/tileability, or nothing fits
            ``mem_cap`` (the message gives the cap and the smallest achievable memory).
    """
    t0 = time.perf_counter()
    _check_args(time_limit, threads, mip_gap)
    check_problem(problem)
    stage_ranges(problem)  # structural infeasibility raises here, before any solve
    name = pick_solver(solver)
    dp_part = _known_split(problem, start)
    model = _build(problem, dp_part, time_limit, name, threads, explain, t0)
    warm = warm_start and dp_part is not None
    if warm and dp_part is not None:
        model.set_values(problem, dp_part.stage_of)
    # leave a margin for reading the solution back and the tie-break check, so the whole
    # call returns within time_limit
    margin = min(1.0, 0.03 * time_limit)
    run = run_model(name, model, max(0.05, time_limit - margin - (time.perf_counter() - t0)), threads, mip_gap, warm)
    log.info("ilp: %s primary solve: %s (%s) in %.2f s, gap %.3g", name, run.state,
             run.detail, run.seconds, run.gap)
    if run.state == "infeasible":
        if problem.mem_cap is None:  # pragma: no cover - stage_ranges() rules this out
            raise InfeasibleError(f"the MILP is infeasible without a memory cap ({run.detail})")
        left = max(time_limit - (time.perf_counter() - t0), min(time_limit, 5.0))
        raise InfeasibleError(_cap_message(problem, left, name, threads) if explain else _short_cap_message(problem))
    if run.state in ("none", "error"):
        return _fallback(problem, model, dp_part, run, name, time_limit, t0)
    part = _incumbent(problem, model, dp_part, run, name)
    # the later levels get at most half as long as the primary solve took (at least 0.5 s) each
    left = min(time_limit - (time.perf_counter() - t0), max(0.5, 0.5 * run.seconds))
    if run.state == "optimal" and left > 0.05:
        part = _tie_break(problem, model, part, name, left, threads, mip_gap)
    left = min(time_limit - (time.perf_counter() - t0), max(0.5, 0.5 * run.seconds))
    if (spread and run.state == "optimal" and left > 0.05
            and not spread_ok(stage_work(problem, part.stage_of))):
        part = _spread(problem, model, part, name, left, threads, mip_gap)
    return dataclasses.replace(part, seconds=time.perf_counter() - t0)


def _check_args(time_limit: float, threads: int, mip_gap: float) -> None:
    if not (time_limit > 0):
        raise ValueError(f"time_limit must be > 0 seconds (got {time_limit})")
    if threads < 1:
        raise ValueError(f"threads must be >= 1 (got {threads})")
    if not (0 <= mip_gap < 1):
        raise ValueError(f"mip_gap must be in [0, 1) (got {mip_gap})")


def _known_split(problem: Problem, start: Partition | None) -> Partition | None:
    """The best known split: ``start`` when it fits, else the DP over a topological order (None
    when that finds nothing)."""
    if start is not None and len(start.stage_of) == problem.n and _within_cap(problem, start):
        return make_partition(problem, start.stage_of, solver=start.solver, status=start.status)
    try:
        return solve_dp(problem, explain=False)
    except InfeasibleError as exc:
        log.info("ilp: the DP found no split of the topological order (%s)", exc)
        return None


def _build(problem: Problem, dp_part: Partition | None, time_limit: float, name: str, threads: int,
           explain: bool, t0: float) -> IlpModel:
    """The model, every node's stages narrowed by the known split's primary bottleneck."""
    mem_ub = time_ub = None
    if dp_part is not None:
        prim_dp, _ = objective_values(problem, dp_part)
        if problem.objective == "memory":
            mem_ub = prim_dp
        else:
            time_ub = prim_dp
    try:
        model = build_ilp(problem, mem_ub=mem_ub, time_ub=time_ub)
    except ConstantViolation:
        if problem.mem_cap is None:  # pragma: no cover - stage_ranges() rules this out
            raise
        raise InfeasibleError(_cap_message(problem, time_limit, name, threads) if explain
                              else _short_cap_message(problem)) from None
    n_bin = sum(1 for v in model.prob.variables() if v.cat == pulp.LpInteger)
    log.info(
        "ilp: %s, n=%d K=%d: %d variables (%d binary), %d constraints, built in %.2f s",
        name, problem.n, problem.k, model.prob.numVariables(), n_bin,
        model.prob.numConstraints(), time.perf_counter() - t0,
    )
    return model


def _fallback(problem: Problem, model: IlpModel, dp_part: Partition | None, run: Run, name: str,
              time_limit: float, t0: float) -> Partition:
    """The known split when the solver found nothing better within its narrowed bound, with the
    gap to the solver's lower bound (or the assignment LP's, ``lp_bound``)."""
    if dp_part is None:
        raise InfeasibleError(
            f"Neither the MILP ({name}: {run.state}, {run.detail}, {time_limit:g} s) nor the "
            f"DP over a topological order found a partition of {problem.n} nodes into "
            f"{problem.k} stages within the memory cap of {_gib(problem.mem_cap or 0.0)}. "
            "Give the solver more time, raise the cap, or use more GPUs/stages."
        )
    scale = model.mem_scale if problem.objective == "memory" else model.time_scale
    value, _ = objective_values(problem, dp_part)
    lower = run.bound * scale
    lower = max(lower, assignment_lower_bound(problem)) if math.isfinite(lower) else assignment_lower_bound(problem)
    gap = max(0.0, (value - lower) / value) if value > 0 else 0.0
    log.info("ilp: %s found no split better than the %s one in its time (%s); lower bound "
             "%.6g, gap %.3g", name, dp_part.solver or "known", run.detail, lower, gap)
    return dataclasses.replace(
        dp_part, solver=f"{dp_part.solver or 'dp'} (fallback: {name} {run.state})",
        status="optimal" if gap <= 1e-9 else "feasible",
        gap=gap, seconds=time.perf_counter() - t0,
    )


def _incumbent(problem: Problem, model: IlpModel, dp_part: Partition | None, run: Run, name: str
               ) -> Partition:
    """The primary solve's split (the known one where that is lexicographically better or the
    solver's breaks the cap), with its gap to the better of two lower bounds when not optimal."""
    part = make_partition(problem, model.assignment(), solver=name, status=run.state,
                          gap=run.gap)
    scale, t_prim = (
        (model.mem_scale, model.t_mem) if problem.objective == "memory"
        else (model.time_scale, model.t_time)
    )
    prim, _ = objective_values(problem, part)
    solver_val = float(t_prim.varValue or 0.0) * scale
    if run.state == "optimal" and abs(solver_val - prim) > 1e-6 * max(abs(prim), 1e-300):
        log.warning("ilp: solver objective %.9g differs from evaluate() %.9g", solver_val, prim)
    if dp_part is not None and (_better(problem, dp_part, part) or not _within_cap(problem, part)):
        log.debug("ilp: the start split is lexicographically better than the incumbent; kept")
        part = dataclasses.replace(part, stage_of=dp_part.stage_of, stage_mem=dp_part.stage_mem,
                                   stage_time=dp_part.stage_time, rank_mem=dp_part.rank_mem,
                                   rank_time=dp_part.rank_time)
    if part.status == "feasible":  # the gap of the split kept, to the better of two bounds
        value, _ = objective_values(problem, part)
        lower = assignment_lower_bound(problem)
        if math.isfinite(run.bound):
            lower = max(lower, run.bound * scale)
        part = dataclasses.replace(part, gap=max(0.0, 1 - lower / value) if value > 0 else 0.0)
    return part


def _tie_break(
    problem: Problem, model: IlpModel, part: Partition, name: str, left: float, threads: int,
    mip_gap: float,
) -> Partition:
    """Minimise the secondary bottleneck with the primary held at its optimum."""
    if problem.objective == "memory":
        t_prim, t_sec, scale = model.t_mem, model.t_time, model.mem_scale
    else:
        t_prim, t_sec, scale = model.t_time, model.t_mem, model.time_scale
    prim, sec = objective_values(problem, part)
    t_prim.upBound = prim / scale * (1 + _TIE_REL)
    model.prob.setObjective(t_sec)
    model.set_values(problem, part.stage_of)
    try:
        run = run_model(name, model, left, threads, mip_gap, True)
    finally:
        t_prim.upBound = None
        model.prob.setObjective(t_prim)
    log.info("ilp: %s tie-break solve: %s in %.2f s", name, run.state, run.seconds)
    if run.state not in ("optimal", "feasible"):
        return part
    cand = make_partition(problem, model.assignment(), solver=part.solver, status=part.status,
                          gap=part.gap)
    p2, s2 = objective_values(problem, cand)
    if _within_cap(problem, cand) and p2 <= prim * (1 + 2 * _TIE_REL) and s2 < sec:
        return cand
    return part


def _levels(problem: Problem, model: IlpModel) -> tuple[pulp.LpVariable, pulp.LpVariable, float, float]:
    """(primary bottleneck variable, secondary one, their scales)."""
    if problem.objective == "memory":
        return model.t_mem, model.t_time, model.mem_scale, model.time_scale
    return model.t_time, model.t_mem, model.time_scale, model.mem_scale


def _spread_run(problem: Problem, model: IlpModel, part: Partition, name: str, left: float,
                threads: int, mip_gap: float, *, hold_sec: bool, floor: float | None) -> Partition | None:
    """One solve with the primary (and the secondary) held: maximise the least busy rank's
    work, or, with ``floor``, minimise the secondary keeping every rank's work >= floor."""
    t_prim, t_sec, p_scale, s_scale = _levels(problem, model)
    prim, sec = objective_values(problem, part)
    z = model.z_work
    z.upBound = None
    t_prim.upBound = prim / p_scale * (1 + _TIE_REL)
    if hold_sec:
        t_sec.upBound = sec / s_scale * (1 + _TIE_REL)
    if floor is None:
        model.prob.setObjective(-1.0 * z)
    else:
        z.lowBound = floor / model.time_scale * (1 - _TIE_REL)
        model.prob.setObjective(t_sec)
    model.set_values(problem, part.stage_of)
    z.varValue = max(0.0, min(pulp.value(e) or 0.0 for e in model.stage_work))
    try:
        run = run_model(name, model, left, threads, mip_gap, True)
    finally:
        t_prim.upBound = None
        t_sec.upBound = None
        z.lowBound = 0
        z.upBound = 0
        model.prob.setObjective(t_prim)
    log.info("ilp: %s spread solve (%s): %s in %.2f s", name,
             "secondary held" if hold_sec else "floor" if floor is not None else "primary held",
             run.state, run.seconds)
    if run.state not in ("optimal", "feasible"):
        return None
    cand = make_partition(problem, model.assignment(), solver=part.solver, status=part.status,
                          gap=part.gap)
    p2, s2 = objective_values(problem, cand)
    if not _within_cap(problem, cand) or p2 > prim * (1 + 2 * _TIE_REL):
        return None
    if hold_sec and s2 > sec * (1 + 2 * _TIE_REL):
        return None
    return cand


def _spread(problem: Problem, model: IlpModel, part: Partition, name: str, left: float,
            threads: int, mip_gap: float) -> Partition:
    """Level 3 of [Note: lexicographic levels]: spread the work, swapping levels 2 and 3 when
    a rank would otherwise idle; never worse on the primary."""
    t0 = time.perf_counter()
    best = part
    cand = _spread_run(problem, model, part, name, left, threads, mip_gap, hold_sec=True, floor=None)
    if cand is not None and min(stage_work(problem, cand.stage_of)) >= min(stage_work(problem, part.stage_of)):
        best = cand
    if spread_ok(stage_work(problem, best.stage_of)):
        return best
    left -= time.perf_counter() - t0
    if left <= 0.05:
        return best
    relaxed = _spread_run(problem, model, best, name, left / 2, threads, mip_gap, hold_sec=False,
                          floor=None)
    if relaxed is None or not spread_ok(stage_work(problem, relaxed.stage_of)):
        return best
    left -= time.perf_counter() - t0
    floor = min(stage_work(problem, relaxed.stage_of))
    if left > 0.05:
        lower = _spread_run(problem, model, relaxed, name, left, threads, mip_gap, hold_sec=False,
                            floor=floor)
        if lower is not None and spread_ok(stage_work(problem, lower.stage_of)):
            return lower
    return relaxed
