"""The partitioning MILP (PuLP + HiGHS or CBC): min-max rank load over convex stage splits.

[Note: ILP formulation] Binary y[v,s] = 1 iff stage(v) <= s for s = 0..K-2 (y[v,-1] = 0,
y[v,K-1] = 1), monotone in s; an edge u->v gives y[v,s] <= y[u,s]; x[v,s] = y[v,s] -
y[v,s-1] is "v sits in stage s". Pins, tileability and precedence first give every node a
range lo..hi of stages (``dp.stage_ranges``); y is fixed outside it and, inside it, a stage
the node may not use (a spatial stage for a non-tileable node) aliases y[v,s] to y[v,s-1].
A received tensor is r[u,s] >= x[v,s] + y[u,s-1] - 1 for every consumer v; a sent one
q[u,s] >= x[u,s] - y[v,s] (charged once to the sender, in link time and in memory: the buffer
for its gradient per micro-batch in flight); the workspace w[s] >= ws[v] x[v,s].
Stage memory and time are then exactly ``evaluate()``'s formulas at the minimal r, q, w,
which any optimum takes on its bottleneck ranks. Bytes and seconds are divided by an upper
bound of one stage's load so every coefficient lies in [0, 1]. The primary bottleneck is
minimised first; the other one is then minimised with the primary fixed to its optimum.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pulp

from nowdl.errors import InfeasibleError
from nowdl.partitioner.dp import (
    _solve_dp,
    check_problem,
    make_partition,
    objective_values,
    stage_ranges,
    topological_order,
)
from nowdl.partitioner.problem import Partition, Problem

__all__ = ["solve_ilp", "build_ilp", "IlpModel", "available_solvers", "load_windows"]

log = logging.getLogger(__name__)

_TIE_REL = 1e-7  # the tie-break solve may lose this much (relative) on the primary
_CAP_REL = 1e-6  # a returned plan may exceed mem_cap by this much (solver tolerance)

Lin = dict[Any, float]  # variable -> coefficient
Y = Any  # an int constant (0 or 1) or a pulp.LpVariable


@dataclass
class IlpModel:
    """A built MILP: the PuLP problem plus handles on its variables and scales.

    ``y[v]`` has K+1 entries for s = -1..K-1, each 0, 1 or a binary variable; ``t_mem`` and
    ``t_time`` are the scaled bottlenecks; multiply by ``mem_scale``/``time_scale`` for
    bytes/seconds.
    """

    prob: pulp.LpProblem
    y: list[list[Y]]
    t_mem: pulp.LpVariable
    t_time: pulp.LpVariable
    mem_scale: float
    time_scale: float
    rank_mem: list[pulp.LpAffineExpression]
    rank_time: list[pulp.LpAffineExpression]
    aux: dict[str, dict[tuple[int, int], pulp.LpVariable]] = field(default_factory=dict)
    w: dict[int, pulp.LpVariable] = field(default_factory=dict)
    w_unit: dict[int, float] = field(default_factory=dict)

    def assignment(self) -> list[int]:
        """The stage of every node read from the current variable values (rounded)."""
        out = []
        for row in self.y:
            stage = 0
            for e in row[1:-1]:
                val = e if isinstance(e, int) else (e.varValue or 0.0)
                if val < 0.5:
                    stage += 1
            out.append(stage)
        return out

    def set_values(self, problem: Problem, stage_of: Sequence[int]) -> None:
        """Set every variable to the value an assignment implies (for a warm start)."""
        k = problem.k
        for v, row in enumerate(self.y):
            for s in range(-1, k):
                e = row[s + 1]
                if not isinstance(e, int):
                    e.varValue = 1.0 if stage_of[v] <= s else 0.0
        cons: dict[int, set[int]] = {}
        for u, v in problem.edges:
            cons.setdefault(u, set()).add(stage_of[v])
        for (u, s), var in self.aux.get("r", {}).items():
            var.varValue = 1.0 if stage_of[u] < s and s in cons.get(u, ()) else 0.0
        for (u, s), var in self.aux.get("q", {}).items():
            later = any(j > s for j in cons.get(u, ()))
            var.varValue = 1.0 if stage_of[u] == s and later else 0.0
        for s, var in self.w.items():
            vec = problem.variants[problem.stages[s].variant]
            ws = [vec.workspace[v] for v in range(problem.n) if stage_of[v] == s]
            var.varValue = max(ws, default=0.0) / self.w_unit[s]
        self.t_mem.varValue = max(pulp.value(e) or 0.0 for e in self.rank_mem)
        self.t_time.varValue = max(pulp.value(e) or 0.0 for e in self.rank_time)


def available_solvers() -> list[str]:
    """MILP back ends usable here, preferred first ("highs", "cbc").

    Returns:
        The names accepted by ``solve_ilp(..., solver=...)`` that work in this environment.
    """
    names = set(pulp.listSolvers(onlyAvailable=True))
    out = []
    if "HiGHS" in names:
        out.append("highs")
    if "PULP_CBC_CMD" in names:
        out.append("cbc")
    return out


def _var(
    prob: pulp.LpProblem, name: str, lo: float | None, hi: float | None,
    cat: str = pulp.LpContinuous,
) -> pulp.LpVariable:
    """A new variable of ``prob`` (PuLP >= 3.3 attaches it; older PuLP builds it free)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=lo, upBound=hi, cat=cat)
    return pulp.LpVariable(name, lowBound=lo, upBound=hi, cat=cat)  # pragma: no cover


