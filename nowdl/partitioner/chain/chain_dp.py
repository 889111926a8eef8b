"""Min-max DP over a chain of states, and the lexicographic levels of every DP-family solver.

[Note: lexicographic levels] A K-stage split is a path ``c_0 -> c_1 -> ... -> c_K`` through
a set of states (cut positions of one topological order in ``dp``, ideals of the DAG in
``ideals``): stage s is the step ``(c_s, c_{s+1})``. ``ChainCosts.rows(s, a)`` gives, for
the states ``a``, the primary load, the secondary load and the compute work of stage s going
to every state (inf where the step is not allowed). The objective is lexicographic:

1. the primary bottleneck (memory or time, as the user asked), under the memory cap;
2. the other bottleneck, with level 1 held at its optimum;
3. the spread: the least busy stage's work (fwd + bwd compute, link time excluded),
   maximised with levels 1 and 2 held, so that no GPU idles. It is solved only when the
   level-2 split leaves a stage idle (below ``IDLE_FRACTION``): otherwise the rule holds
   already and the extra solve would only cost time.

If level 3 still leaves a stage with less than ``IDLE_FRACTION`` of the busiest stage's
work, the order of levels 2 and 3 is swapped (an idle GPU is worse than a slower
secondary): the least busy stage's work is maximised with only level 1 held, then the
secondary minimised with both held ("relaxed"). If that split idles too, the model has
less work than stages: the level 1-2-3 split is kept and the caller warns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = ["IDLE_FRACTION", "REL_TOL", "CAP_REL", "ChainCosts", "ChainResult", "minmax_path", "lexicographic", "spread_ok"]

IDLE_FRACTION = 0.05  # a stage with less than this share of the busiest stage's work idles
REL_TOL = 1e-9  # later levels may lose this much (relative) on the levels they hold
# a stage's memory may exceed the cap by this much (relative) in the DPs: their stage loads are
# differences of prefix sums, which round differently from ``evaluate``'s sums, and a split that
# meets the cap exactly (a cap set to a known split's memory) must not be lost to one ulp;
# ``make_partition`` then checks the split with the same tolerance
CAP_REL = 1e-9

CHUNK = 256  # rows of a DP step computed at once (each chunk only over its column window)

Rows = Callable[[int, np.ndarray, int, int], np.ndarray]  # (stage, states, lo, hi) -> loads
Window = Callable[[int, np.ndarray], tuple[int, int]]  # (stage, states) -> columns worth computing


class ChainCosts(Protocol):
    """Stage loads between states (see [Note: lexicographic levels])."""

    k: int  # stages
    start: int  # the first state
    end: int  # the last state (states are 0..end)

    @property
    def allowed(self) -> Sequence[np.ndarray | None]:
        """For s < K-1, the states ``c_{s+1}`` may take (None: all)."""
        ...

    def rows(self, s: int, a: np.ndarray, lo: int, hi: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(primary, secondary, work) of stage s from the states ``a`` to states lo..hi-1."""
        ...

    def window(self, a: np.ndarray, bound: float) -> tuple[int, int]:
        """Columns lo..hi-1 holding every step from ``a`` whose primary load may be <= bound
        (a lower bound of the load, e.g. the nodes' own costs, decides)."""
        ...

    def upper_bound(self) -> float:
        """The primary bottleneck of some valid split (inf when none is at hand)."""
        ...


@dataclass(frozen=True)
class ChainResult:
    """The states of the chosen path and what each level achieved."""

    cuts: list[int]  # c_0 .. c_K
    primary: float
    secondary: float
    work: list[float]  # per stage
    spread_ok: bool  # no stage idles (see IDLE_FRACTION)
    relaxed: bool  # level 3 had to drop level 2 to spread the work


def minmax_path(cost: Rows, k: int, allowed: Sequence[np.ndarray | None], start: int,
                end: int | None, n: int, window: Window | None = None, *,
                total: bool = False, empty: bool = False) -> tuple[float, list[int]]:
    """min over paths ``start = c_0 -> ... -> c_K = end`` of ``max_s cost(s)[c_s, c_{s+1}]``
    (``total=True``: of the sum over s, a shortest path; ``empty=True``: a stage may also stay
    at its state, ``c_{s+1} = c_s``, at cost 0, a relaxation where stages may be empty).

    Only the rows of states reachable so far are asked for, ``CHUNK`` at a time and each
    chunk only over its ``window`` (all ``n`` states without one). Ties go to the smallest
    predecessor index, so the result is deterministic. ``end=None`` lets the path end
    anywhere (the best end, the smallest index among ties).

    Returns:
        (optimum, path); (inf, []) when no path exists.
    """
    def span(s: int, a: np.ndarray) -> tuple[int, int]:
        return window(s, a) if window is not None else (0, n)

    f = np.full(n, np.inf)
    lo, hi = span(0, np.array([start]))
    if hi > lo:
        f[lo:hi] = cost(0, np.array([start]), lo, hi)[0]
    if empty:
        f[start] = min(f[start], 0.0)
    mask = allowed[0] if k > 1 else None
    if mask is not None:
        f[~mask] = np.inf
    args: list[np.ndarray] = []
    for s in range(1, k):
        rows = np.flatnonzero(np.isfinite(f))
        if rows.size == 0:
            return math.inf, []
        new = np.full(n, np.inf)
        arg = np.full(n, -1, dtype=np.int64)
        for c0 in range(0, rows.size, CHUNK):
            ch = rows[c0:c0 + CHUNK]
            lo, hi = span(s, ch)
            if hi <= lo:
                continue
            step = cost(s, ch, lo, hi)
            cand = f[ch, None] + step if total else np.maximum(f[ch, None], step)
            best = np.argmin(cand, axis=0)
            val = cand[best, np.arange(hi - lo)]
            seg = new[lo:hi]
            better = val < seg
            seg[better] = val[better]
            arg[lo:hi][better] = ch[best[better]]
        if empty:  # stage s stays at its state
            stay = f < new
            new[stay] = f[stay]
            arg[stay] = np.flatnonzero(stay)
        f = new
        mask = allowed[s] if s < k - 1 else None
        if mask is not None:
            f[~mask] = np.inf
        args.append(arg)
    if end is None:
        end = int(np.argmin(f))
    value = float(f[end])
    if not math.isfinite(value):
        return math.inf, []
    path = [end]
    b = end
    for arg in reversed(args):
        b = int(arg[b])
        path.append(b)
    path.append(start)
    path.reverse()
    return value, path


