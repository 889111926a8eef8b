"""Exact split over the ideals (downsets) of the DAG, for graphs that have few of them.

[Note: ideal DP] The stages of any convex split are ``D_{s+1} minus D_s`` for a chain of
ideals ``{} = D_0 < D_1 < ... < D_K = V`` (``D_s``: the nodes of stages before s; an ideal
holds every producer of its nodes), and every such chain is a split. A stage's loads depend
only on its two ideals: its nodes' sums, the largest workspace among them, the tensors it
receives (producers in ``D_s`` with a consumer in the stage) and the ones it sends (its
nodes with a consumer outside ``D_{s+1}``). So the chain DP of ``chain`` over the ideals is
exact for the whole convex family, the ILP's, whenever every rank holds one stage. Chains
with skips (ResNet, UNet) have about n ideals; graphs of wide parallel branches
(AmoebaNet cells) have exponentially many, and ``enumerate_ideals`` gives up at a cap.

The ideals themselves (all of them, or a beam: [Note: ideal beam]) come from
:mod:`nowdl.partitioner.exact.downsets`.

Pair loads are (I x I) numpy matrices per kind of stage: sums as differences of per-ideal
sums; sent bytes from each ideal's frontier; received bytes from the frontier of the start
ideal; the largest workspace by thresholds (``D_i`` is inside ``D_j``, so ``D_j minus D_i``
holds a node with workspace >= w exactly when ``D_j`` holds more such nodes than ``D_i``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence

import numpy as np

from nowdl.partitioner.chain.chain_dp import CAP_REL, lexicographic
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.structure import make_partition
from nowdl.partitioner.exact.downsets import (
    BEAM_CAP,
    IDEAL_CAP,
    Lattice,
    beam_ideals,
    enumerate_ideals,
)
from nowdl.partitioner.master.exact import lagrangian_bound
from nowdl.partitioner.master.pairing import master_split, standard_pairing

__all__ = ["Lattice", "enumerate_ideals", "beam_ideals", "IdealCosts", "solve_ideals", "bound_master", "largest_level",
           "IDEAL_CAP", "BEAM_CAP"]  # Lattice, the two builders and the caps live in nowdl.partitioner.exact.downsets

log = logging.getLogger(__name__)

_BASES_BYTES = 512 * 2**20  # pair matrices kept between solves, least recently used out first
# (a search's candidates ask for a few kinds of stage in turn: 8 on UNet++ at 4 stages)


def largest_level(ca: np.ndarray, cb: np.ndarray, levels: np.ndarray, floor: float = 0.0) -> np.ndarray:
    """The largest workspace among the nodes of ``D_j`` minus ``D_i`` for every pair, where
    ``D_i`` is inside ``D_j`` ([Note: ideal DP]): ``ca[i, l]`` and ``cb[j, l]`` count the nodes
    of ``D_i`` and ``D_j`` whose workspace reaches ``levels[l]`` (ascending). Fewer nodes reach a
    higher level, so the number of levels where ``D_j`` holds more names the largest one;
    ``floor`` where it holds more at none."""
    reached = np.zeros((ca.shape[0], cb.shape[0]), dtype=np.uint8 if levels.size < 255 else np.int32)
    step = np.empty(reached.shape, dtype=bool)
    for lvl in range(levels.size):
        np.less(ca[:, lvl, None] + 0.5, cb[None, :, lvl], out=step)
        reached += step
    return np.concatenate([[floor], levels])[reached]


class _Base:
    """Per-variant loads: per-ideal sums (static, act, time) and two pair matrices, the
    boundary bytes (received + sent) and the largest workspace (None when all zero)."""

    def __init__(self, lat: Lattice, static: np.ndarray, act: np.ndarray, tim: np.ndarray,
                 ws: np.ndarray, out: np.ndarray) -> None:
        m = lat.members.astype(np.float64)
        self.static, self.act, self.time = m @ static, m @ act, m @ tim
        front = np.zeros(lat.members.shape, dtype=bool)  # front[i, u]: u is on ideal i's frontier
        for i, f in enumerate(lat.frontier):
            front[i, f] = True
        front &= (out != 0.0)[None, :]
        # sent: the frontier of the end ideal, less what the start ideal already holds
        self.sent = (front @ out)[None, :] - m @ (front * out).T
        # received: the frontier of the start ideal with a consumer in the end ideal (every
        # consumer of a one-consumer tensor is outside its frontier ideal; the others in turn)
        rs = self.sent.copy()
        ncons = np.array([len(set(c)) for c in lat.consumers])
        one = np.flatnonzero((ncons == 1) & front.any(axis=0))
        if one.size:
            first = [lat.consumers[u][0] for u in one]
            rs += (front[:, one] * out[one]) @ m[:, first].T
        for u in np.flatnonzero((ncons > 1) & front.any(axis=0)):
            rows, cons = np.flatnonzero(front[:, u]), np.array(sorted(set(lat.consumers[u])))
            hit = (~lat.members[np.ix_(rows, cons)]).astype(np.float64) @ m[:, cons].T > 0.5
            rs[rows] += out[u] * hit
        self.rs = rs
        self.wmax: np.ndarray | None = None
        levels = np.unique(ws[ws > 0])
        if levels.size:
            cnt = lat.members.astype(np.float32) @ (ws[:, None] >= levels[None, :]).astype(np.float32)
            self.wmax = largest_level(cnt, cnt, levels)

    @property
    def nbytes(self) -> int:
        """Bytes of its pair matrices."""
        return sum(int(m.nbytes) for m in (self.rs, self.sent, self.wmax) if m is not None)


class IdealCosts:
    """``chain.ChainCosts`` over the ideals of a problem (see [Note: ideal DP]).

    With ranks that hold several stages (MASTER) the loads are per stage, so the DP is a
    heuristic there; ``per_stage_cap`` then bounds each stage's memory.
    """

    def __init__(self, problem: Problem, lat: Lattice, *, per_stage_cap: float | None = None,
                 bases: dict[tuple[object, ...], object] | None = None) -> None:
        self.problem = problem
        self.lat = lat
        self.k = problem.k
        self.start = 0
        self.end = lat.size - 1
        self.cap = per_stage_cap
        self._bases = bases if bases is not None else {}
        self._idents: dict[str, tuple[object, ...]] = {}
        tile = (np.asarray(problem.tileable, dtype=bool) if problem.tileable
                else np.ones(problem.n, dtype=bool))
        nt = lat.members[:, ~tile].sum(axis=1)
        self._untileable = np.less.outer(nt, nt)  # the step adds a node that cannot be tiled
        whole: np.ndarray | None = None  # ideals holding all or none of each tied group
        for grp in problem.tied:
            held = lat.members[:, list(grp)].sum(axis=1)
            ok = (held == 0) | (held == len(grp))
            whole = ok if whole is None else whole & ok
        allowed: list[np.ndarray | None] = []
        for c in range(1, problem.k):  # the ideal after stage c-1: pinned nodes of stages < c
            mask: np.ndarray | None = whole
            for v, st in problem.pinned.items():
                want = np.asarray(lat.members[:, v] if st < c else ~lat.members[:, v])
                mask = want if mask is None else np.logical_and(mask, want)
            allowed.append(mask)
        self.allowed = allowed
        # a lower bound of any stage's primary load per node (its cheapest kind of stage)
        p = problem
        per_stage = []
        for spec in p.stages:
            vec = p.variants[spec.variant]
            if p.objective == "memory":
                per_stage.append(np.asarray(p.static, float) + spec.inflight * np.asarray(vec.act, float))
            else:
                per_stage.append(np.asarray(vec.time, float))
        node_cheap = np.min(np.vstack(per_stage), axis=0)
        self._cheap = lat.members.astype(np.float64) @ node_cheap
        order = np.argsort(self._cheap, kind="stable")
        self._sorted = self._cheap[order]
        self._prefmax = np.maximum.accumulate(order)

    def base(self, key: str) -> _Base:
        p = self.problem
        vec = p.variants[key]
        ident = self._idents.get(key)
        if ident is None:  # the same numbers give the same matrices (candidates share "plain")
            ident = (id(self.lat), tuple(p.static), tuple(vec.act), tuple(vec.time),
                     tuple(vec.workspace), tuple(vec.out))
            self._idents[key] = ident
        b = self._bases.pop(ident, None)  # put back last: the most recently used
        if not isinstance(b, _Base):
            arr = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
            b = _Base(self.lat, arr(p.static), arr(vec.act), arr(vec.time), arr(vec.workspace),
                      arr(vec.out))
            kept = sum(x.nbytes for x in self._bases.values() if isinstance(x, _Base))
            while self._bases and kept + b.nbytes > _BASES_BYTES:  # keep memory bounded
                old = self._bases.pop(next(iter(self._bases)))
                kept -= old.nbytes if isinstance(old, _Base) else 0
        self._bases[ident] = b
        return b

    def rows(self, s: int, a: np.ndarray, lo: int, hi: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        spec = self.problem.stages[s]
        b = self.base(spec.variant)
        first = max(lo, int(a.min()) + 1)  # ideals are sorted by size: supersets come later
        if first >= hi:
            mem = np.full((a.size, hi - lo), np.inf)
            tim, work = mem.copy(), mem.copy()
        else:  # in place where it can: these matrices are most of the DPs' time
            cols = slice(first, hi)
            rs = b.rs[a, cols]
            m = b.sent[a, cols]
            m *= spec.send_factor - spec.recv_factor
            m += spec.recv_factor * rs
            node = b.static + spec.inflight * b.act
            m += node[None, cols]
            m -= node[a][:, None]
            if b.wmax is not None:
                m += b.wmax[a, cols]
            tm = b.time[None, cols] - b.time[a][:, None]
            t = rs
            t *= spec.link_s_per_byte
            t += tm
            ok = self.lat.proper[a, cols]
            if spec.spatial:
                ok &= ~self._untileable[a, cols]
            if self.cap is not None:
                ok &= m <= self.cap * (1 + CAP_REL)
            bad = ~ok
            m[bad], t[bad], tm[bad] = np.inf, np.inf, np.inf
            mem, tim, work = m, t, tm
            if first > lo:  # the columns before ``first`` hold no superset of a row
                pad = np.full((a.size, first - lo), np.inf)
                mem, tim, work = (np.hstack([pad, x]) for x in (m, t, tm))
        if self.problem.objective == "memory":
            return mem, tim, work
        return tim, mem, work

    def window(self, a: np.ndarray, bound: float) -> tuple[int, int]:
        lo = int(a.min()) + 1
        if not math.isfinite(bound):
            return lo, self.lat.size
        top = float(self._cheap[a].max()) + bound
        pos = int(np.searchsorted(self._sorted, top + 1e-9 * abs(top), side="right")) - 1
        return lo, int(self._prefmax[pos]) + 1

    def upper_bound(self) -> float:
        """The primary bottleneck of equal-cost cuts along one chain of ideals."""
        chain = self.lat.chain
        cheap = self._cheap[chain]
        pos = [0]
        for s in range(1, self.k):
            j = int(np.searchsorted(cheap, cheap[-1] * s / self.k, side="left"))
            pos.append(min(max(j, pos[-1] + 1), len(chain) - 1))
        cuts = [chain[j] for j in pos] + [self.end]
        if len(set(cuts)) != len(cuts) or any(
            m is not None and not m[c] for m, c in zip(self.allowed, cuts[1:-1], strict=True)
        ):
            return math.inf
        return max(self.rows(s, np.array([cuts[s]]), cuts[s + 1], cuts[s + 1] + 1)[0][0, 0]
                   for s in range(self.k))

    def assignment(self, cuts: Sequence[int]) -> list[int]:
        stage_of = [0] * self.problem.n
        m = self.lat.members
        for s in range(self.k):
            for v in np.flatnonzero(m[cuts[s + 1]] & ~m[cuts[s]]):
                stage_of[int(v)] = s
        return stage_of


def _loose(cap: float | None) -> float | None:
    """The cap the DPs compare their stage loads with (``CAP_REL`` above it)."""
    return None if cap is None else cap * (1 + CAP_REL)


def _with_bound(problem: Problem, part: Partition, lower: float) -> Partition:
    """Status from a lower bound on the primary: "optimal" when met, else "feasible" with the
    gap (MASTER descent against its Lagrangian bound), "heuristic" when no bound is known."""
    value = part.bottleneck_mem if problem.objective == "memory" else part.bottleneck_time
    if lower <= 0.0 < value:
        return dataclasses.replace(part, status="heuristic", gap=math.nan)
    gap = max(0.0, (value - lower) / value) if value > 0 else 0.0
    return dataclasses.replace(part, status="optimal" if gap <= 1e-9 else "feasible", gap=gap)


def bound_master(problem: Problem, lat: Lattice, part: Partition, *,
                 bases: dict[tuple[object, ...], object] | None = None) -> Partition:
    """Status and gap of a heuristic MASTER split from ``master_exact.lagrangian_bound``."""
    if not lat.complete:  # a bound over some ideals only bounds those splits
        return part
    value = part.bottleneck_mem if problem.objective == "memory" else part.bottleneck_time
    lower = lagrangian_bound(IdealCosts(problem, lat, bases=bases), value)
    return _with_bound(problem, part, lower)


def solve_ideals(problem: Problem, lat: Lattice, *,
                 bases: dict[tuple[object, ...], object] | None = None) -> Partition | None:
    """The lexicographic optimum over all convex splits by the DP over ideals.

    Exact (status "optimal") when every rank holds one stage. With MASTER pairing: exact by
    ``master_exact.pair_dp`` for few ideals, else the MASTER descent (status "heuristic";
    ``bound_master`` then gives its gap). None when nothing fits the cap (or pins and
    tileability allow no chain).
    """
    t0 = time.perf_counter()
    ranks = problem.rank_stages()
    one_each = sorted(len(set(r)) for r in ranks) == [1] * problem.k
    exact = one_each and lat.complete
    caps: list[float | None] = [problem.mem_cap]
    if problem.mem_cap is not None and not one_each:
        caps.append(problem.mem_cap / max(len(r) for r in ranks))
    for cap in caps:
        costs = IdealCosts(problem, lat, per_stage_cap=cap, bases=bases)
        res = lexicographic(costs)
        if res is None:
            continue
        cuts, lower = res.cuts, (res.primary if exact else 0.0)
        if not one_each and standard_pairing(ranks, problem.k):
            seed = make_partition(problem, costs.assignment(cuts))
            upper = seed.bottleneck_mem if problem.objective == "memory" else seed.bottleneck_time
            known: list[int] | None = list(cuts)
            if problem.mem_cap is not None and seed.bottleneck_mem > problem.mem_cap * (1 + CAP_REL):
                upper, known = math.inf, None  # the per-stage split breaks the cap: no bound
            got = master_split(IdealCosts(problem, lat, bases=bases),
                               mem_is_prim=problem.objective == "memory", cap=_loose(problem.mem_cap),
                               exact=lat.complete, upper=upper, seed=known)
            if got is not None:
                cuts, lower = got[0], (got[1] if lat.complete else 0.0)
        part = make_partition(problem, costs.assignment(cuts), solver="ideals" if lat.complete else "beam")
        part = _with_bound(problem, part, lower)
        if problem.mem_cap is not None and part.bottleneck_mem > problem.mem_cap * (1 + CAP_REL):
            continue
        log.debug("ideals: n=%d K=%d over %d ideals: %.6g in %.2f s", problem.n, problem.k,
                  lat.size, res.primary, time.perf_counter() - t0)
        return part
    return None