def _clean(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)[:60]


def _names(problem: Problem) -> list[str]:
    seen: set[str] = set()
    out = []
    for i, name in enumerate(problem.names):
        c = _clean(str(name)) or f"n{i}"
        if c in seen:
            c = f"{c}_{i}"
        seen.add(c)
        out.append(c)
    return out


def _add(lin: Lin, e: Y, coef: float) -> float:
    """Add coef * e to lin; return the constant part."""
    if isinstance(e, int):
        return coef * e
    lin[e] = lin.get(e, 0.0) + coef
    return 0.0


class _ConstantViolation(RuntimeError):
    """A constraint with no variables left is false (e.g. a cap below a fully pinned stage)."""


def _constraint(
    prob: pulp.LpProblem, terms: list[tuple[Y, float]], sense: int, rhs: float, name: str
) -> None:
    """Add sum(coef * e) (sense) rhs unless it holds trivially (constants only)."""
    lin: Lin = {}
    const = 0.0
    for e, c in terms:
        const += _add(lin, e, c)
    lin = {k: c for k, c in lin.items() if c != 0.0}
    if not lin:
        ok = (const <= rhs + 1e-12) if sense == pulp.LpConstraintLE else (const >= rhs - 1e-12)
        if not ok:  # only a memory cap can be broken by constants (all nodes pinned)
            raise _ConstantViolation(f"constraint {name} is violated by constants")
        return
    expr = pulp.LpAffineExpression(list(lin.items()))
    prob.addConstraint(pulp.LpConstraint(expr, sense, name=name, rhs=rhs - const))


def _scales(problem: Problem) -> tuple[float, float]:
    """Scales for memory and time: an upper bound of one stage's load over K."""
    ms, ts = 0.0, 0.0
    tot_static = float(sum(problem.static))
    for spec in problem.stages:
        vec = problem.variants[spec.variant]
        outs = float(sum(vec.out))
        ms = max(
            ms,
            tot_static + spec.inflight * (float(sum(vec.act)) + outs) + max(vec.workspace),
        )
        ts = max(ts, float(sum(vec.time)) + spec.link_s_per_byte * 2 * outs)
    # divided by K: the bottleneck is then of order 1 and so are the solver's tolerances
    k = problem.k
    return (ms / k if ms > 0 else 1.0), (ts / k if ts > 0 else 1.0)


