"""MASTER splits proven: the exact pair DP for few states, and a Lagrangian lower bound.

``pair_dp`` solves the rank pair sums exactly by a DP over (front cut, back cut) pairs,
``exact_levels`` runs the levels of [Note: lexicographic levels] with it, and
``lagrangian_bound`` bounds any MASTER split from below (the gap a descent's plan reports).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from nowdl.partitioner.chain.chain_dp import ChainCosts, minmax_path
from nowdl.partitioner.master.pair_loads import Halves, rank_value, spread_ok_split

__all__ = ["pair_dp", "exact_levels", "lagrangian_bound"]


def exact_levels(prim: list[np.ndarray], sec: list[np.ndarray], work: list[np.ndarray], *,
                 mem_is_prim: bool, cap: float | None, allowed: Sequence[np.ndarray | None],
                 start: int, end: int, seed: Sequence[int] | None = None
                 ) -> tuple[list[int], float] | None:
    """[Note: lexicographic levels] on rank pair sums, each level by ``pair_dp``.

    ``seed``, a split meeting the cap, bounds level 1 from above; each later level is bounded
    by the value of the split the previous one found (both prune most pairs early).
    """
    mem = prim if mem_is_prim else sec
    caps = [(mem, cap)] if cap is not None else []

    def run(obj: list[np.ndarray], limits: list[tuple[Sequence[np.ndarray], float]],
            stagewise: frozenset[int] = frozenset(), known: Sequence[int] | None = None
            ) -> tuple[float, list[int]]:
        h = Halves(obj=obj, limits=caps + limits, allowed=allowed, start=start, end=end,
                   stagewise=frozenset(i + len(caps) if i else 0 for i in stagewise))
        bound = math.inf
        if known:  # a split meeting every limit: the optimum is at most its value
            v = rank_value(h, obj, known, stagewise=0 in h.stagewise)
            bound = v + 1e-9 * abs(v) + 1e-300
        got = pair_dp(h, bound)
        return got if got[1] else pair_dp(h)  # pragma: no branch - the bound holds a witness

    p_opt, cuts = run(prim, [], known=seed)
    if not cuts:
        return None
    p_lim = p_opt * (1 + 1e-9)
    s_opt, cuts2 = run(sec, [(prim, p_lim)], known=cuts)
    cuts = cuts2 or cuts
    if spread_ok_split(work, cuts):  # level 3 only when a stage would idle
        return cuts, p_opt
    neg = [np.where(np.isfinite(w), -w, np.inf) for w in work]  # max-min work, per stage
    _, cuts3 = run(neg, [(prim, p_lim), (sec, s_opt * (1 + 1e-9))], frozenset({0}), cuts)
    cuts = cuts3 or cuts
    if spread_ok_split(work, cuts):
        return cuts, p_opt
    w_opt, cuts4 = run(neg, [(prim, p_lim)], frozenset({0}), cuts)
    if cuts4:
        floor = w_opt * (1 - 1e-9) if w_opt < 0 else w_opt
        _, cuts5 = run(sec, [(prim, p_lim), (neg, floor)], frozenset({2}), cuts4)
        for c in (cuts5, cuts4):
            if c and spread_ok_split(work, c):
                return c, p_opt
    return cuts, p_opt


def pair_dp(h: Halves, bound: float = math.inf) -> tuple[float, list[int]]:
    """The exact MASTER optimum by a DP over (front cut, back cut) pairs, outside in.

    State after r pairs: (c_r, c_{K-r}); rank r's load is stage r plus stage K-1-r, both
    decided by the step to (c_{r+1}, c_{K-1-r}). Even K ends with c_{K/2} shared by the two
    middle stages; odd K with the middle stage counted twice. O(K S^4) for S states (only
    reachable pairs and steps below ``bound`` are expanded): for small graphs only.

    Returns:
        (max over ranks of the pair sums, cuts); (inf, []) when no split meets the limits.
    """
    k, n = h.k, h.n
    half, odd = k // 2, k % 2 == 1
    fams = [(h.obj, math.inf)] + list(h.limits)
    join = [np.maximum if i in h.stagewise else np.add for i in range(len(fams))]
    twice = [1.0 if i in h.stagewise else 2.0 for i in range(len(fams))]

    def mask(r: int) -> np.ndarray | None:
        return h.allowed[r] if r < len(h.allowed) else None

    g = np.full((n, n), np.inf)
    g[h.start, h.end] = -np.inf
    args: list[np.ndarray] = []
    last = half - 1 if not odd else half
    for r in range(last):
        new = np.full((n, n), np.inf)
        arg = np.zeros((n, n), dtype=np.int64)
        fm, bm = mask(r), mask(k - r - 2)
        front, back = h.obj[r], h.obj[k - 1 - r]
        sign_ok = 0 in h.stagewise or all(np.nanmin(np.where(np.isfinite(m), m, np.nan)) >= 0
                                          for m in (front, back) if np.isfinite(m).any())
        for a in np.flatnonzero((g < np.inf).any(axis=1)):
            bs = np.flatnonzero(g[a] < np.inf)
            # only steps that are finite (and, loads being >= 0, below the bound) can help
            ok_a = np.isfinite(front[a]) & ((front[a] < bound) if sign_ok else True)
            if fm is not None:
                ok_a &= fm
            ok_b = np.isfinite(back[:, bs]).any(axis=1)
            if sign_ok:
                ok_b &= (back[:, bs] < bound).any(axis=1)
            if bm is not None:
                ok_b &= bm
            ap, bp = np.flatnonzero(ok_a), np.flatnonzero(ok_b)
            if ap.size == 0 or bp.size == 0:
                continue
            val = None
            for i, (mats, lim) in enumerate(fams):
                tot = join[i](mats[r][a, ap][None, :, None],
                              mats[k - 1 - r][bp[:, None], bs[None, :]].T[:, None, :])
                if i == 0:
                    val = np.maximum(g[a, bs][:, None, None], tot)
                    val[tot >= bound] = np.inf
                else:
                    assert val is not None
                    val[tot > lim] = np.inf
            assert val is not None
            best = np.argmin(val, axis=0)
            low = np.take_along_axis(val, best[None], axis=0)[0]
            rows, cols = ap[:, None], bp[None, :]
            sub = new[rows, cols]
            better = low < sub
            sub[better] = low[better]
            new[rows, cols] = sub
            sub_arg = arg[rows, cols]
            sub_arg[better] = (a * n + bs[best])[better]
            arg[rows, cols] = sub_arg
        new[new >= bound] = np.inf  # no split through these states beats the bound
        g = new
        args.append(arg)
    # the last rank: even K shares the middle cut, odd K holds the middle stage twice
    best_val, best_state, best_mid = math.inf, (-1, -1), -1
    for a in np.flatnonzero((g < np.inf).any(axis=1)):
        bs = np.flatnonzero(g[a] < np.inf)
        if odd:
            vals = [np.maximum(g[a, bs], twice[i] * mats[half][a, bs]) if i == 0
                    else twice[i] * mats[half][a, bs] for i, (mats, _) in enumerate(fams)]
            v = vals[0].copy()
            for (_, lim), w in zip(fams[1:], vals[1:], strict=True):
                v[w > lim] = np.inf
            if v.size and float(v.min()) < best_val:
                j = int(np.argmin(v))
                best_val, best_state = float(v[j]), (int(a), int(bs[j]))
            continue
        tots = [join[i](mats[half - 1][a][None, :], mats[half][:, bs].T)  # [b, m]
                for i, (mats, _) in enumerate(fams)]
        v = np.maximum(g[a, bs][:, None], tots[0])
        for (_, lim), t in zip(fams[1:], tots[1:], strict=True):
            v[t > lim] = np.inf
        mm = mask(half - 1)
        if mm is not None:
            v[:, ~mm] = np.inf
        if v.size and float(v.min()) < best_val:
            j = int(np.argmin(v))
            bi, m = divmod(j, n)
            best_val, best_state, best_mid = float(v.flat[j]), (int(a), int(bs[bi])), m
    if not math.isfinite(best_val) or best_val >= bound:
        return math.inf, []
    fronts, backs = [best_state[0]], [best_state[1]]
    fa, fb = best_state
    for arg in reversed(args):
        fa, fb = divmod(int(arg[fa, fb]), n)
        fronts.append(fa)
        backs.append(fb)
    fronts.reverse()  # c_0 .. c_last
    middle = [best_mid] if not odd else []
    return best_val, fronts + middle + backs


def lagrangian_bound(costs: ChainCosts, upper: float, *, rel_tol: float = 1e-4,
                     max_iter: int = 60) -> float:
    """A lower bound on the MASTER optimum: max over rank weights of the weighted-sum split.

    For weights lambda on the ranks (summing to 1), max_r load_r >= sum_r lambda_r load_r,
    whose minimum over splits is a shortest path (stage s weighted by its rank's lambda).
    Splits with a stage above ``upper`` (a known split's value) cannot be optimal and are
    left out, which keeps the bound valid and the paths banded. Kelley's cutting planes on
    lambda (a tiny LP per step, HiGHS) give the best such bound. Caps are dropped.
    """
    import highspy

    k, start, end = costs.k, costs.start, costs.end
    pairs = [(r, k - 1 - r) for r in range((k + 1) // 2)]
    n_r = len(pairs)
    limit = upper * (1 + 1e-9)

    def prim(s: int, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        p = costs.rows(s, rows, lo, hi)[0]
        return np.where(p <= limit, p, np.inf)

    def shortest(mu: np.ndarray) -> tuple[float, list[float]]:
        def cost(s: int, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
            p = prim(s, rows, lo, hi)
            finite = np.isfinite(p)
            return np.where(finite, mu[s] * np.where(finite, p, 0.0), np.inf)

        value, path = minmax_path(cost, k, costs.allowed, start, end, end + 1,
                                  lambda s, a: costs.window(a, limit), total=True)
        if not path:
            return math.inf, []
        loads = [float(prim(s, np.array([path[s]]), path[s + 1], path[s + 1] + 1)[0, 0])
                 for s in range(k)]
        return value, [loads[a] + loads[b] for a, b in pairs]

    lam = np.full(n_r, 1.0 / n_r)
    cuts: list[list[float]] = []
    bound = 0.0
    for _ in range(max_iter):
        mu = np.zeros(k)
        for r, (a, b) in enumerate(pairs):
            mu[a] += lam[r]
            mu[b] += lam[r]
        value, loads = shortest(mu)
        if not math.isfinite(value):
            return bound
        bound = max(bound, value)
        cuts.append(loads)
        lp = highspy.Highs()
        lp.setOptionValue("output_flag", False)
        inf = highspy.kHighsInf
        idx = np.arange(n_r + 1, dtype=np.int32)
        lp.addVars(n_r + 1, np.array([0.0] * n_r + [-inf]), np.array([1.0] * n_r + [inf]))
        lp.changeColsCost(n_r + 1, idx, np.array([0.0] * n_r + [-1.0]))
        lp.addRow(1.0, 1.0, n_r, idx[:n_r], np.ones(n_r))
        for c in cuts:  # z <= sum_r lambda_r load_r(path)
            lp.addRow(-inf, 0.0, n_r + 1, idx, np.array([-x for x in c] + [1.0]))
        lp.run()
        sol = list(lp.getSolution().col_value)
        lam = np.clip(np.array(sol[:n_r]), 0.0, None)
        lam /= max(lam.sum(), 1e-300)
        if sol[n_r] - bound <= rel_tol * abs(bound):
            break
    return bound
