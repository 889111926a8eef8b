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
from nowdl.partitioner.milp.stage_windows import load_windows
from nowdl.partitioner.milp.terms import (
    ConstantViolation,
    Lin,
    Y,
    add_constraint,
    add_term,
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
    n, k = problem.n, problem.k
    lo, hi, allowed = stage_ranges(problem)
    if use_cap and problem.mem_cap is not None:
        mem_ub = problem.mem_cap if mem_ub is None else min(mem_ub, problem.mem_cap)
    lo, hi = load_windows(problem, lo, hi, allowed, mem_ub=mem_ub, time_ub=time_ub)
    nm = lp_names(problem)
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
                row.append(new_var(prob, f"y_{nm[v]}_s{s}", 0, 1, pulp.LpBinary))
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
                add_constraint(prob, [(a, 1.0), (b, -1.0)], pulp.LpConstraintLE, 0.0,
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
                add_constraint(prob, [(a, 1.0), (b, -1.0)], pulp.LpConstraintLE, 0.0,
                            f"prec_{nm[u]}_{nm[v]}_s{s}")

    # nodes using one weight share a stage: their y rows are equal
    for g, grp in enumerate(problem.tied):
        for v in grp[1:]:
            for s in range(k - 1):
                add_constraint(prob, [(y[grp[0]][s + 1], 1.0), (y[v][s + 1], -1.0)],
                            pulp.LpConstraintEQ, 0.0, f"tied{g}_{nm[v]}_s{s}")

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
        add_constraint(prob, terms, pulp.LpConstraintGE, 1.0, f"nonempty_s{s}")

    mem_lin: list[Lin] = [{} for _ in range(k)]
    mem_const = [0.0] * k
    time_lin: list[Lin] = [{} for _ in range(k)]
    time_const = [0.0] * k
    work_lin: list[Lin] = [{} for _ in range(k)]
    work_const = [0.0] * k
    r_vars: dict[tuple[int, int], pulp.LpVariable] = {}
    q_vars: dict[tuple[int, int], pulp.LpVariable] = {}
    z_vars: dict[tuple[int, int, int], pulp.LpVariable] = {}
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
                mem_const[s] += add_term(mem_lin[s], e, sign * cm)
                time_const[s] += add_term(time_lin[s], e, sign * ct)
                work_const[s] += add_term(work_lin[s], e, sign * ct)
        # received tensors
        for u in range(n):
            out = vec.out[u]
            cm = spec.recv_factor * out / mem_scale
            ct = link * out / time_scale
            if out <= 0 or s == 0 or lo[u] > s - 1:
                continue
            cons = [v for v in consumers[u] if can_be(v, s)]
            if not cons:
                continue
            r = new_var(prob, f"r_{nm[u]}_s{s}", 0, 1)
            r_vars[(u, s)] = r
            for v in cons:  # r >= x[v,s] - x[u,s]
                add_constraint(
                    prob,
                    [(r, 1.0)] + [(e, -c) for e, c in in_stage(v, s)]
                    + [(e, c) for e, c in in_stage(u, s)],
                    pulp.LpConstraintGE, 0.0,
                    f"recv_{nm[u]}_{nm[v]}_s{s}",
                )
            mem_lin[s][r] = mem_lin[s].get(r, 0.0) + cm
            if ct > 0:
                time_lin[s][r] = time_lin[s].get(r, 0.0) + ct
            # long-skip gradients waiting here: wait_from(i) copies when u sits in stage i,
            # charged as sum over e >= i of (wait_from(e) - wait_from(e + 1)) [u in stage <= e]
            for e in range(max(lo[u], 0), s):
                step = spec.wait_from(e) - (spec.wait_from(e + 1) if e + 1 < s else 0.0)
                if step <= 0:
                    continue
                ye = y[u][e + 1]
                if isinstance(ye, int):  # u surely in a stage <= e (0: never, skipped by lo)
                    if ye:
                        mem_lin[s][r] += step * out / mem_scale
                    continue
                z = new_var(prob, f"z_{nm[u]}_s{s}_e{e}", 0, 1)
                z_vars[(u, s, e)] = z
                for v in cons:  # z >= x[v,s] + y[u,e] - 1
                    add_constraint(prob, [(z, 1.0), (ye, -1.0)] + [(t, -c) for t, c in in_stage(v, s)],
                                pulp.LpConstraintGE, -1.0, f"wait_{nm[u]}_{nm[v]}_s{s}_e{e}")
                mem_lin[s][z] = step * out / mem_scale
        # sent tensors: link time, and a buffer for their gradient per micro-batch in flight
        for u in range(n):
            out = vec.out[u]
            if out <= 0 or not can_be(u, s):
                continue
            cons = [v for v in consumers[u] if hi[v] > s]
            if not cons:
                continue
            q = new_var(prob, f"q_{nm[u]}_s{s}", 0, 1)
            q_vars[(u, s)] = q
            for v in cons:  # q >= x[u,s] - x[v,s]
                add_constraint(
                    prob,
                    [(q, 1.0)] + [(e, -c) for e, c in in_stage(u, s)]
                    + [(e, c) for e, c in in_stage(v, s)],
                    pulp.LpConstraintGE, 0.0,
                    f"send_{nm[u]}_{nm[v]}_s{s}",
                )
            if link > 0:
                time_lin[s][q] = time_lin[s].get(q, 0.0) + link * out / time_scale
            mem_lin[s][q] = mem_lin[s].get(q, 0.0) + spec.send_factor * out / mem_scale
        # workspace
        ws_nodes = [v for v in range(n) if vec.workspace[v] > 0 and can_be(v, s)]
        if ws_nodes:
            # in units of the stage's largest workspace, so the solver's tolerances stay
            # small against it
            unit = max(vec.workspace[v] for v in ws_nodes)
            w = new_var(prob, f"w_s{s}", 0, 1)
            w_vars[s] = w
            w_unit[s] = unit
            for v in ws_nodes:
                c = vec.workspace[v] / unit
                add_constraint(
                    prob,
                    [(w, 1.0)] + [(e, -c * sign) for e, sign in in_stage(v, s)],
                    pulp.LpConstraintGE, 0.0,
                    f"ws_{nm[v]}_s{s}",
                )
            mem_lin[s][w] = mem_lin[s].get(w, 0.0) + unit / mem_scale

    t_mem = new_var(prob, "T_mem", 0, None)
    t_time = new_var(prob, "T_time", 0, None)
    z_work = new_var(prob, "Z_work", 0, 0)
    rank_mem: list[pulp.LpAffineExpression] = []
    rank_time: list[pulp.LpAffineExpression] = []
    stage_work = [pulp.LpAffineExpression([(a, c) for a, c in work_lin[s].items() if c != 0.0],
                                          constant=work_const[s]) for s in range(k)]
    for s in range(k):
        add_constraint(prob, [(z_work, 1.0)] + [(a, -c) for a, c in work_lin[s].items()],
                    pulp.LpConstraintLE, work_const[s], f"spread_s{s}")
    for r_idx, stages in enumerate(problem.rank_stages()):
        ml: Lin = {}
        tl: Lin = {}
        mc = tc = 0.0
        for s in sorted(stages):  # a stage listed twice (MASTER, odd K: both replicas' copies) counts twice
            for lin, src in ((ml, mem_lin[s]), (tl, time_lin[s])):
                for var, c in src.items():
                    lin[var] = lin.get(var, 0.0) + c
            mc += mem_const[s]
            tc += time_const[s]
        me = pulp.LpAffineExpression([(a, c) for a, c in ml.items() if c != 0.0], constant=mc)
        te = pulp.LpAffineExpression([(a, c) for a, c in tl.items() if c != 0.0], constant=tc)
        rank_mem.append(me)
        rank_time.append(te)
        add_constraint(prob, [(t_mem, 1.0)] + [(a, -c) for a, c in ml.items()],
                    pulp.LpConstraintGE, mc, f"mem_r{r_idx}")
        add_constraint(prob, [(t_time, 1.0)] + [(a, -c) for a, c in tl.items()],
                    pulp.LpConstraintGE, tc, f"time_r{r_idx}")
        if use_cap and problem.mem_cap is not None:
            add_constraint(prob, list(ml.items()), pulp.LpConstraintLE,
                        problem.mem_cap / mem_scale - mc, f"mem_cap_r{r_idx}")
    prob.setObjective(t_mem if problem.objective == "memory" else t_time)
    return IlpModel(
        prob=prob, y=y, t_mem=t_mem, t_time=t_time, mem_scale=mem_scale,
        time_scale=time_scale, rank_mem=rank_mem, rank_time=rank_time, stage_work=stage_work,
        z_work=z_work, aux={"r": r_vars, "q": q_vars, "z": z_vars}, w=w_vars, w_unit=w_unit,
    )
