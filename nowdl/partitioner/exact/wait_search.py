"""Exact split over the ideals with long-skip gradient waits: branch and bound on chains.

[Note: wait search] The DP over ideals ([Note: ideal DP]) cannot charge the waits of
[Note: long-skip gradient waits]: a stage's waits depend on the stage each received tensor
was made in, not only on the stage's own two ideals. Depth-first over chains
``D_0 < D_1 < ... < D_K`` they are known: the nodes of ``D_s`` already have their stages.
:func:`solve_waits` walks the chains stage by stage, each step's cost with its waits, and
prunes a step whose cost, or the best the rest of the chain could do *without* waits (a
backward DP over the same ideals; waits only add), cannot beat the best chain found. Steps
are tried cheapest bound first, starting from the DP's own split as the incumbent. The
levels of [Note: lexicographic levels] run the same way, each with the earlier ones held.

Level 1 is searched exactly first, on half the budget of steps, then, if that ran out, up
to ``gap`` (the MILP's ``mip_gap``: a chain is pruned when its bound is within that of the
incumbent; the proven gap is reported); the later levels exactly. Past the budget, level 1
gives up (None: the caller runs the MILP) and a later level keeps its best chain so far. On the MONAI UNet-like nets at K = 8
(50-230 ideals) it replaces MILPs of 1-3 s.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from nowdl.partitioner.chain.chain_dp import REL_TOL, spread_ok
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.structure import make_partition
from nowdl.partitioner.exact.downsets import Lattice
from nowdl.partitioner.exact.ideal_dp import IdealCosts

__all__ = ["solve_waits", "STEP_BUDGET"]

STEP_BUDGET = 200_000  # chain steps (rows looked at) all levels together may take (a few seconds)
_ROW_FLOATS = 8_000_000  # floats of cached rows kept at most (64 MB)

Level = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]  # (mem-first loads) -> objective


class _Budget(Exception):
    """The step budget ran out."""


class _Chains:
    """Stage rows without waits (cached), the waits a history adds, and the search itself."""

    def __init__(self, problem: Problem, lat: Lattice, bases: dict[tuple[object, ...], object] | None,
                 budget: int, deadline: float) -> None:
        self.p, self.lat = problem, lat
        self.c = IdealCosts(problem, lat, bases=bases)
        self.k, self.n_ideals = problem.k, lat.size
        self.mem_first = problem.objective == "memory"
        self.cap = problem.mem_cap
        self.budget = budget
        self.deadline = deadline
        self.steps = 0
        self._rows: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self._ind: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}
        self.stage_of = np.full(problem.n, -1, dtype=np.int64)
        self._bounds: dict[Level, list[np.ndarray]] = {}

    # ---- loads --------------------------------------------------------------------------------
    def loads(self, s: int, a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(memory, time, work) of stage s from the ideals ``a`` to every ideal, no waits."""
        p, q, w = self.c.rows(s, a, 0, self.n_ideals)
        return (p, q, w) if self.mem_first else (q, p, w)

    def row(self, s: int, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key = (s, i)
        got = self._rows.get(key)
        if got is None:
            m, t, w = self.loads(s, np.array([i]))
            got = self._rows[key] = (m[0], t[0], w[0])
            if len(self._rows) * 3 * self.n_ideals > _ROW_FLOATS:
                self._rows.popitem(last=False)
        return got

    def waits(self, s: int, i: int) -> np.ndarray | None:
        """Bytes of gradients waiting on stage s (from ideal i to each ideal), by where the
        received tensors were made (``self.stage_of``); None when none."""
        spec = self.p.stages[s]
        out = self.p.variants[spec.variant].out
        total: np.ndarray | None = None
        members = self.lat.members
        for u in self.lat.frontier[i]:
            c = spec.wait_from(int(self.stage_of[u]))
            if c <= 0 or out[u] <= 0:
                continue
            ext = tuple(v for v in self.lat.consumers[u] if not members[i, v])
            ind = self._ind.get((u, ext))
            if ind is None:
                ind = self._ind[(u, ext)] = np.asarray(members[:, list(ext)].any(axis=1))
            add = (c * float(out[u])) * ind
            total = add if total is None else total + add
        return total

    def charged(self, s: int, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``row(s, i)`` with the waits of the history in ``self.stage_of`` on its memory."""
        m, t, w = self.row(s, i)
        extra = self.waits(s, i)
        return (m if extra is None else m + extra), t, w

    # ---- one level ----------------------------------------------------------------------------
    def bound(self, f: Level) -> list[np.ndarray]:
        """h[s][i]: the best level value of stages s..K-1 from ideal i, without waits (kept per
        level function: a level searched again within a gap reuses it)."""
        got = self._bounds.get(f)
        if got is None:
            got = self._bounds[f] = self._bound(f)
        return got

    def _bound(self, f: Level) -> list[np.ndarray]:
        n, k = self.n_ideals, self.k
        h = [np.full(n, np.inf) for _ in range(k + 1)]
        h[k][self.c.end] = -np.inf
        every = np.arange(n)
        for s in range(k - 1, -1, -1):
            nxt = h[s + 1]
            mask = self.c.allowed[s] if s < k - 1 else None
            if mask is not None:
                nxt = np.where(mask, nxt, np.inf)
            for c0 in range(0, n, 256):
                a = every[c0:c0 + 256]
                h[s][a] = np.maximum(f(*self.loads(s, a)), nxt[None, :]).min(axis=1)
        return h

    def search(self, f: Level, start: list[int], gap: float) -> tuple[list[int], float, float]:
        """The chain minimising ``max_s f`` (with waits), from the incumbent ``start``.

        Returns (cuts, value, lower bound)."""
        if time.perf_counter() > self.deadline:
            raise _Budget
        h = self.bound(f)
        best_cuts, best = list(start), self.value(f, start)
        floor = math.inf  # the least bound of a pruned subtree
        members = self.lat.members
        cuts = [self.c.start]
        # what the rest of a chain can cost depends on (s, i), the stages of i's frontier (the
        # only tensors later stages may receive from it) and the bottleneck so far: a state seen
        # before at a bottleneck no larger has been searched already
        seen: dict[tuple[int, int, bytes], float] = {}

        def limit() -> float:
            return best - max(gap, REL_TOL) * abs(best)

        def step(s: int, i: int, cur: float) -> None:
            nonlocal best, best_cuts, floor
            key = (s, i, self.stage_of[self.lat.frontier[i]].tobytes())
            if seen.get(key, math.inf) <= cur:
                return
            seen[key] = cur
            self.steps += 1
            if self.steps > self.budget or (self.steps % 256 == 0 and time.perf_counter() > self.deadline):
                raise _Budget
            obj = f(*self.charged(s, i))
            if s == self.k - 1:
                val = max(cur, float(obj[self.c.end]))
                if val < limit():
                    best, best_cuts = val, cuts + [self.c.end]
                elif math.isfinite(val):
                    floor = min(floor, val)
                return
            tot = np.maximum(np.maximum(obj, h[s + 1]), cur)
            mask = self.c.allowed[s]
            if mask is not None:
                tot = np.where(mask, tot, np.inf)
            order = np.flatnonzero(np.isfinite(tot))
            order = order[np.argsort(tot[order], kind="stable")]
            for j in order:
                bound = float(tot[j])
                if bound >= limit():
                    floor = min(floor, bound)
                    break
                added = members[j] & ~members[i]
                self.stage_of[added] = s
                cuts.append(int(j))
                step(s + 1, int(j), max(cur, float(obj[j])))
                cuts.pop()
                self.stage_of[added] = -1

        step(0, self.c.start, -math.inf)
        return best_cuts, best, min(best, floor)

    def value(self, f: Level, cuts: list[int]) -> float:
        """``max_s f`` of one chain, with its waits."""
        self.stage_of[:] = -1
        out = -math.inf
        for s in range(self.k):
            i, j = cuts[s], cuts[s + 1]
            m, t, w = self.charged(s, i)
            out = max(out, float(f(m[j:j + 1], t[j:j + 1], w[j:j + 1])[0]))
            self.stage_of[self.lat.members[j] & ~self.lat.members[i]] = s
        self.stage_of[:] = -1
        return out


def _cuts_of(lat: Lattice, stage_of: list[int], k: int) -> list[int] | None:
    """The chain of ideals of a split (None when a prefix is not an ideal of the lattice)."""
    index = {row.tobytes(): i for i, row in enumerate(lat.members)}
    so = np.asarray(stage_of)
    cuts = []
    for s in range(k + 1):
        i = index.get((so < s).tobytes())
        if i is None:
            return None
        cuts.append(i)
    return cuts


def solve_waits(problem: Problem, lat: Lattice, start: Partition, *, gap: float = 1e-6,
                bases: dict[tuple[object, ...], object] | None = None,
                budget: int | None = None, time_limit: float = math.inf,
                exact_first: bool = True) -> Partition | None:
    """The lexicographic optimum with long-skip gradient waits over every chain of the
    complete lattice ``lat`` ([Note: wait search]), from the split ``start``.

    Only for problems where every rank holds one stage. Returns the split (solver
    "ideals+waits", status "optimal", the proven level-1 gap), or None when level 1 ran out of
    ``budget`` steps (default ``STEP_BUDGET``) or ``time_limit`` seconds, or ``start`` is not a
    chain of ``lat``.
    ``exact_first=False`` searches level 1 up to ``gap`` at once."""
    cuts0 = _cuts_of(lat, start.stage_of, problem.k)
    if cuts0 is None or not lat.complete:
        return None
    t0 = time.perf_counter()
    ch = _Chains(problem, lat, bases, STEP_BUDGET if budget is None else budget, t0 + time_limit)
    cap = math.inf if ch.cap is None else ch.cap * (1 + 1e-9)
    prim = 0 if ch.mem_first else 1  # the primary's index in (memory, time, work)

    def fits(m: np.ndarray) -> np.ndarray:
        return m <= cap

    def level1(m: np.ndarray, t: np.ndarray, w: np.ndarray) -> np.ndarray:
        return np.where(fits(m), (m, t)[prim], np.inf)

    total = ch.budget
    tries = sorted({REL_TOL, max(gap, REL_TOL)}) if exact_first else [max(gap, REL_TOL)]
    for attempt in tries:  # exact first, on half the budget
        ch.budget = total // 2 if attempt < gap else total
        try:
            cuts, p_opt, lower = ch.search(level1, cuts0, attempt)
            break
        except _Budget:
            continue
    else:
        return None
    ch.budget = total
    if not math.isfinite(p_opt):
        return None
    level_gap = max(0.0, 1 - lower / p_opt) if p_opt > 0 else 0.0
    p_lim = p_opt + REL_TOL * abs(p_opt)

    def held(m: np.ndarray, t: np.ndarray) -> np.ndarray:
        return fits(m) & ((m, t)[prim] <= p_lim)

    def level2(m: np.ndarray, t: np.ndarray, w: np.ndarray) -> np.ndarray:
        return np.where(held(m, t), (t, m)[prim], np.inf)

    def later(f: Level, at: list[int]) -> list[int]:
        try:
            return ch.search(f, at, REL_TOL)[0]
        except _Budget:  # keep what the earlier levels gave
            return at

    cuts = later(level2, cuts)
    work = _work(ch, cuts)
    if not spread_ok(work):
        s_opt = ch.value(level2, cuts)
        s_lim = s_opt + REL_TOL * abs(s_opt)

        def level3(m: np.ndarray, t: np.ndarray, w: np.ndarray) -> np.ndarray:
            return np.where(held(m, t) & ((t, m)[prim] <= s_lim), -w, np.inf)

        spread = later(level3, cuts)
        if spread_ok(_work(ch, spread)):
            cuts = spread
        else:  # an idle GPU is worse than a slower secondary: spread with level 1 held only

            def level3_relaxed(m: np.ndarray, t: np.ndarray, w: np.ndarray) -> np.ndarray:
                return np.where(held(m, t), -w, np.inf)

            relaxed = later(level3_relaxed, spread)
            if spread_ok(_work(ch, relaxed)):
                w_lim = min(_work(ch, relaxed)) * (1 - REL_TOL)

                def level4(m: np.ndarray, t: np.ndarray, w: np.ndarray) -> np.ndarray:
                    return np.where(held(m, t) & (w >= w_lim), (t, m)[prim], np.inf)

                cuts = later(level4, relaxed)
            else:
                cuts = spread
    return make_partition(problem, ch.c.assignment(cuts), solver="ideals+waits", status="optimal",
                          gap=level_gap, seconds=time.perf_counter() - t0)


def _work(ch: _Chains, cuts: list[int]) -> list[float]:
    """Every stage's compute work along a chain."""
    return [float(ch.row(s, cuts[s])[2][cuts[s + 1]]) for s in range(ch.k)]
