"""The partitioning MILP's model (PuLP): variables, constraints and the rank expressions.

[Note: ILP formulation] Binary y[v,s] = 1 iff stage(v) <= s for s = 0..K-2 (y[v,-1] = 0,
y[v,K-1] = 1), monotone in s; an edge u->v gives y[v,s] <= y[u,s]; x[v,s] = y[v,s] -
y[v,s-1] is "v sits in stage s". Pins, tileability and precedence first give every node a
range lo..hi of stages (``structure.stage_ranges``); y is fixed outside it and, inside it, a
stage the node may not use (a spatial stage for a non-tileable node) aliases y[v,s] to
y[v,s-1]. A received tensor is r[u,s] >= x[v,s] - x[u,s] for every consumer v (v in s and
u not: u is earlier, as edges go forward); a sent one q[u,s] >= x[u,s] - x[v,s] (u in s and
v not: v is later), charged once to the sender, in link time and in memory (the buffer for
its gradient per micro-batch in flight); the workspace w[s] >= ws[v] x[v,s]. At 0/1 points
these equal r >= x[v,s] + y[u,s-1] - 1 and q >= x[u,s] - y[v,s]; in the LP they are never
weaker (by 1 - y[u,s] >= 0 and y[v,s-1] >= 0): AmoebaNet-D's LP bound (K = 8, memory) rose
from 6.20 to 6.26 GiB. Per cut the LP is still the convex closure of the frontier bytes (a
fractional cut mixes ideals of different sizes, each with a thin frontier): on graphs of
parallel branches only branching closes the rest. Long-skip gradients waiting on stage s
([Note: long-skip gradient waits] in skipwait.py: c_i copies when u sits in stage i, c
non-increasing in i) are charged as sum over e of (c_e - c_{e+1}) z[u,s,e], with
z[u,s,e] >= x[v,s] + y[u,e] - 1 ("received at s from stage <= e"; z = r for e = s - 1).
Stage memory and time are then exactly ``evaluate()``'s formulas at the minimal r, q, w,
which any optimum takes on its bottleneck ranks. Bytes and seconds are divided by an upper
bound of one stage's load so every coefficient lies in [0, 1]. A stage's work (fwd + bwd
compute, no link time) is a third linear expression, for the spread level of
[Note: lexicographic levels]. Solving is ``ilp``'s job.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pulp

from nowdl.errors import InfeasibleError
from nowdl.partitioner.costs.problem import Problem
from nowdl.partitioner.costs.structure import stage_ranges
from nowdl.partitioner.milp.load_rows import Layout, StageLoads, add_stage_loads
from nowdl.partitioner.milp.stage_windows import load_windows
from nowdl.partitioner.milp.terms import (
    ConstantViolation,
    Lin,
    Y,
    add_constraint,
    lp_names,
    new_var,
)

__all__ = ["build_ilp", "IlpModel", "ConstantViolation"]

log = logging.getLogger(__name__)



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
    stage_work: list[pulp.LpAffineExpression]  # compute only, in time_scale units
    z_work: pulp.LpVariable  # <= every stage's work; fixed at 0 outside the spread level
    aux: dict[str, dict[Any, pulp.LpVariable]] = field(default_factory=dict)
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
        for (u, s, e), var in self.aux.get("z", {}).items():
            var.varValue = 1.0 if stage_of[u] <= e and s in cons.get(u, ()) else 0.0
        for s, var in self.w.items():
            vec = problem.variants[problem.stages[s].variant]
            ws = [vec.workspace[v] for v in range(problem.n) if stage_of[v] == s]
            var.varValue = max(ws, default=0.0) / self.w_unit[s]
        self.t_mem.varValue = max(pulp.value(e) or 0.0 for e in self.rank_mem)
        self.t_time.varValue = max(pulp.value(e) or 0.0 for e in self.rank_time)
        self.z_work.varValue = 0.0



def _scales(problem: Problem) -> tuple[float, float]:
    """Scales for memory and time: an upper bound of one stage's load over K."""
    ms, ts = 0.0, 0.0
    tot_static = float(sum(problem.static))
    for spec in problem.stages:
        vec = problem.variants[spec.variant]
        outs = float(sum(vec.out))
        ms = max(
            ms,
            tot_static + spec.inflight * float(sum(vec.act)) + max(spec.recv_factor, spec.send_factor) * outs
            + max(vec.workspace) + max(spec.skip_wait, default=0.0) * outs,
        )
        ts = max(ts, float(sum(vec.time)) + spec.link_s_per_byte * 2 * outs)
    # divided by K: the bottleneck is then of order 1 and so are the solver's tolerances
    k = problem.k
    return (ms / k if ms > 0 else 1.0), (ts / k if ts > 0 else 1.0)


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
    lo, hi, allowed = stage_ranges(problem)
    if use_cap and problem.mem_cap is not None:
        mem_ub = problem.mem_cap if mem_ub is None else min(mem_ub, problem.mem_cap)
    lo, hi = load_windows(problem, lo, hi, allowed, mem_ub=mem_ub, time_ub=time_ub)
    nm = lp_names(problem)
    prob = pulp.LpProblem(f"nowdl_partition_{problem.objective}_K{problem.k}", pulp.LpMinimize)
    mem_scale, time_scale = _scales(problem)
    y = _y_vars(prob, problem, lo, hi, allowed, nm)
    consumers: list[list[int]] = [[] for _ in range(problem.n)]
    for u, v in sorted(set(problem.edges)):
        consumers[u].append(v)
    lay = Layout(problem=problem, prob=prob, y=y, lo=lo, hi=hi, allowed=allowed, nm=nm, consumers=consumers,
                 mem_scale=mem_scale, time_scale=time_scale)
    _order_rows(lay)
    _tied_rows(lay)
    _nonempty_rows(lay)
    loads = StageLoads.empty(problem.k)
    for s in range(problem.k):
        add_stage_loads(lay, loads, s)
    model = _bottleneck_rows(lay, loads, use_cap and problem.mem_cap is not None)
    prob.setObjective(model.t_mem if problem.objective == "memory" else model.t_time)
    return model


