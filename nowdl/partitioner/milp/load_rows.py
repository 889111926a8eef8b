"""Each stage's load in the partitioning MILP: its memory, time and work as linear sums.

See [Note: ILP formulation] in ``model``: a stage pays its nodes' own costs, the tensors it
receives (r, and the long-skip gradients waiting on it, z), the tensors it sends (q) and its
largest workspace (w). Bytes and seconds are divided by ``model``'s scales.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulp

from nowdl.partitioner.costs.problem import NodeVectors, Problem, StageSpec
from nowdl.partitioner.milp.terms import Lin, Y, add_constraint, add_term, new_var

__all__ = ["Layout", "StageLoads", "add_stage_loads"]


@dataclass(frozen=True)
class Layout:
    """What every row of the model reads: the problem, the y variables and each node's stages.

    ``y[v][s + 1]`` for s = -1..K-1 is 0, 1 or a binary variable (stage(v) <= s); a node may
    sit in stage s only when ``lo[v] <= s <= hi[v]`` and ``allowed[v][s]``; ``nm`` are the
    nodes' LP names; ``consumers[u]`` the nodes reading u, sorted.
    """

    problem: Problem
    prob: pulp.LpProblem
    y: list[list[Y]]
    lo: list[int]
    hi: list[int]
    allowed: list[list[bool]]
    nm: list[str]
    consumers: list[list[int]]
    mem_scale: float
    time_scale: float

    def in_stage(self, v: int, s: int) -> list[tuple[Y, float]]:
        """x[v,s] = y[v,s] - y[v,s-1] as terms."""
        return [(self.y[v][s + 1], 1.0), (self.y[v][s], -1.0)]

    def can_be(self, v: int, s: int) -> bool:
        return self.lo[v] <= s <= self.hi[v] and self.allowed[v][s]


@dataclass
class StageLoads:
    """Per stage: memory, time and work (compute only) as a linear part plus a constant, in
    scale units; and the auxiliary variables r, q, z and w with each w's unit in bytes."""

    mem_lin: list[Lin]
    mem_const: list[float]
    time_lin: list[Lin]
    time_const: list[float]
    work_lin: list[Lin]
    work_const: list[float]
    r: dict[tuple[int, int], pulp.LpVariable] = field(default_factory=dict)
    q: dict[tuple[int, int], pulp.LpVariable] = field(default_factory=dict)
    z: dict[tuple[int, int, int], pulp.LpVariable] = field(default_factory=dict)
    w: dict[int, pulp.LpVariable] = field(default_factory=dict)
    w_unit: dict[int, float] = field(default_factory=dict)

    @classmethod
    def empty(cls, k: int) -> StageLoads:
        return cls(mem_lin=[{} for _ in range(k)], mem_const=[0.0] * k, time_lin=[{} for _ in range(k)],
                   time_const=[0.0] * k, work_lin=[{} for _ in range(k)], work_const=[0.0] * k)


def add_stage_loads(lay: Layout, loads: StageLoads, s: int) -> None:
    """Add stage ``s``'s rows and its memory, time and work terms."""
    spec = lay.problem.stages[s]
    vec = lay.problem.variants[spec.variant]
    _node_loads(lay, loads, s, spec, vec)
    for u in range(lay.problem.n):
        _received(lay, loads, s, spec, vec, u)
    for u in range(lay.problem.n):
        _sent(lay, loads, s, spec, vec, u)
    _workspace(lay, loads, s, vec)


def _node_loads(lay: Layout, loads: StageLoads, s: int, spec: StageSpec, vec: NodeVectors) -> None:
    """The nodes' own memory (static + in-flight activations) and compute time."""
    for v in range(lay.problem.n):
        if not lay.can_be(v, s):
            continue
        cm = (lay.problem.static[v] + spec.inflight * vec.act[v]) / lay.mem_scale
        ct = vec.time[v] / lay.time_scale
        for e, sign in lay.in_stage(v, s):
            loads.mem_const[s] += add_term(loads.mem_lin[s], e, sign * cm)
            loads.time_const[s] += add_term(loads.time_lin[s], e, sign * ct)
            loads.work_const[s] += add_term(loads.work_lin[s], e, sign * ct)


def _crossing(lay: Layout, var: str, row: str, u: int, s: int, cons: list[int], *, received: bool) -> pulp.LpVariable:
    """A binary that is 1 when u's output crosses stage s's border: received (``x[v,s] - x[u,s]``,
    a consumer v in s and u not) or sent (``x[u,s] - x[v,s]``), one row per consumer v."""
    x = new_var(lay.prob, f"{var}_{lay.nm[u]}_s{s}", 0, 1)
    for v in cons:
        into, out_of = (v, u) if received else (u, v)
        add_constraint(
            lay.prob,
            [(x, 1.0)] + [(e, -c) for e, c in lay.in_stage(into, s)] + [(e, c) for e, c in lay.in_stage(out_of, s)],
            pulp.LpConstraintGE, 0.0,
            f"{row}_{lay.nm[u]}_{lay.nm[v]}_s{s}",
        )
    return x


