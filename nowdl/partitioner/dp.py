"""Exact dynamic program over contiguous splits of one topological order (the ILP's fallback).

[Note: DP family] The stages are contiguous segments of a fixed topological order, which
always respects precedence. Because a segment's received and sent tensors depend only on
its two ends, every stage's memory and time is a function of (start, end): the DP
``f[s][b] = min_a max(f[s-1][a], cost_s(a, b))`` is then exact for that family when every
rank holds one stage. With MASTER pairing (rank r holds stages r and K-1-r) rank loads are
not a function of one segment, so the DP minimises the per-stage bottleneck instead and the
rank loads are evaluated afterwards (a heuristic there, flagged in ``Partition.status``).
Ties on the primary quantity are broken by a second exact DP restricted to segments whose
primary cost stays within the optimum. Costs are (n+1) x (n+1) matrices built with numpy
(2D difference arrays for boundary tensors), so n up to a few thousand is fine.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Sequence

import numpy as np

from nowdl.errors import InfeasibleError
from nowdl.partitioner.problem import Partition, Problem, evaluate

__all__ = [
    "solve_dp",
    "check_problem",
    "topological_order",
    "stage_ranges",
    "make_partition",
    "objective_values",
    "rank_loads",
]

log = logging.getLogger(__name__)

_REL_TIE = 1e-9  # relative slack when the tie-break pass keeps the primary optimum


def check_problem(problem: Problem) -> None:
    """Check that a Problem is well formed (sizes, indices, acyclicity, non-negative costs).

    Args:
        problem: the problem to check.

    Raises:
        ValueError: naming the first inconsistency found and the numbers involved.
    """
    n, k = problem.n, problem.k
    if n < 1:
        raise ValueError("problem has no nodes (names is empty)")
    if k < 1:
        raise ValueError("problem has no stages (stages is empty)")
    if len(set(problem.names)) != n:
        raise ValueError("node names must be unique")
    if len(problem.static) != n:
        raise ValueError(f"static has {len(problem.static)} entries, expected one per node ({n})")
    if problem.tileable and len(problem.tileable) != n:
        raise ValueError(
            f"tileable has {len(problem.tileable)} entries, expected 0 (all tileable) or {n}"
        )
    for key, vec in problem.variants.items():
        for field_name in ("act", "time", "workspace", "out"):
            values = getattr(vec, field_name)
            if len(values) != n:
                raise ValueError(
                    f"variant {key!r}: {field_name} has {len(values)} entries, expected {n}"
                )
            for i, x in enumerate(values):
                if not (math.isfinite(x) and x >= 0):
                    raise ValueError(
                        f"variant {key!r}: {field_name}[{problem.names[i]}] = {x} "
                        "(costs must be finite and >= 0)"
                    )
    for i, x in enumerate(problem.static):
        if not (math.isfinite(x) and x >= 0):
            raise ValueError(f"static[{problem.names[i]}] = {x} (costs must be finite and >= 0)")
    for s, spec in enumerate(problem.stages):
        if spec.variant not in problem.variants:
            raise ValueError(
                f"stage {s} uses variant {spec.variant!r}, not one of {sorted(problem.variants)}"
            )
        if spec.inflight < 0 or not math.isfinite(spec.link_s_per_byte) or spec.link_s_per_byte < 0:
            raise ValueError(
                f"stage {s}: inflight ({spec.inflight}) and link_s_per_byte "
                f"({spec.link_s_per_byte}) must be >= 0"
            )
    for u, v in problem.edges:
        if not (0 <= u < n and 0 <= v < n):
            raise ValueError(f"edge ({u}, {v}) has an index outside 0..{n - 1}")
        if u == v:
            raise ValueError(f"edge ({u}, {v}) is a self-loop on {problem.names[u]}")
    if problem.objective not in ("memory", "compute"):
        raise ValueError(f"objective is {problem.objective!r}, expected 'memory' or 'compute'")
    if problem.mem_cap is not None and not (problem.mem_cap > 0):
        raise ValueError(f"mem_cap must be > 0 bytes or None (got {problem.mem_cap})")
    for v, s in problem.pinned.items():
        if not 0 <= v < n:
            raise ValueError(f"pinned node index {v} outside 0..{n - 1}")
        if not 0 <= s < k:
            raise ValueError(f"node {problem.names[v]} is pinned to stage {s}, outside 0..{k - 1}")
    covered: set[int] = set()
    for r, stages in enumerate(problem.rank_stages()):
        if not stages:
            raise ValueError(f"rank {r} holds no stage")
        for s in stages:
            if not 0 <= s < k:
                raise ValueError(f"rank {r} holds stage {s}, outside 0..{k - 1}")
        covered.update(stages)
    if len(covered) != k:
        missing = sorted(set(range(k)) - covered)
        raise ValueError(f"stages {missing} are held by no rank")
    topological_order(problem)  # raises on a cycle


def topological_order(problem: Problem) -> list[int]:
    """A deterministic topological order: index order if it is one, else Kahn (smallest first).

    Args:
        problem: the problem whose DAG is ordered.

    Returns:
        The node indices in an order where every edge goes forward.

    Raises:
        ValueError: if the graph has a cycle.
    """
    n = problem.n
    if all(u < v for u, v in problem.edges):
        return list(range(n))
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for u, v in set(problem.edges):
        succ[u].append(v)
        indeg[v] += 1
    heap = [v for v in range(n) if indeg[v] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        u = heapq.heappop(heap)
        order.append(u)
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, v)
    if len(order) != n:
        stuck = [problem.names[v] for v in range(n) if indeg[v] > 0][:5]
        raise ValueError(f"the graph has a cycle through {stuck}")
    return order


def _tileable(problem: Problem) -> list[bool]:
    return [bool(t) for t in problem.tileable] if problem.tileable else [True] * problem.n


def _allowed(problem: Problem, v: int, tile: Sequence[bool]) -> list[bool]:
    k = problem.k
    if v in problem.pinned:
        ok = [s == problem.pinned[v] for s in range(k)]
    else:
        ok = [True] * k
    if not tile[v]:
        ok = [a and not problem.stages[s].spatial for s, a in enumerate(ok)]
    return ok


def stage_ranges(problem: Problem) -> tuple[list[int], list[int], list[list[bool]]]:
    """Earliest and latest feasible stage of every node under precedence, pins and tiling.

    The earliest stage is found greedily in topological order (the smallest allowed stage
    not before any producer's earliest stage); a feasible assignment exists exactly when
    that greedy never runs out of stages, because any feasible assignment is pointwise at
    least the greedy one.

    Args:
        problem: a checked problem.

    Returns:
        (lo, hi, allowed): every feasible assignment has lo[v] <= stage(v) <= hi[v] and
        allowed[v][stage(v)]; assigning every node lo[v] is itself feasible.

    Raises:
        InfeasibleError: if no assignment respects pins, tileability and precedence.
    """
    n, k = problem.n, problem.k
    tile = _tileable(problem)
    order = topological_order(problem)
    preds: list[list[int]] = [[] for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for u, v in problem.edges:
        preds[v].append(u)
        succs[u].append(v)
    allowed = [_allowed(problem, v, tile) for v in range(n)]
    lo = [0] * n
    for v in order:
        start = max((lo[u] for u in preds[v]), default=0)
        cand = [s for s in range(start, k) if allowed[v][s]]
        if not cand:
            raise InfeasibleError(_structural_message(problem, v, start, preds[v], lo, tile))
        lo[v] = cand[0]
    hi = [k - 1] * n
    for v in reversed(order):
        end = min((hi[w] for w in succs[v]), default=k - 1)
        cand = [s for s in range(0, end + 1) if allowed[v][s]]
        hi[v] = cand[-1]  # non-empty: lo[v] <= end and allowed
    return lo, hi, allowed


def _structural_message(
    problem: Problem, v: int, start: int, preds: list[int], lo: list[int], tile: list[bool]
) -> str:
    name = problem.names[v]
    k = problem.k
    why = []
    if v in problem.pinned:
        why.append(f"it is pinned to stage {problem.pinned[v]}")
    if not tile[v]:
        spatial = [s for s in range(k) if problem.stages[s].spatial]
        why.append(f"it is not tileable and stages {spatial} are spatial")
    late = [problem.names[u] for u in preds if lo[u] == start]
    before = (
        f"its producer {late[0]} cannot be placed before stage {start}" if late and start > 0 else ""
    )
    parts = "; ".join(why + ([before] if before else []))
    return (
        f"No placement of the {problem.n} nodes into {k} stages respects precedence, pins and "
        f"tileability: node {name} has no allowed stage in {start}..{k - 1} ({parts}). "
        "This does not depend on memory: move or remove the pin, make a non-spatial stage "
        "available after the spatial ones, or mark the node tileable."
    )


def rank_loads(problem: Problem, stage_vals: Sequence[float]) -> list[float]:
    """Sum a per-stage quantity over the stages each rank holds.

    A stage listed twice counts twice: with MASTER and an odd stage count the middle rank
    holds both replicas' copies of the middle stage.

    Args:
        problem: the problem (its ``rank_stages()``).
        stage_vals: one value per stage.

    Returns:
        One value per rank.
    """
    return [sum(stage_vals[s] for s in st) for st in problem.rank_stages()]


def make_partition(
    problem: Problem,
    stage_of: Sequence[int],
    *,
    solver: str = "",
    status: str = "",
    gap: float = 0.0,
    seconds: float = 0.0,
) -> Partition:
    """Evaluate an assignment with ``evaluate()`` and wrap it in a Partition.

    Args:
        problem: the problem.
        stage_of: stage of every node.
        solver: solver name to record.
        status: status to record.
        gap: relative gap of the primary objective.
        seconds: wall time to record.

    Returns:
        The Partition, with stage and rank loads from the reference cost model.
    """
    mem, tim = evaluate(problem, stage_of)
    return Partition(
        stage_of=[int(s) for s in stage_of],
        stage_mem=mem,
        stage_time=tim,
        rank_mem=rank_loads(problem, mem),
        rank_time=rank_loads(problem, tim),
        solver=solver,
        status=status,
        gap=gap,
        seconds=seconds,
    )


def objective_values(problem: Problem, part: Partition) -> tuple[float, float]:
    """(primary, secondary) bottlenecks of a partition for the problem's objective.

    Args:
        problem: the problem (its ``objective``).
        part: a partition of it.

    Returns:
        (bottleneck of the objective quantity, bottleneck of the other one).
    """
    if problem.objective == "memory":
        return part.bottleneck_mem, part.bottleneck_time
    return part.bottleneck_time, part.bottleneck_mem


def _one_to_one(problem: Problem) -> bool:
    return sorted(len(set(st)) for st in problem.rank_stages()) == [1] * problem.k


class _SegmentCosts:
    """Memory and time of every segment [a, b) of an order, per kind of stage."""

    def __init__(self, problem: Problem, order: Sequence[int]) -> None:
        n = problem.n
        self.problem = problem
        self.n = n
        pos = [0] * n
        for i, v in enumerate(order):
            pos[v] = i
        self.static = np.concatenate([[0.0], np.cumsum([problem.static[v] for v in order])])
        tile = _tileable(problem)
        # next_nt[a] = position of the first non-tileable node at or after a (n if none)
        next_nt = np.full(n + 1, n, dtype=np.int64)
        for i in range(n - 1, -1, -1):
            next_nt[i] = i if not tile[order[i]] else next_nt[i + 1]
        self.next_nt = next_nt
        consumers: list[set[int]] = [set() for _ in range(n)]
        for u, v in problem.edges:
            consumers[u].add(pos[v])
        self.cons_pos = [sorted(consumers[v]) for v in order]  # by position of producer
        self.order = list(order)
        self.lower = np.tril(np.ones((n + 1, n + 1), dtype=bool), k=-1)  # a > b
        self._var: dict[str, tuple[np.ndarray, ...]] = {}
        self._kind: dict[tuple[str, int, float, bool], tuple[np.ndarray, np.ndarray]] = {}

    def prefix_bounds(self) -> tuple[list[int], list[int]]:
        """For each s, the range of b such that the prefix [0, b) can be stages 0..s."""
        k, n = self.problem.k, self.n
        bmin, bmax = [0] * k, [n] * k
        for v, st in self.problem.pinned.items():
            i = next(j for j, w in enumerate(self.order) if w == v)
            for s in range(k):
                if st <= s:
                    bmin[s] = max(bmin[s], i + 1)
                else:
                    bmax[s] = min(bmax[s], i)
        return bmin, bmax

    def variant(self, key: str) -> tuple[np.ndarray, ...]:
        """(prefix act, prefix time, workspace max, received bytes, sent bytes) matrices."""
        if key in self._var:
            return self._var[key]
        vec = self.problem.variants[key]
        n = self.n
        order = self.order
        act = np.concatenate([[0.0], np.cumsum([vec.act[v] for v in order])])
        tim = np.concatenate([[0.0], np.cumsum([vec.time[v] for v in order])])
        ws = np.array([vec.workspace[v] for v in order], dtype=float)
        wmax = np.zeros((n + 1, n + 1))
        for a in range(n):
            wmax[a, a + 1 :] = np.maximum.accumulate(ws[a:])
        out = [vec.out[v] for v in order]
        # received: producer at p, consumers c1 < ... < cm: +out for a in (c_{i-1}, c_i], b > c_i
        ra: list[int] = []
        rb: list[int] = []
        rw: list[float] = []
        # sent: +out for a <= p < b <= last consumer
        sa: list[int] = []
        sb: list[int] = []
        sw: list[float] = []
        for p in range(n):
            cs = self.cons_pos[p]
            w = out[p]
            if not cs or w == 0.0:
                continue
            prev = p
            for c in cs:
                ra += [prev + 1, c + 1]
                rb += [c + 1, c + 1]
                rw += [w, -w]
                prev = c
            last = cs[-1]
            sa += [0, 0, p + 1, p + 1]
            sb += [p + 1, last + 1, p + 1, last + 1]
            sw += [w, -w, -w, w]
        recv = self._accumulate(ra, rb, rw)
        sent = self._accumulate(sa, sb, sw)
        self._var[key] = (act, tim, wmax, recv, sent)
        return self._var[key]

    def _accumulate(self, a: list[int], b: list[int], w: list[float]) -> np.ndarray:
        n = self.n
        d = np.zeros((n + 2, n + 2))
        if a:
            np.add.at(d, (np.array(a), np.array(b)), np.array(w))
        np.cumsum(d, axis=1, out=d)
        np.cumsum(d, axis=0, out=d)
        return d[: n + 1, : n + 1]

    def stage(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """(memory, time) of stage s for every segment [a, b): inf where a > b or the
        segment holds a non-tileable node and s is spatial (pins: ``prefix_bounds``)."""
        spec = self.problem.stages[s]
        key = (spec.variant, spec.inflight, spec.link_s_per_byte, spec.spatial)
        if key in self._kind:
            return self._kind[key]
        act, tim, wmax, recv, sent = self.variant(spec.variant)
        st = self.static
        mem = np.subtract.outer(act, act).T
        mem += recv
        mem += sent  # a buffer for the gradient of every tensor sent, per micro-batch in flight
        mem *= spec.inflight
        mem += st[None, :]
        mem -= st[:, None]
        mem += wmax
        tt = recv + sent
        tt *= spec.link_s_per_byte
        tt += tim[None, :]
        tt -= tim[:, None]
        bad = self.lower
        if spec.spatial:
            idx = np.arange(self.n + 1)
            bad = bad | (idx[None, :] > self.next_nt[:, None])
        mem[bad] = np.inf
        tt[bad] = np.inf
        self._kind[key] = (mem, tt)
        return mem, tt


def _minmax_dp(
    costs: list[np.ndarray], bmin: Sequence[int], bmax: Sequence[int], *, nonempty: bool = True
) -> tuple[float, list[int]]:
    """min over cuts of max_s costs[s][cut[s], cut[s+1]] (cut[0]=0, cut[K]=n), with
    bmin[s] <= cut[s+1] <= bmax[s]; with ``nonempty`` every segment holds an element."""
    k = len(costs)
    n = costs[0].shape[0] - 1
    cols = np.arange(n + 1)
    f = costs[0][0, :].copy()
    if nonempty:
        f[0] = np.inf  # stages are never empty
    f[: bmin[0]] = np.inf
    f[bmax[0] + 1 :] = np.inf
    args: list[np.ndarray] = []
    for s in range(1, k):
        cand = np.maximum(f[:, None], costs[s])
        if nonempty:
            cand[np.tril_indices(n + 1)] = np.inf  # segment [a, b) must hold a node: a < b
        arg = np.argmin(cand, axis=0)  # first minimiser: deterministic
        f = cand[arg, cols]
        f[: bmin[s]] = np.inf
        f[bmax[s] + 1 :] = np.inf
        args.append(arg)
    best = float(f[n])
    cuts = [n]
    b = n
    for s in range(k - 1, 0, -1):
        b = int(args[s - 1][b])
        cuts.append(b)
    cuts.append(0)
    cuts.reverse()
    return best, cuts


def solve_dp(problem: Problem, order: Sequence[int] | None = None) -> Partition:
    """Best split of a topological order into K contiguous stages (exact over that family).

    Minimises the bottleneck of ``problem.objective`` over ranks subject to ``mem_cap``,
    then the other quantity's bottleneck among the optima. With ranks that hold several
    stages (MASTER) it minimises the per-stage bottleneck instead and evaluates the ranks
    afterwards; the status then reads "heuristic" (see [Note: DP family]). Time O(K n^2)
    with numpy, memory a few (n+1)^2 float matrices per kind of stage.

    Example:
        >>> part = solve_dp(problem)
        >>> part.stage_of[:5], part.bottleneck_time

    Args:
        problem: the problem.
        order: a topological order of the nodes (default: ``topological_order(problem)``).

    Returns:
        The Partition, evaluated with ``evaluate()``; solver "dp".

    Raises:
        ValueError: if the problem is malformed or ``order`` is not a topological order.
        InfeasibleError: if no contiguous split of this order respects pins, tileability
            and the memory cap.
    """
    return _solve_dp(problem, order, explain=True)


def _solve_dp(problem: Problem, order: Sequence[int] | None, *, explain: bool) -> Partition:
    t0 = time.perf_counter()
    check_problem(problem)
    n, k = problem.n, problem.k
    if order is None:
        order = topological_order(problem)
    order = [int(v) for v in order]
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must be a permutation of 0..{n - 1}")
    pos = {v: i for i, v in enumerate(order)}
    for u, v in problem.edges:
        if pos[u] > pos[v]:
            raise ValueError(
                f"order is not topological: {problem.names[u]} comes after its consumer "
                f"{problem.names[v]}"
            )
    seg = _SegmentCosts(problem, order)
    bmin, bmax = seg.prefix_bounds()
    exact = _one_to_one(problem)
    cap = problem.mem_cap
    caps: list[float | None] = [cap]
    if cap is not None and not exact:
        caps.append(cap / max(len(set(r)) for r in problem.rank_stages()))
    last_err = "no contiguous split of the order respects pins and tileability"
    for stage_cap in caps:
        cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        prim: list[np.ndarray] = []
        sec: list[np.ndarray] = []
        for s in range(k):
            mem, tt = seg.stage(s)
            key = id(mem)
            if key not in cache:
                p, q = (mem, tt) if problem.objective == "memory" else (tt, mem)
                if stage_cap is not None:
                    over = mem > stage_cap
                    p = np.where(over, np.inf, p)
                    q = np.where(over, np.inf, q)
                cache[key] = (p, q)
            prim.append(cache[key][0])
            sec.append(cache[key][1])
        best, cuts = _minmax_dp(prim, bmin, bmax)
        if not math.isfinite(best):
            if stage_cap is not None:
                last_err = "no contiguous split of the order respects pins, tileability and the cap"
            continue
        limit = best * (1 + _REL_TIE)
        cache2: dict[int, np.ndarray] = {}
        sec2 = []
        for p, q in zip(prim, sec, strict=True):
            if id(p) not in cache2:
                cache2[id(p)] = np.where(p <= limit, q, np.inf)
            sec2.append(cache2[id(p)])
        best2, cuts2 = _minmax_dp(sec2, bmin, bmax)
        if math.isfinite(best2):
            cuts = cuts2
        stage_of = [0] * n
        for s in range(k):
            for i in range(cuts[s], cuts[s + 1]):
                stage_of[order[i]] = s
        status = "optimal" if exact else "heuristic"
        part = make_partition(
            problem, stage_of, solver="dp", status=status, seconds=time.perf_counter() - t0
        )
        if cap is not None and part.bottleneck_mem > cap * (1 + 1e-9):
            last_err = f"the best split found needs {part.bottleneck_mem:.6g} bytes on one rank"
            continue
        log.debug("dp: n=%d K=%d primary=%.6g (%s) in %.2f s", n, k, best, status, part.seconds)
        return part
    msg = last_err
    if explain:
        msg = _dp_infeasible_message(problem, order, last_err)
    raise InfeasibleError(msg)


def _dp_infeasible_message(problem: Problem, order: Sequence[int], why: str) -> str:
    detail = why
    if problem.mem_cap is not None:
        relaxed = Problem(
            names=problem.names,
            edges=problem.edges,
            static=problem.static,
            variants=problem.variants,
            stages=problem.stages,
            tileable=problem.tileable,
            ranks=problem.ranks,
            objective="memory",
            mem_cap=None,
            pinned=problem.pinned,
        )
        try:
            best = _solve_dp(relaxed, order, explain=False)
        except InfeasibleError:
            pass
        else:
            need = best.bottleneck_mem
            detail = (
                f"{why}: the cap is {problem.mem_cap:.6g} bytes "
                f"({problem.mem_cap / 2**30:.3f} GiB) and the smallest largest-rank memory of "
                f"a contiguous split of this order is {need:.6g} bytes ({need / 2**30:.3f} GiB); "
                f"raise the cap to at least {need:.6g} bytes or use more GPUs/stages"
            )
    return (
        f"The DP over one topological order found no feasible split of {problem.n} nodes into "
        f"{problem.k} stages ({detail}). The DP only considers contiguous splits of one "
        "order; the ILP (solve_ilp) searches all convex splits."
    )