def spread_ok(work: Sequence[float]) -> bool:
    """No stage's work is below ``IDLE_FRACTION`` of the busiest stage's (all zero is fine)."""
    top = max(work, default=0.0)
    return top <= 0 or min(work) >= IDLE_FRACTION * top


def _values(c: ChainCosts, cuts: Sequence[int]) -> tuple[list[float], list[float], list[float]]:
    prim, sec, work = [], [], []
    for s in range(c.k):
        b = cuts[s + 1]
        p, q, w = c.rows(s, np.array([cuts[s]]), b, b + 1)
        prim.append(float(p[0, 0]))
        sec.append(float(q[0, 0]))
        work.append(float(w[0, 0]))
    return prim, sec, work


def lexicographic(c: ChainCosts, *, spread: bool = True) -> ChainResult | None:
    """Levels 1-3 of [Note: lexicographic levels] over a chain of states.

    Args:
        c: the stage loads.
        spread: also solve level 3 when a stage would idle (False: stop after level 2).

    Returns:
        The result, or None when no path exists (nothing fits the cap, say).
    """
    k, allowed, a, z, n = c.k, c.allowed, c.start, c.end, c.end + 1

    def path(cost: Rows, bound: float) -> tuple[float, list[int]]:
        if math.isfinite(bound):
            return minmax_path(cost, k, allowed, a, z, n, lambda s, rows: c.window(rows, bound))
        return minmax_path(cost, k, allowed, a, z, n)

    def level1(s: int, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return c.rows(s, rows, lo, hi)[0]

    ub = c.upper_bound()
    p_opt, cuts = path(level1, ub * (1 + REL_TOL) if math.isfinite(ub) else ub)
    if not math.isfinite(p_opt) and math.isfinite(ub):  # pragma: no cover - ub is a witness
        p_opt, cuts = path(level1, math.inf)
    if not math.isfinite(p_opt):
        return None
    p_lim = p_opt + REL_TOL * abs(p_opt)

    def level2(s: int, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        p, q, _ = c.rows(s, rows, lo, hi)
        return np.where(p <= p_lim, q, np.inf)

    s_opt, cuts2 = path(level2, p_lim)
    if math.isfinite(s_opt):
        cuts = cuts2
    _, sec, work = _values(c, cuts)
    s_opt = max(sec)
    if not spread or spread_ok(work):  # level 3 only runs when some stage would idle
        return ChainResult(cuts, p_opt, s_opt, work, spread_ok(work), False)
    s_lim = s_opt + REL_TOL * abs(s_opt)

    def level3(s: int, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        p, q, w = c.rows(s, rows, lo, hi)
        return np.where((p <= p_lim) & (q <= s_lim), -w, np.inf)

    _, cuts3 = path(level3, p_lim)
    if cuts3:
        cuts = cuts3
    _, sec, work = _values(c, cuts)
    if spread_ok(work):
        return ChainResult(cuts, p_opt, max(sec), work, True, False)

    def level3_relaxed(s: int, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        p, _, w = c.rows(s, rows, lo, hi)
        return np.where(p <= p_lim, -w, np.inf)

    neg_w, cuts4 = path(level3_relaxed, p_lim)
    if cuts4:
        w_lim = -neg_w * (1 - REL_TOL)

        def level4(s: int, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
            p, q, w = c.rows(s, rows, lo, hi)
            return np.where((p <= p_lim) & (w >= w_lim), q, np.inf)

        _, cuts5 = path(level4, p_lim)
        cuts4 = cuts5 or cuts4
        _, sec4, work4 = _values(c, cuts4)
        if spread_ok(work4):
            return ChainResult(cuts4, p_opt, max(sec4), work4, True, True)
    return ChainResult(cuts, p_opt, max(sec), work, False, False)
