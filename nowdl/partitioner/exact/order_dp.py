"""Exact dynamic program over contiguous splits of one topological order (the ILP's fallback).

[Note: DP family] The stages are contiguous segments of a fixed topological order, which
always respects precedence. Because a segment's received and sent tensors depend only on
its two ends, every stage's memory and time is a function of (start, end): the DP
``f[s][b] = min_a max(f[s-1][a], cost_s(a, b))`` is then exact for that family when every
rank holds one stage. With MASTER pairing (rank r holds stages r and K-1-r) rank loads are
not a function of one segment, so the DP minimises the per-stage bottleneck instead and the
rank loads are evaluated afterwards (a heuristic there, flagged in ``Partition.status``).
Ties on the primary quantity and the spread of the work are the later levels of
[Note: lexicographic levels] (``chain``); MASTER splits are then improved by
[Note: MASTER descent]. Costs are (n+1) x (n+1) matrices built with numpy (2D difference
arrays for boundary tensors), so n up to a few thousand is fine.

The helpers every solver shares (``check_problem``, ``topological_order``, ``stage_ranges``,
``make_partition``, ...) live in ``structure`` and are re-exported here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence

import numpy as np

from nowdl.errors import InfeasibleError
from nowdl.partitioner.chain.chain_dp import CAP_REL, lexicographic
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.structure import (
    check_problem,
    checked_order,
    make_partition,
    one_to_one,
    tileable_mask,
)
from nowdl.partitioner.master.pairing import master_split, standard_pairing

__all__ = ["solve_dp", "minmax_dp"]

log = logging.getLogger(__name__)


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
        tile = tileable_mask(problem)
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
        self._kind: dict[tuple[str, int, float, float, float, bool], tuple[np.ndarray, np.ndarray]] = {}

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
        key = (spec.variant, spec.inflight, spec.recv_factor, spec.send_factor, spec.link_s_per_byte, spec.spatial)
        if key in self._kind:
            return self._kind[key]
        act, tim, wmax, recv, sent = self.variant(spec.variant)
        st = self.static
        mem = np.subtract.outer(act, act).T
        mem *= spec.inflight
        mem += spec.recv_factor * recv
        mem += spec.send_factor * sent  # buffers for the gradients of the tensors sent
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


class _OrderCosts:
    """``chain.ChainCosts`` over the cut positions 0..n of one order (see [Note: DP family])."""

    def __init__(self, problem: Problem, seg: _SegmentCosts, cap: float | None) -> None:
        self.problem = problem
        self.seg = seg
        self.cap = cap
        self.k = problem.k
        n = seg.n
        self.start, self.end = 0, n
        bmin, bmax = seg.prefix_bounds()
        idx = np.arange(n + 1)
        whole = np.ones(n + 1, dtype=bool)  # no cut between two uses of one weight
        pos = {v: i for i, v in enumerate(seg.order)}
        for grp in problem.tied:
            first, last = min(pos[v] for v in grp), max(pos[v] for v in grp)
            whole[first + 1:last + 1] = False
        self.allowed: list[np.ndarray | None] = [
            (idx >= bmin[s]) & (idx <= bmax[s]) & whole for s in range(problem.k - 1)
        ]
        # prefix sums of each node's cheapest primary load (a lower bound of any segment's)
        per_stage = []
        for spec in problem.stages:
            vec = problem.variants[spec.variant]
            if problem.objective == "memory":
                per_stage.append(np.asarray(problem.static, float)
                                 + spec.inflight * np.asarray(vec.act, float))
            else:
                per_stage.append(np.asarray(vec.time, float))
        cheap = np.min(np.vstack(per_stage), axis=0)[seg.order]
        self._cheap = np.concatenate([[0.0], np.cumsum(cheap)])

    def rows(self, s: int, a: np.ndarray, lo: int, hi: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        mem_all, tt_all = self.seg.stage(s)
        tim = self.seg.variant(self.problem.stages[s].variant)[1]
        mem = mem_all[a, lo:hi]
        tt = tt_all[a, lo:hi]
        work = tim[None, lo:hi] - tim[a][:, None]
        bad = np.arange(lo, hi)[None, :] <= a[:, None]  # every stage holds a node
        if self.cap is not None:
            bad |= mem > self.cap * (1 + CAP_REL)
        mem[bad] = np.inf
        tt[bad] = np.inf
        work[bad] = np.inf
        if self.problem.objective == "memory":
            return mem, tt, work
        return tt, mem, work

    def window(self, a: np.ndarray, bound: float) -> tuple[int, int]:
        lo = int(a.min()) + 1
        if not math.isfinite(bound):
            return lo, self.end + 1
        top = float(self._cheap[int(a.max())]) + bound
        return lo, int(np.searchsorted(self._cheap, top + 1e-9 * abs(top), side="right"))

    def upper_bound(self) -> float:
        """The primary bottleneck of equal-cost cuts of the order."""
        total, n = float(self._cheap[-1]), self.end
        cuts = [0]
        for s in range(1, self.k):
            j = int(np.searchsorted(self._cheap, total * s / self.k, side="left"))
            cuts.append(min(max(j, cuts[-1] + 1), n - (self.k - s)))
        cuts.append(n)
        if any(b <= a for a, b in zip(cuts, cuts[1:], strict=False)) or any(
            m is not None and not m[c] for m, c in zip(self.allowed, cuts[1:-1], strict=True)
        ):
            return math.inf
        return max(float(self.rows(s, np.array([cuts[s]]), cuts[s + 1], cuts[s + 1] + 1)[0][0, 0])
                   for s in range(self.k))


def minmax_dp(
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


def solve_dp(problem: Problem, order: Sequence[int] | None = None, *, explain: bool = True) -> Partition:
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
        explain: an InfeasibleError over the cap names the cap that fits (solving again
            without it); False: it says only why.

    Returns:
        The Partition, evaluated with ``evaluate()``; solver "dp".

    Raises:
        ValueError: if the problem is malformed or ``order`` is not a topological order.
        InfeasibleError: if no contiguous split of this order respects pins, tileability
            and the memory cap.
    """
    t0 = time.perf_counter()
    check_problem(problem)
    n, k = problem.n, problem.k
    order = checked_order(problem, order)
    seg = _SegmentCosts(problem, order)
    exact = one_to_one(problem)
    cap = problem.mem_cap
    caps: list[float | None] = [cap]
    if cap is not None and not exact:
        caps.append(cap / max(len(r) for r in problem.rank_stages()))
    last_err = "no contiguous split of the order respects pins and tileability"
    for stage_cap in caps:
        costs = _OrderCosts(problem, seg, stage_cap)
        res = lexicographic(costs)
        if res is None:
            if stage_cap is not None:
                last_err = "no contiguous split of the order respects pins, tileability and the cap"
            continue
        cuts = res.cuts
        if not exact and standard_pairing(problem.rank_stages(), k):
            got = master_split(_OrderCosts(problem, seg, None),
                               mem_is_prim=problem.objective == "memory",
                               cap=None if cap is None else cap * (1 + CAP_REL))
            cuts = got[0] if got is not None else cuts
        stage_of = [0] * n
        for s in range(k):
            for i in range(cuts[s], cuts[s + 1]):
                stage_of[order[i]] = s
        status = "optimal" if exact else "heuristic"
        part = make_partition(
            problem, stage_of, solver="dp", status=status, seconds=time.perf_counter() - t0
        )
        if cap is not None and part.bottleneck_mem > cap * (1 + CAP_REL):
            last_err = f"the best split found needs {part.bottleneck_mem:.6g} bytes on one rank"
            continue
        log.debug("dp: n=%d K=%d primary=%.6g (%s) in %.2f s", n, k, res.primary, status,
                  part.seconds)
        return part
    msg = last_err
    if explain:
        msg = _dp_infeasible_message(problem, order, last_err)
    raise InfeasibleError(msg)


def _dp_infeasible_message(problem: Problem, order: Sequence[int], why: str) -> str:
    detail = why
    if problem.mem_cap is not None:
        relaxed = dataclasses.replace(problem, objective="memory", mem_cap=None)
        try:
            best = solve_dp(relaxed, order, explain=False)
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
