"""Running a built MILP on HiGHS (highspy, with a MIP start) or CBC; what the run gave."""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pulp

from nowdl.partitioner.milp.model import IlpModel

__all__ = ["Run", "available_solvers", "pick_solver", "run_model"]

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


@dataclass
class Run:
    """What one solver call gave."""

    state: str  # "optimal", "feasible", "infeasible", "none" (no solution), "error"
    gap: float  # relative gap reported by the solver (NaN if unknown)
    seconds: float
    detail: str = ""
    bound: float = math.nan  # the solver's lower bound on the objective (model units; NaN if unknown)


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


def _run_highs(model: IlpModel, time_limit: float, threads: int, gap: float, warm: bool) -> Run:
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
            return Run("error", math.nan, time.perf_counter() - t0, str(exc))
    h = model.prob.solverModel
    status = h.getModelStatus()
    info = h.getInfo()
    seconds = time.perf_counter() - t0
    ms = highspy.HighsModelStatus
    has_solution = int(info.primal_solution_status) == 2  # kSolutionStatusFeasible
    detail = h.modelStatusToString(status)
    bound = float(getattr(info, "mip_dual_bound", math.nan))
    if status == ms.kOptimal and has_solution:
        g = float(info.mip_gap)  # inf when presolve solved it without branching
        return Run("optimal", max(g, 0.0) if math.isfinite(g) else 0.0, seconds, detail)
    if status in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        return Run("infeasible", math.nan, seconds, detail)
    if has_solution:
        g = float(info.mip_gap)
        return Run("feasible", g if math.isfinite(g) else math.nan, seconds, detail,
                   bound=bound if math.isfinite(bound) else math.nan)
    return Run("none", math.nan, seconds, detail, bound=bound if math.isfinite(bound) else math.nan)


def _run_cbc(model: IlpModel, time_limit: float, threads: int, gap: float, warm: bool) -> Run:
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
            return Run("error", math.nan, time.perf_counter() - t0, str(exc))
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
        return Run("optimal", g if math.isfinite(g) else 0.0, seconds, "Optimal")
    if sol == pulp.LpSolutionIntegerFeasible:
        return Run("feasible", g, seconds, "stopped with a solution")
    if model.prob.status == pulp.LpStatusInfeasible or sol == pulp.LpSolutionInfeasible:
        return Run("infeasible", math.nan, seconds, "Infeasible")
    return Run("none", math.nan, seconds, pulp.LpStatus.get(model.prob.status, "?"))


def pick_solver(solver: str) -> str:
    """The back end for ``solver`` ("auto", "highs", "cbc"); ValueError if not available."""
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


def run_model(name: str, model: IlpModel, left: float, threads: int, gap: float, warm: bool) -> Run:
    """Solve ``model`` with back end ``name`` for at most ``left`` seconds (MIP start: ``warm``)."""
    fn = _run_highs if name == "highs" else _run_cbc
    return fn(model, left, threads, gap, warm)
