"""MASTER's pair-load problem: per-stage load matrices over a chain of states, and rank values.

Rank r of a GEMS-MASTER pipeline holds stage r and stage K-1-r, so its load is the pair sum
of two stages' loads. :class:`Halves` holds every stage's load matrix (state of its first cut
-> state of its last), :func:`rank_value` scores a split by its worst rank, and
:func:`spread_ok_split` checks that no stage idles. The searches over it are in
:mod:`nowdl.partitioner.master.pairing` (local descent) and :mod:`nowdl.partitioner.master.exact`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from nowdl.partitioner.chain.chain_dp import spread_ok

__all__ = ["Halves", "rank_value", "spread_ok_split"]


@dataclass(frozen=True)
class Halves:
    """Full per-stage load matrices over a chain of states (inf: step not allowed)."""

    obj: Sequence[np.ndarray]  # the quantity minimised (max over ranks of pair sums)
    limits: Sequence[tuple[Sequence[np.ndarray], float]]  # pair sums of these stay <= bound
    allowed: Sequence[np.ndarray | None]  # per cut c = 1..K-1: states it may take
    start: int
    end: int
    stagewise: frozenset[int] = frozenset()  # families (0: obj, i: limits[i-1]) taken per
    # stage (max of the rank's two stages) instead of per rank (their sum)
    # row spans by matrix layout, shared by the Halves of one search (``reversed`` and the
    # levels' Halves read the same matrices): each is computed once
    spans: dict[tuple[int, tuple[int, ...], tuple[int, ...]], tuple[np.ndarray, np.ndarray, np.ndarray]] = field(
        default_factory=dict, compare=False, repr=False)

    @property
    def k(self) -> int:
        return len(self.obj)

    @property
    def n(self) -> int:
        """Number of states."""
        return int(self.obj[0].shape[1])

    def reversed(self) -> Halves:
        """The same problem with the chain read backwards (stage s becomes K-1-s)."""
        return Halves(obj=[m.T for m in reversed(self.obj)],
                      limits=[([m.T for m in reversed(mats)], b) for mats, b in self.limits],
                      allowed=list(reversed(self.allowed)), start=self.end, end=self.start,
                      stagewise=self.stagewise, spans=self.spans)

    def window(self, s: int, rows: np.ndarray) -> tuple[int, int]:
        """Columns holding every finite step of stage s from ``rows``."""
        m = self.obj[s]
        key = (m.__array_interface__["data"][0], m.shape, m.strides)
        if key not in self.spans:  # the matrix is kept with its spans: its address stays its own
            self.spans[key] = (m, *_span(m))
        _, lo, hi = self.spans[key]
        return int(lo[rows].min()), int(hi[rows].max())


def _span(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the first finite column and one past the last (lo >= hi: none)."""
    finite = np.isfinite(m)
    n = m.shape[1]
    lo = np.argmax(finite, axis=1)
    hi = n - np.argmax(finite[:, ::-1], axis=1)
    none = ~finite.any(axis=1)
    lo[none], hi[none] = n, 0
    return lo, hi


def rank_value(h: Halves, mats: Sequence[np.ndarray], cuts: Sequence[int], *,
               stagewise: bool = False) -> float:
    """max over ranks of the pair sum of ``mats`` for the split ``cuts`` (``stagewise``: max
    over stages)."""
    k = h.k
    loads = [float(mats[s][cuts[s], cuts[s + 1]]) for s in range(k)]
    if stagewise:
        return max(loads)
    return max(loads[r] + loads[k - 1 - r] for r in range((k + 1) // 2))


def spread_ok_split(work: Sequence[np.ndarray], cuts: Sequence[int]) -> bool:
    """No stage of the split ``cuts`` idles (see ``chain.spread_ok``)."""
    return spread_ok([float(work[s][cuts[s], cuts[s + 1]]) for s in range(len(work))])