def _y_vars(prob: pulp.LpProblem, problem: Problem, lo: list[int], hi: list[int], allowed: list[list[bool]],
            nm: list[str]) -> list[list[Y]]:
    """y[v][s+1] for s = -1..K-1: 0 below v's range, 1 from its end, else a binary variable
    (the previous entry where v may not use stage s)."""
    y: list[list[Y]] = []
    for v in range(problem.n):
        row: list[Y] = [0]
        for s in range(problem.k - 1):
            if s < lo[v]:
                row.append(0)
            elif s >= hi[v]:
                row.append(1)
            elif not allowed[v][s]:
                row.append(row[-1])  # x[v,s] = 0: same as the previous stage
            else:
                row.append(new_var(prob, f"y_{nm[v]}_s{s}", 0, 1, pulp.LpBinary))
        row.append(1)
        y.append(row)
    return y


def _order_rows(lay: Layout) -> None:
    """Monotonicity (y[v,s-1] <= y[v,s]) and precedence (an edge u->v: y[v,s] <= y[u,s])."""
    y, nm, k = lay.y, lay.nm, lay.problem.k
    for v in range(lay.problem.n):
        for s in range(1, k - 1):
            a, b = y[v][s], y[v][s + 1]
            if not isinstance(a, int) and not isinstance(b, int) and a is not b:
                add_constraint(lay.prob, [(a, 1.0), (b, -1.0)], pulp.LpConstraintLE, 0.0, f"mono_{nm[v]}_s{s}")
    seen: set[tuple[int, int]] = set()
    for u, v in sorted(set(lay.problem.edges)):  # as consumers[u] lists them
        for s in range(k - 1):
            a, b = y[v][s + 1], y[u][s + 1]
            key = (id(a), id(b))
            if isinstance(a, int) or isinstance(b, int) or key in seen:
                continue  # constants are consistent by construction of lo/hi
            seen.add(key)
            add_constraint(lay.prob, [(a, 1.0), (b, -1.0)], pulp.LpConstraintLE, 0.0, f"prec_{nm[u]}_{nm[v]}_s{s}")