def _closure(problem: Problem, order: Sequence[int]) -> np.ndarray:
    """Boolean matrix A[v, a] = a is v or an ancestor of v."""
    n = problem.n
    preds: list[list[int]] = [[] for _ in range(n)]
    for u, v in problem.edges:
        preds[v].append(u)
    anc = np.zeros((n, n), dtype=bool)
    for v in order:
        for u in preds[v]:
            anc[v] |= anc[u]
        anc[v, v] = True
    return anc


def load_windows(
    problem: Problem,
    lo: Sequence[int],
    hi: Sequence[int],
    allowed: Sequence[Sequence[bool]],
    *,
    mem_ub: float | None = None,
    time_ub: float | None = None,
) -> tuple[list[int], list[int]]:
    """Narrow every node's stage range using upper bounds on any stage's memory/time.

    If v sits in stage j, v and all its ancestors sit in stages 0..j, whose loads add up to
    at most (j+1) * bound, and each of those nodes costs at least its cheapest load among
    the stages it may use there (boundary tensors and workspace only add). So j is at least
    the first stage where the ancestors' cheapest total fits; descendants bound j from
    above the same way. Every assignment whose stage loads stay within the bounds (every
    optimum, when a bound is the value of a known solution) lies inside the new ranges.

    Args:
        problem: the problem.
        lo: earliest stages (``dp.stage_ranges``).
        hi: latest stages.
        allowed: allowed[v][s] (pins and tileability).
        mem_ub: bound on any stage's memory (a cap or a known solution's bottleneck).
        time_ub: bound on any stage's time.

    Returns:
        (lo, hi) narrowed; unchanged when no bound is given or the bounds contradict.
    """
    n, k = problem.n, problem.k
    lo2, hi2 = list(lo), list(hi)
    bounds: list[tuple[float, np.ndarray]] = []
    for ub, kind in ((mem_ub, "mem"), (time_ub, "time")):
        if ub is None or not math.isfinite(ub):
            continue
        cost = np.full((k, n), np.inf)
        for s, spec in enumerate(problem.stages):
            vec = problem.variants[spec.variant]
            if kind == "mem":
                cost[s] = np.asarray(problem.static, float) + spec.inflight * np.asarray(
                    vec.act, float
                )
            else:
                cost[s] = np.asarray(vec.time, float)
        ok = np.array(allowed, dtype=bool).T  # k x n
        cost = np.where(ok, cost, np.inf)
        bounds.append((ub * (1 + 1e-9) + 1e-300, cost))
    if not bounds:
        return lo2, hi2
    order = topological_order(problem)
    anc = _closure(problem, order).astype(np.float64)
    desc = anc.T
    for ub, cost in bounds:
        pre = np.minimum.accumulate(cost, axis=0)  # cheapest over stages 0..j
        suf = np.minimum.accumulate(cost[::-1], axis=0)[::-1]  # over stages j..K-1
        pre = np.where(np.isfinite(pre), pre, 0.0)
        suf = np.where(np.isfinite(suf), suf, 0.0)
        anc_mass = pre @ anc.T  # [j, v] = sum over ancestors of v
        desc_mass = suf @ desc.T
        for v in range(n):
            fits_lo = [j for j in range(k) if anc_mass[j, v] <= (j + 1) * ub]
            fits_hi = [j for j in range(k) if desc_mass[j, v] <= (k - j) * ub]
            if fits_lo:
                lo2[v] = max(lo2[v], fits_lo[0])
            if fits_hi:
                hi2[v] = min(hi2[v], fits_hi[-1])
    # keep the ranges consistent with precedence and allowed stages
    for _ in range(k + 1):
        changed = False
        for u, w in problem.edges:
            if lo2[w] < lo2[u]:
                lo2[w] = lo2[u]
                changed = True
            if hi2[u] > hi2[w]:
                hi2[u] = hi2[w]
                changed = True
        for v in range(n):
            while lo2[v] < k and not allowed[v][lo2[v]]:
                lo2[v] += 1
                changed = True
            while hi2[v] >= 0 and not allowed[v][hi2[v]]:
                hi2[v] -= 1
                changed = True
        if not changed:
            break
    if any(a > b for a, b in zip(lo2, hi2, strict=True)):
        log.debug("ilp: load windows contradict (bound below the optimum?); not narrowing")
        return list(lo), list(hi)
    return lo2, hi2