def _received(lay: Layout, loads: StageLoads, s: int, spec: StageSpec, vec: NodeVectors, u: int) -> None:
    """r[u,s] >= x[v,s] - x[u,s] for every consumer v: u's output received by stage s."""
    out = vec.out[u]
    cm = spec.recv_factor * out / lay.mem_scale
    ct = spec.link_s_per_byte * out / lay.time_scale
    if out <= 0 or s == 0 or lay.lo[u] > s - 1:
        return
    cons = [v for v in lay.consumers[u] if lay.can_be(v, s)]
    if not cons:
        return
    r = _crossing(lay, "r", "recv", u, s, cons, received=True)
    loads.r[(u, s)] = r
    mem = loads.mem_lin[s]
    mem[r] = mem.get(r, 0.0) + cm
    if ct > 0:
        loads.time_lin[s][r] = loads.time_lin[s].get(r, 0.0) + ct
    _skip_waits(lay, loads, s, spec, u, out, r, cons)


def _skip_waits(lay: Layout, loads: StageLoads, s: int, spec: StageSpec, u: int, out: float,
                r: pulp.LpVariable, cons: list[int]) -> None:
    """Long-skip gradients waiting at stage s: wait_from(i) copies when u sits in stage i,
    charged as sum over e >= i of (wait_from(e) - wait_from(e + 1)) [u in stage <= e]."""
    mem = loads.mem_lin[s]
    for e in range(max(lay.lo[u], 0), s):
        step = spec.wait_from(e) - (spec.wait_from(e + 1) if e + 1 < s else 0.0)
        if step <= 0:
            continue
        ye = lay.y[u][e + 1]
        if isinstance(ye, int):  # u surely in a stage <= e (0: never, skipped by lo)
            if ye:
                mem[r] += step * out / lay.mem_scale
            continue
        z = new_var(lay.prob, f"z_{lay.nm[u]}_s{s}_e{e}", 0, 1)
        loads.z[(u, s, e)] = z
        for v in cons:  # z >= x[v,s] + y[u,e] - 1
            add_constraint(lay.prob, [(z, 1.0), (ye, -1.0)] + [(t, -c) for t, c in lay.in_stage(v, s)],
                           pulp.LpConstraintGE, -1.0, f"wait_{lay.nm[u]}_{lay.nm[v]}_s{s}_e{e}")
        mem[z] = step * out / lay.mem_scale


def _sent(lay: Layout, loads: StageLoads, s: int, spec: StageSpec, vec: NodeVectors, u: int) -> None:
    """q[u,s] >= x[u,s] - x[v,s] for every consumer v: link time, and a buffer for the gradient
    of u's output per micro-batch in flight."""
    out = vec.out[u]
    if out <= 0 or not lay.can_be(u, s):
        return
    cons = [v for v in lay.consumers[u] if lay.hi[v] > s]
    if not cons:
        return
    q = _crossing(lay, "q", "send", u, s, cons, received=False)
    loads.q[(u, s)] = q
    link = spec.link_s_per_byte
    if link > 0:
        loads.time_lin[s][q] = loads.time_lin[s].get(q, 0.0) + link * out / lay.time_scale
    loads.mem_lin[s][q] = loads.mem_lin[s].get(q, 0.0) + spec.send_factor * out / lay.mem_scale


def _workspace(lay: Layout, loads: StageLoads, s: int, vec: NodeVectors) -> None:
    """w[s] >= ws[v] x[v,s]: the stage's largest workspace."""
    ws_nodes = [v for v in range(lay.problem.n) if vec.workspace[v] > 0 and lay.can_be(v, s)]
    if not ws_nodes:
        return
    # in units of the stage's largest workspace, so the solver's tolerances stay small against it
    unit = max(vec.workspace[v] for v in ws_nodes)
    w = new_var(lay.prob, f"w_s{s}", 0, 1)
    loads.w[s] = w
    loads.w_unit[s] = unit
    for v in ws_nodes:
        c = vec.workspace[v] / unit
        add_constraint(
            lay.prob,
            [(w, 1.0)] + [(e, -c * sign) for e, sign in lay.in_stage(v, s)],
            pulp.LpConstraintGE, 0.0,
            f"ws_{lay.nm[v]}_s{s}",
        )
    loads.mem_lin[s][w] = loads.mem_lin[s].get(w, 0.0) + unit / lay.mem_scale