def _tied_rows(lay: Layout) -> None:
    """Nodes using one weight share a stage: their y rows are equal."""
    y = lay.y
    for g, grp in enumerate(lay.problem.tied):
        for v in grp[1:]:
            for s in range(lay.problem.k - 1):
                add_constraint(lay.prob, [(y[grp[0]][s + 1], 1.0), (y[v][s + 1], -1.0)],
                               pulp.LpConstraintEQ, 0.0, f"tied{g}_{lay.nm[v]}_s{s}")


def _nonempty_rows(lay: Layout) -> None:
    """Every stage holds at least one node (an empty stage is a rank with nothing to do)."""
    k = lay.problem.k
    for s in range(k):
        terms = [t for v in range(lay.problem.n) if lay.can_be(v, s) for t in lay.in_stage(v, s)]
        if not terms:
            raise InfeasibleError(
                f"stage {s} of {k} can hold no node (pins, spatial rules and precedence leave it "
                "empty): use fewer stages"
            )
        add_constraint(lay.prob, terms, pulp.LpConstraintGE, 1.0, f"nonempty_s{s}")


def _bottleneck_rows(lay: Layout, loads: StageLoads, cap: bool) -> IlpModel:
    """T_mem and T_time above every rank's load (and, with ``cap``, the rank's memory under the
    cap); Z_work under every stage's work. The model without its objective."""
    prob, k = lay.prob, lay.problem.k
    t_mem = new_var(prob, "T_mem", 0, None)
    t_time = new_var(prob, "T_time", 0, None)
    z_work = new_var(prob, "Z_work", 0, 0)
    model = IlpModel(
        prob=prob, y=lay.y, t_mem=t_mem, t_time=t_time, mem_scale=lay.mem_scale, time_scale=lay.time_scale,
        rank_mem=[], rank_time=[], z_work=z_work, aux={"r": loads.r, "q": loads.q, "z": loads.z},
        w=loads.w, w_unit=loads.w_unit,
        stage_work=[pulp.LpAffineExpression([(a, c) for a, c in loads.work_lin[s].items() if c != 0.0],
                                            constant=loads.work_const[s]) for s in range(k)],
    )
    for s in range(k):
        add_constraint(prob, [(z_work, 1.0)] + [(a, -c) for a, c in loads.work_lin[s].items()],
                       pulp.LpConstraintLE, loads.work_const[s], f"spread_s{s}")
    for r_idx, stages in enumerate(lay.problem.rank_stages()):
        ml, mc = _rank_sum(loads.mem_lin, loads.mem_const, stages)
        tl, tc = _rank_sum(loads.time_lin, loads.time_const, stages)
        model.rank_mem.append(pulp.LpAffineExpression([(a, c) for a, c in ml.items() if c != 0.0], constant=mc))
        model.rank_time.append(pulp.LpAffineExpression([(a, c) for a, c in tl.items() if c != 0.0], constant=tc))
        add_constraint(prob, [(t_mem, 1.0)] + [(a, -c) for a, c in ml.items()],
                       pulp.LpConstraintGE, mc, f"mem_r{r_idx}")
        add_constraint(prob, [(t_time, 1.0)] + [(a, -c) for a, c in tl.items()],
                       pulp.LpConstraintGE, tc, f"time_r{r_idx}")
        if cap:
            add_constraint(prob, list(ml.items()), pulp.LpConstraintLE,
                           float(lay.problem.mem_cap or 0.0) / lay.mem_scale - mc, f"mem_cap_r{r_idx}")
    return model


def _rank_sum(lins: list[Lin], consts: list[float], stages: list[int]) -> tuple[Lin, float]:
    """One rank's load: the sum of its stages' (a stage listed twice, MASTER with odd K, counts twice)."""
    lin: Lin = {}
    const = 0.0
    for s in sorted(stages):
        for var, c in lins[s].items():
            lin[var] = lin.get(var, 0.0) + c
        const += consts[s]
    return lin, const
