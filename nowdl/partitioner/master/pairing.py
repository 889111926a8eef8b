"""MASTER pairing (rank r holds stage r and stage K-1-r): exact half-steps of a local search.

[Note: MASTER descent] A rank's load is the sum of two stages, so the chain DP of ``chain``
(one stage per step) can only minimise per-stage loads, a poor start (up to 1.5x off on
ResNets). With the back half of the cuts fixed, the front half is a chain again: stage s
(s < K/2) carries its partner's fixed load as an offset, and the last front stage also
decides where its neighbour starts (even K: stage K/2 is the partner of K/2-1; odd K: the
middle stage, counted twice on its rank). That half is solved exactly by ``minmax_path``;
then the back half with the front fixed (the same on the reversed chain); repeat until
neither half improves. The result is a local optimum (a heuristic, whose value the ILP
then proves or improves); every step keeps the memory cap on rank sums.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from nowdl.partitioner.chain.chain_dp import ChainCosts, minmax_path
from nowdl.partitioner.master.exact import exact_levels
from nowdl.partitioner.master.pair_loads import Halves, rank_value, spread_ok_split

__all__ = ["Halves", "descend", "improve", "master_split", "standard_pairing", "rank_value",
           "PAIR_CAP", "spread_ok_split"]

PAIR_CAP = 72  # states up to which ``master_exact.pair_dp`` (exact, O(K S^4)) replaces descent

_MAX_ROUNDS = 40


def _front(h: Halves, cuts: Sequence[int], bound: float) -> tuple[float, list[int]]:
    """Best c_1..c_{K//2} with the later cuts fixed (see [Note: MASTER descent]), when it is
    below ``bound`` (steps at or above it are pruned); (inf, cuts) otherwise."""
    k = h.k
    half = k // 2
    odd = k % 2 == 1
    fixed_next = cuts[half + 1]

    def partner(mats: Sequence[np.ndarray], s: int) -> float:
        p = k - 1 - s
        return float(mats[p][cuts[p], cuts[p + 1]])

    end_mask = h.allowed[half - 1] if half - 1 < len(h.allowed) else None

    def pair(mats: Sequence[np.ndarray], s: int, rows: np.ndarray, lo: int, hi: int,
             stagewise: bool) -> np.ndarray:
        join = np.maximum if stagewise else np.add
        if s < half - 1 or odd:
            val = join(mats[s][rows, lo:hi], partner(mats, s))
        else:  # even K: the partner of stage half-1 is stage half, which starts here
            val = join(mats[s][rows, lo:hi], mats[half][lo:hi, fixed_next][None, :])
        if s == half - 1 and odd:  # the middle stage sits on one rank twice
            val = np.maximum(val, (1 if stagewise else 2) * mats[half][lo:hi, fixed_next][None, :])
        return val

    def cost(s: int, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        out = pair(h.obj, s, rows, lo, hi, 0 in h.stagewise)
        bad = out >= bound
        for i, (mats, limit) in enumerate(h.limits, start=1):
            val = out if mats is h.obj else pair(mats, s, rows, lo, hi, i in h.stagewise)
            bad |= val > limit
        if s == half - 1 and end_mask is not None:
            bad |= ~end_mask[None, lo:hi]
        out[bad] = np.inf
        return out

    value, path = minmax_path(cost, half, h.allowed, h.start, None, h.n, h.window)
    if not path:
        return math.inf, list(cuts)
    return value, list(path) + list(cuts[half + 1:])


def descend(h: Halves, cuts: Sequence[int]) -> tuple[float, list[int]]:
    """Improve a feasible split by exact half-steps until neither half improves.

    Args:
        h: the loads and bounds.
        cuts: a feasible split c_0..c_K (every bound held).

    Returns:
        (max over ranks of the objective's pair sums, cuts).
    """
    best = list(cuts)
    value = rank_value(h, h.obj, best, stagewise=0 in h.stagewise)
    rev = h.reversed()
    for _ in range(_MAX_ROUNDS):
        improved = False
        for side in (h, rev):
            below = value - 1e-12 * abs(value)
            if side is h:
                v, c = _front(h, best, below)
            else:
                v, c = _front(rev, best[::-1], below)
                c = c[::-1]
            if v < below:
                value, best, improved = v, c, True
        if not improved:
            break
    return value, best


def standard_pairing(ranks: Sequence[Sequence[int]], k: int) -> bool:
    """True when rank r holds stages r and K-1-r (MASTER), the form ``descend`` handles."""
    want = {tuple(sorted({r, k - 1 - r})) for r in range(k)}
    return k >= 2 and {tuple(sorted(set(r))) for r in ranks} == want


def improve(prim: Sequence[np.ndarray], sec: Sequence[np.ndarray], *, mem_is_prim: bool,
            cap: float | None, allowed: Sequence[np.ndarray | None], start: int, end: int,
            cuts: Sequence[int], level2: bool = True,
            work: Sequence[np.ndarray] | None = None,
            spans: dict[Any, Any] | None = None) -> tuple[float, list[int]]:
    """The levels of [Note: lexicographic levels] for a MASTER split by ``descend``.

    Args:
        prim: per-stage primary load matrices; sec: the secondary ones.
        mem_is_prim: the primary is memory (the cap then bounds it), else the secondary.
        cap: per-rank memory cap (None: none).
        allowed: per cut c = 1..K-1, the states it may take (None: any).
        cuts: a feasible split to start from.
        level2: then minimise the secondary with the primary held.
        work: per-stage work matrices: then spread the work when a stage would idle.
        spans: row spans already computed for these matrices (``Halves.spans``), shared.

    Returns:
        (level-1 value, cuts), never worse than ``cuts`` on level 1.
    """
    mem = prim if mem_is_prim else sec
    caps: list[tuple[Sequence[np.ndarray], float]] = [(mem, cap)] if cap is not None else []
    spans = spans if spans is not None else {}
    h1 = Halves(obj=prim, limits=caps, allowed=allowed, start=start, end=end, spans=spans)
    p_opt, best = descend(h1, cuts)
    if not level2 or not math.isfinite(p_opt):
        return p_opt, best
    p_lim = p_opt * (1 + 1e-9)
    h2 = Halves(obj=sec, limits=caps + [(prim, p_lim)], allowed=allowed, start=start, end=end, spans=spans)
    s_opt, best = descend(h2, best)
    if work is None or spread_ok_split(work, best):
        return p_opt, best
    neg = [_negated(w) for w in work]
    spread = frozenset({0})

    def halves(obj: Sequence[np.ndarray], limits: list[tuple[Sequence[np.ndarray], float]],
               stagewise: frozenset[int]) -> Halves:
        return Halves(obj=obj, limits=caps + limits, allowed=allowed, start=start, end=end,
                      stagewise=stagewise, spans=spans)

    _, held = descend(halves(neg, [(prim, p_lim), (sec, s_opt * (1 + 1e-9))], spread), best)
    if spread_ok_split(work, held):
        return p_opt, held
    w_opt, free = descend(halves(neg, [(prim, p_lim)], spread), held)
    if not spread_ok_split(work, free):
        return p_opt, held
    floor = w_opt * (1 - 1e-9) if w_opt < 0 else w_opt
    _, lower = descend(halves(sec, [(prim, p_lim), (neg, floor)], frozenset({len(caps) + 2})), free)
    return p_opt, lower if spread_ok_split(work, lower) else free


def _negated(w: np.ndarray) -> np.ndarray:
    """``-w`` where finite, inf where ``w`` is (a step not allowed stays not allowed)."""
    neg = np.negative(w)
    neg[neg == -np.inf] = np.inf
    return neg


# front-half weights of the seeds: balanced stages, front stages as small as possible (the
# memory optimum of 1F1B, whose front stages hold the most micro-batches), back ones small,
# and two in between; each seed then descends (see [Note: MASTER descent])
SEED_WEIGHTS = (1.0, 1e3, 1e-3, 4.0, 0.25)


def master_split(costs: ChainCosts, *, mem_is_prim: bool, cap: float | None,
                 exact: bool = False, upper: float = math.inf,
                 seed: Sequence[int] | None = None) -> tuple[list[int], float] | None:
    """The best MASTER split: exact by ``pair_dp`` for few states (with ``exact``), else the
    best descent from several seeds (levels 1 and 2; a heuristic).

    Args:
        costs: per-stage loads over states ``0..costs.end`` (no per-stage cap applied).
        mem_is_prim: the primary quantity is memory (the cap bounds it).
        cap: per-rank memory cap.
        exact: try ``pair_dp`` when there are at most ``PAIR_CAP`` states.
        upper: the rank bottleneck of a known split: no stage of a better one is heavier,
            so heavier steps are dropped (banded matrices, much less work).
        seed: that known split (meeting the cap): it bounds the exact DP's search.

    Returns:
        (cuts, a lower bound on the primary optimum: the split's own value when it is
        proven optimal, 0 when unknown: see ``lagrangian_bound``), or None when nothing
        respects the cap.
    """
    k, allowed, start, end = costs.k, costs.allowed, costs.start, costs.end
    n = end + 1
    limit = upper * (1 + 1e-9)
    prim, sec, work = [], [], []
    for s in range(k):
        p, q, w = (np.full((n, n), np.inf) for _ in range(3))
        for c0 in range(0, n, 256):
            rows = np.arange(c0, min(n, c0 + 256))
            lo, hi = costs.window(rows, limit) if math.isfinite(limit) else (0, n)
            if hi > lo:
                p[rows, lo:hi], q[rows, lo:hi], w[rows, lo:hi] = costs.rows(s, rows, lo, hi)
        if math.isfinite(limit):
            over = p > limit
            p[over] = q[over] = w[over] = np.inf
        prim.append(p)
        sec.append(q)
        work.append(w)
    if exact and end + 1 <= PAIR_CAP:
        return exact_levels(prim, sec, work, mem_is_prim=mem_is_prim, cap=cap, allowed=allowed,
                            start=start, end=end, seed=seed)
    mem = prim if mem_is_prim else sec
    h = Halves(obj=prim, limits=[(mem, cap)] if cap is not None else [], allowed=allowed,
               start=start, end=end)
    spans = h.spans
    found: list[tuple[float, int, list[int]]] = []
    for i, alpha in enumerate(SEED_WEIGHTS):
        weights = [alpha if s < k // 2 else 1.0 for s in range(k)]

        def cost(s: int, rows: np.ndarray, lo: int, hi: int,
                 weights: list[float] = weights) -> np.ndarray:
            c = weights[s] * prim[s][rows, lo:hi]
            if cap is not None:
                c = np.where(mem[s][rows, lo:hi] > cap / 2, np.inf, c)
            return c

        _, seed = minmax_path(cost, k, allowed, start, end, n, h.window)
        if not seed:
            continue
        value, cuts = improve(prim, sec, mem_is_prim=mem_is_prim, cap=cap, allowed=allowed,
                              start=start, end=end, cuts=seed, level2=False, spans=spans)
        if cap is not None and rank_value(h, mem, cuts) > cap * (1 + 1e-9):
            continue
        found.append((value, i, cuts))
    if not found:
        return None
    _, _, cuts = min(found)
    _, cuts = improve(prim, sec, mem_is_prim=mem_is_prim, cap=cap, allowed=allowed, start=start,
                      end=end, cuts=cuts, work=work, spans=spans)
    return cuts, 0.0