def build_ilp(
    problem: Problem,
    *,
    use_cap: bool = True,
    mem_ub: float | None = None,
    time_ub: float | None = None,
) -> IlpModel:
    """Build the MILP of [Note: ILP formulation] with the primary bottleneck as objective.

    Args:
        problem: a well-formed problem (see ``dp.check_problem``).
        use_cap: add ``mem_cap`` constraints (when the problem has a cap).
        mem_ub: optional bound on every stage's memory (e.g. a known solution's memory
            bottleneck when memory is the objective) used to narrow the stage ranges; the
            cap is used too. Solutions above it are cut off.
        time_ub: the same for time.

    Returns:
        The model; ``model.prob.writeLP(path)`` gives a readable LP file.

    Raises:
        InfeasibleError: if pins, tileability and precedence admit no placement.
    """
    n, k = problem.n, problem.k
    lo, hi, allowed = stage_ranges(problem)
    if use_cap and problem.mem_cap is not None:
        mem_ub = problem.mem_cap if mem_ub is None else min(mem_ub, problem.mem_cap)
    lo, hi = load_windows(problem, lo, hi, allowed, mem_ub=mem_ub, time_ub=time_ub)
    nm = _names(problem)
    prob = pulp.LpProblem(f"nowdl_partition_{problem.objective}_K{k}", pulp.LpMinimize)
    mem_scale, time_scale = _scales(problem)

    # y[v][s+1] for s = -1..K-1
    y: list[list[Y]] = []
    for v in range(n):
        row: list[Y] = [0]
        for s in range(k - 1):
            if s < lo[v]:
                row.append(0)
            elif s >= hi[v]:
                row.append(1)
            elif not allowed[v][s]:
                row.append(row[-1])  # x[v,s] = 0: same as the previous stage
            else:
                row.append(_var(prob, f"y_{nm[v]}_s{s}", 0, 1, pulp.LpBinary))
        row.append(1)
        y.append(row)

    def in_stage(v: int, s: int) -> list[tuple[Y, float]]:
        return [(y[v][s + 1], 1.0), (y[v][s], -1.0)]

    consumers: list[list[int]] = [[] for _ in range(n)]
    for u, v in sorted(set(problem.edges)):
        consumers[u].append(v)

    # precedence and monotonicity
    seen: set[tuple[int, int]] = set()
    for v in range(n):
        for s in range(1, k - 1):
            a, b = y[v][s], y[v][s + 1]
            if not isinstance(a, int) and not isinstance(b, int) and a is not b:
                _constraint(prob, [(a, 1.0), (b, -1.0)], pulp.LpConstraintLE, 0.0,
                            f"mono_{nm[v]}_s{s}")
    for u in range(n):
        for v in consumers[u]:
            for s in range(k - 1):
                a, b = y[v][s + 1], y[u][s + 1]
                if isinstance(a, int) or isinstance(b, int):
                    continue  # constants are consistent by construction of lo/hi
                key = (id(a), id(b))
                if key in seen:
                    continue
                seen.add(key)
                _constraint(prob, [(a, 1.0), (b, -1.0)], pulp.LpConstraintLE, 0.0,
                            f"prec_{nm[u]}_{nm[v]}_s{s}")

    def can_be(v: int, s: int) -> bool:
        return lo[v] <= s <= hi[v] and allowed[v][s]

    # every stage holds at least one node (an empty stage is a rank with nothing to do)
    for s in range(k):
        terms = [t for v in range(n) if can_be(v, s) for t in in_stage(v, s)]
        if not terms:
            raise InfeasibleError(
                f"stage {s} of {k} can hold no node (pins, spatial rules and precedence leave it "
                "empty): use fewer stages"
            )
        _constraint(prob, terms, pulp.LpConstraintGE, 1.0, f"nonempty_s{s}")

    mem_lin: list[Lin] = [{} for _ in range(k)]
    mem_const = [0.0] * k
    time_lin: list[Lin] = [{} for _ in range(k)]
    time_const = [0.0] * k
    r_vars: dict[tuple[int, int], pulp.LpVariable] = {}
    q_vars: dict[tuple[int, int], pulp.LpVariable] = {}
    w_vars: dict[int, pulp.LpVariable] = {}
    w_unit: dict[int, float] = {}
    for s, spec in enumerate(problem.stages):
        vec = problem.variants[spec.variant]
        link = spec.link_s_per_byte
        for v in range(n):
            if not can_be(v, s):
                continue
            cm = (problem.static[v] + spec.inflight * vec.act[v]) / mem_scale
            ct = vec.time[v] / time_scale
            for e, sign in in_stage(v, s):
                mem_const[s] += _add(mem_lin[s], e, sign * cm)
                time_const[s] += _add(time_lin[s], e, sign * ct)
        # received tensors
        for u in range(n):
            out = vec.out[u]
            cm = spec.inflight * out / mem_scale
            ct = link * out / time_scale
            if out <= 0 or s == 0 or lo[u] > s - 1:
                continue
            cons = [v for v in consumers[u] if can_be(v, s)]
            if not cons:
                continue
            r = _var(prob, f"r_{nm[u]}_s{s}", 0, 1)
            r_vars[(u, s)] = r
            for v in cons:  # r >= x[v,s] + y[u,s-1] - 1
                _constraint(
                    prob,
                    [(r, 1.0)] + [(e, -c) for e, c in in_stage(v, s)] + [(y[u][s], -1.0)],
                    pulp.LpConstraintGE, -1.0,
                    f"recv_{nm[u]}_{nm[v]}_s{s}",
                )
            mem_lin[s][r] = mem_lin[s].get(r, 0.0) + cm
            if ct > 0:
                time_lin[s][r] = time_lin[s].get(r, 0.0) + ct
        # sent tensors: link time, and a buffer for their gradient per micro-batch in flight
        for u in range(n):
            out = vec.out[u]
            if out <= 0 or not can_be(u, s):
                continue
            cons = [v for v in consumers[u] if hi[v] > s]
            if not cons:
                continue
            q = _var(prob, f"q_{nm[u]}_s{s}", 0, 1)
            q_vars[(u, s)] = q
            for v in cons:  # q >= x[u,s] - y[v,s]
                _constraint(
                    prob,
                    [(q, 1.0)] + [(e, -c) for e, c in in_stage(u, s)] + [(y[v][s + 1], 1.0)],
                    pulp.LpConstraintGE, 0.0,
                    f"send_{nm[u]}_{nm[v]}_s{s}",
                )
            if link > 0:
                time_lin[s][q] = time_lin[s].get(q, 0.0) + link * out / time_scale
            mem_lin[s][q] = mem_lin[s].get(q, 0.0) + spec.inflight * out / mem_scale
        # workspace
        ws_nodes = [v for v in range(n) if vec.workspace[v] > 0 and can_be(v, s)]
        if ws_nodes:
            # in units of the stage's largest workspace, so the solver's tolerances stay
            # small against it
            unit = max(vec.workspace[v] for v in ws_nodes)
            w = _var(prob, f"w_s{s}", 0, 1)
            w_vars[s] = w
            w_unit[s] = unit
            for v in ws_nodes:
                c = vec.workspace[v] / unit
                _constraint(
                    prob,
                    [(w, 1.0)] + [(e, -c * sign) for e, sign in in_stage(v, s)],
                    pulp.LpConstraintGE, 0.0,
                    f"ws_{nm[v]}_s{s}",
                )
            mem_lin[s][w] = mem_lin[s].get(w, 0.0) + unit / mem_scale

    t_mem = _var(prob, "T_mem", 0, None)
    t_time = _var(prob, "T_time", 0, None)
    rank_mem: list[pulp.LpAffineExpression] = []
    rank_time: list[pulp.LpAffineExpression] = []
    for r_idx, stages in enumerate(problem.rank_stages()):
        ml: Lin = {}
        tl: Lin = {}
        mc = tc = 0.0
        for s in sorted(stages):  # a stage listed twice (MASTER, odd K: both replicas' copies) counts twice
            for var, c in mem_lin[s].items():
                ml[var] = ml.get(var, 0.0) + c
            for var, c in time_lin[s].items():
                tl[var] = tl.get(var, 0.0) + c
            mc += mem_const[s]
            tc += time_const[s]
        me = pulp.LpAffineExpression([(a, c) for a, c in ml.items() if c != 0.0], constant=mc)
        te = pulp.LpAffineExpression([(a, c) for a, c in tl.items() if c != 0.0], constant=tc)
        rank_mem.append(me)
        rank_time.append(te)
        _constraint(prob, [(t_mem, 1.0)] + [(a, -c) for a, c in ml.items()],
                    pulp.LpConstraintGE, mc, f"mem_r{r_idx}")
        _constraint(prob, [(t_time, 1.0)] + [(a, -c) for a, c in tl.items()],
                    pulp.LpConstraintGE, tc, f"time_r{r_idx}")
        if use_cap and problem.mem_cap is not None:
            _constraint(prob, list(ml.items()), pulp.LpConstraintLE,
                        problem.mem_cap / mem_scale - mc, f"mem_cap_r{r_idx}")
    prob.setObjective(t_mem if problem.objective == "memory" else t_time)
    return IlpModel(
        prob=prob, y=y, t_mem=t_mem, t_time=t_time, mem_scale=mem_scale,
        time_scale=time_scale, rank_mem=rank_mem, rank_time=rank_time,
        aux={"r": r_vars, "q": q_vars}, w=w_vars, w_unit=w_unit,
    )


@dataclass
class _Run:
    """What one solver call gave."""

    state: str  # "optimal", "feasible", "infeasible", "none" (no solution), "error"
    gap: float  # relative gap reported by the solver (NaN if unknown)
    seconds: float
    detail: str = ""


if "HiGHS" in pulp.listSolvers(onlyAvailable=True):

    class _WarmHiGHS(pulp.HiGHS):  # type: ignore[misc]
        """PuLP's highspy interface, plus an optional MIP start from the variables' values."""

        def __init__(self, *, warm: bool, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.warm = warm

        def callSolver(self, lp: pulp.LpProblem) -> None:  # noqa: N802 (PuLP's name)
            if self.warm:
                idx, val = [], []
                for var in lp.variables():
                    if var.varValue is not None:
                        idx.append(var.index)
                        val.append(float(var.varValue))
                lp.solverModel.setSolution(
                    len(idx), np.array(idx, dtype=np.int32), np.array(val, dtype=np.float64)
                )
            lp.solverModel.run()


def _run_highs(model: IlpModel, time_limit: float, threads: int, gap: float, warm: bool) -> _Run:
    import highspy

    t0 = time.perf_counter()
    solver = _WarmHiGHS(
        warm=warm, msg=False, timeLimit=max(time_limit, 0.01), gapRel=gap, gapAbs=1e-10,
        threads=threads, random_seed=0,
    )
    try:
        model.prob.solve(solver)
    except (pulp.PulpSolverError, IndexError) as exc:  # IndexError: no column values
        h = getattr(model.prob, "solverModel", None)
        if h is None or h.getModelStatus() != highspy.HighsModelStatus.kInfeasible:
            return _Run("error", math.nan, time.perf_counter() - t0, str(exc))
    h = model.prob.solverModel
    status = h.getModelStatus()
    info = h.getInfo()
    seconds = time.perf_counter() - t0
    ms = highspy.HighsModelStatus
    has_solution = int(info.primal_solution_status) == 2  # kSolutionStatusFeasible
    detail = h.modelStatusToString(status)
    if status == ms.kOptimal and has_solution:
        g = float(info.mip_gap)  # inf when presolve solved it without branching
        return _Run("optimal", max(g, 0.0) if math.isfinite(g) else 0.0, seconds, detail)
    if status in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        return _Run("infeasible", math.nan, seconds, detail)
    if has_solution:
        g = float(info.mip_gap)
        return _Run("feasible", g if math.isfinite(g) else math.nan, seconds, detail)
    return _Run("none", math.nan, seconds, detail)


def _run_cbc(model: IlpModel, time_limit: float, threads: int, gap: float, warm: bool) -> _Run:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nowdl_cbc_") as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        with warnings.catch_warnings():  # PuLP 3.3 deprecates its bundled CBC
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(
                msg=False, timeLimit=max(time_limit, 0.01), gapRel=gap, gapAbs=1e-10,
                threads=threads, warmStart=warm, logPath=log_path, timeMode="elapsed",
            )
        try:
            model.prob.solve(solver)
        except pulp.PulpSolverError as exc:
            return _Run("error", math.nan, time.perf_counter() - t0, str(exc))
        try:
            with open(log_path) as fh:
                text = fh.read()
        except OSError:
            text = ""
    seconds = time.perf_counter() - t0
    m = re.search(r"^Gap:\s+([-+0-9.eE]+)", text, re.MULTILINE)
    g = float(m.group(1)) if m else math.nan
    sol = model.prob.sol_status
    if sol == pulp.LpSolutionOptimal:
        return _Run("optimal", g if math.isfinite(g) else 0.0, seconds, "Optimal")
    if sol == pulp.LpSolutionIntegerFeasible:
        return _Run("feasible", g, seconds, "stopped with a solution")
    if model.prob.status == pulp.LpStatusInfeasible or sol == pulp.LpSolutionInfeasible:
        return _Run("infeasible", math.nan, seconds, "Infeasible")
    return _Run("none", math.nan, seconds, pulp.LpStatus.get(model.prob.status, "?"))


def _pick_solver(solver: str) -> str:
    avail = available_solvers()
    if solver == "auto":
        if not avail:
            raise RuntimeError(
                "no MILP solver available: install highspy (pip install highspy) or CBC"
            )
        return avail[0]
    if solver not in ("highs", "cbc"):
        raise ValueError(f"solver is {solver!r}, expected 'auto', 'highs' or 'cbc'")
    if solver not in avail:
        raise ValueError(f"solver {solver!r} is not available here (available: {avail})")
    return solver


def _run(name: str, model: IlpModel, left: float, threads: int, gap: float, warm: bool) -> _Run:
    fn = _run_highs if name == "highs" else _run_cbc
    return fn(model, left, threads, gap, warm)


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
) -> Partition:
    """Optimal convex split of the DAG into K stages by MILP (see [Note: ILP formulation]).

    Minimises the bottleneck of ``problem.objective`` over ranks subject to ``mem_cap``, then
    (when the first solve was proven optimal and time remains) the other bottleneck with the
    first held at its optimum. The DP over a topological order gives the MIP start and the
    fallback, so the result is never worse than ``solve_dp``.

    Example:
        >>> part = solve_ilp(problem, time_limit=10)
        >>> part.status, part.bottleneck_mem

    Args:
        problem: the problem.
        time_limit: seconds for the whole call (model building and both solves).
        solver: "auto" (HiGHS if available, else CBC), "highs" or "cbc".
        threads: solver threads (1 keeps the run deterministic).
        mip_gap: relative gap at which the solver may call a solution optimal.
        warm_start: start the solver from the DP's split.

    Returns:
        The Partition (evaluated with ``evaluate()``): status "optimal" when the solver
        proved the primary optimum (within ``mip_gap``), "feasible" when it stopped at the
        time limit (``gap`` then holds its relative gap, NaN when unknown); solver "highs" or
        "cbc", or "dp (fallback ...)" when the MILP found nothing.

    Raises:
        ValueError: if the problem or an argument is malformed.
        InfeasibleError: if no placement respects pins/tileability, or nothing fits
            ``mem_cap`` (the message gives the cap and the smallest achievable memory).
    """
    t0 = time.perf_counter()
    if not (time_limit > 0):
        raise ValueError(f"time_limit must be > 0 seconds (got {time_limit})")
    if threads < 1:
        raise ValueError(f"threads must be >= 1 (got {threads})")
    if not (0 <= mip_gap < 1):
        raise ValueError(f"mip_gap must be in [0, 1) (got {mip_gap})")
    check_problem(problem)
    stage_ranges(problem)  # structural infeasibility raises here, before any solve
    name = _pick_solver(solver)
    dp_part: Partition | None = None
    try:
        dp_part = _solve_dp(problem, None, explain=False)
    except InfeasibleError as exc:
        log.info("ilp: the DP found no split of the topological order (%s)", exc)
    mem_ub = time_ub = None
    if dp_part is not None:
        prim_dp, _ = objective_values(problem, dp_part)
        if problem.objective == "memory":
            mem_ub = prim_dp
        else:
            time_ub = prim_dp
    try:
        model = build_ilp(problem, mem_ub=mem_ub, time_ub=time_ub)
    except _ConstantViolation:
        if problem.mem_cap is None:  # pragma: no cover - stage_ranges() rules this out
            raise
        raise InfeasibleError(_cap_message(problem, time_limit, name, threads)) from None
    n_bin = sum(1 for v in model.prob.variables() if v.cat == pulp.LpInteger)
    log.info(
        "ilp: %s, n=%d K=%d: %d variables (%d binary), %d constraints, built in %.2f s",
        name, problem.n, problem.k, model.prob.numVariables(), n_bin,
        model.prob.numConstraints(), time.perf_counter() - t0,
    )
    warm = warm_start and dp_part is not None
    if warm and dp_part is not None:
        model.set_values(problem, dp_part.stage_of)
    # leave a margin for reading the solution back and the tie-break check, so the whole
    # call returns within time_limit
    margin = min(1.0, 0.03 * time_limit)
    run = _run(name, model, max(0.05, time_limit - margin - (time.perf_counter() - t0)), threads, mip_gap, warm)
    log.info("ilp: %s primary solve: %s (%s) in %.2f s, gap %.3g", name, run.state,
             run.detail, run.seconds, run.gap)
    if run.state == "infeasible":
        if problem.mem_cap is None:  # pragma: no cover - stage_ranges() rules this out
            raise InfeasibleError(f"the MILP is infeasible without a memory cap ({run.detail})")
        left = max(time_limit - (time.perf_counter() - t0), min(time_limit, 5.0))
        raise InfeasibleError(_cap_message(problem, left, name, threads))
    if run.state in ("none", "error"):
        if dp_part is None:
            raise InfeasibleError(
                f"Neither the MILP ({name}: {run.state}, {run.detail}, {time_limit:g} s) nor the "
                f"DP over a topological order found a partition of {problem.n} nodes into "
                f"{problem.k} stages within the memory cap of {_gib(problem.mem_cap or 0.0)}. "
                "Give the solver more time, raise the cap, or use more GPUs/stages."
            )
        log.warning("ilp: %s found no solution (%s); falling back to the DP", name, run.detail)
        return dataclasses.replace(
            dp_part, solver=f"dp (fallback: {name} {run.state})", status="feasible",
            gap=math.nan, seconds=time.perf_counter() - t0,
        )
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
        log.debug("ilp: the DP split is lexicographically better than the incumbent; kept")
        part = dataclasses.replace(part, stage_of=dp_part.stage_of, stage_mem=dp_part.stage_mem,
                                   stage_time=dp_part.stage_time, rank_mem=dp_part.rank_mem,
                                   rank_time=dp_part.rank_time)
    # the tie-break gets at most half as long as the primary solve took (at least 0.5 s)
    left = min(time_limit - (time.perf_counter() - t0), max(0.5, 0.5 * run.seconds))
    if run.state == "optimal" and left > 0.05:
        part = _tie_break(problem, model, part, name, left, threads, mip_gap)
    return dataclasses.replace(part, seconds=time.perf_counter() - t0)


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
        run = _run(name, model, left, threads, mip_gap, True)
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
