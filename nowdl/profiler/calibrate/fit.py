"""Fit a device spec's op efficiency and per-op floor to measured times ([Note: op efficiency]).

A *sample* is one measured time (a training step, or a model's forward or backward summed over
its nodes) with the ops that made it, as :class:`~nowdl.profiler.flops.OpCostMode` recorded them
on the spec's peaks: (class, work, roofline seconds, FLOPs) per op. The model of a sample's time is

    sum over ops of roofline / efficiency(work) + ops x floor,  efficiency(w) = top x w / (w + half)

and :func:`fit_time` picks (top, half, floor) on a grid that makes the worst sample's error
smallest (the largest |log(predicted / measured)|, 0 inside a sample's recorded spread of runs):
a few parameters shared by every model, so
the fit is a mechanism (kernels reach a fraction of the peak that grows with their size, and
every launch costs a floor), not a factor per row.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Sample", "TimeFit", "fit_time", "predict"]

Op = tuple[str, float, float, float]  # class, work, roofline seconds at the peaks, FLOPs


@dataclass(frozen=True)
class Sample:
    """One measured time and the ops that made it."""

    label: str
    ops: Sequence[Op]
    measured_s: float  # the measured time, or the least of a spread of runs
    extra_s: float = 0.0  # time the model adds beside the ops (offload's link, ...), not fitted
    measured_hi_s: float | None = None  # the most of a spread of runs (None: one figure)

    def error(self, predicted_s: float) -> float:
        """|log(predicted / measured)|, 0 inside a recorded spread, else to its nearer end."""
        hi = self.measured_hi_s or self.measured_s
        if self.measured_s <= predicted_s <= hi:
            return 0.0
        return abs(math.log(predicted_s / (self.measured_s if predicted_s < self.measured_s else hi)))


@dataclass(frozen=True)
class TimeFit:
    top: float
    half: float  # work at which an op reaches half of ``top``
    floor_s: float
    worst: float  # the largest |log(predicted / measured)| over the samples

    def efficiency(self) -> dict[str, list[float]]:
        """``DeviceSpec.op_efficiency`` of this fit (one entry for every class)."""
        return {"other": [round(self.top, 4), float(f"{self.half:.4g}")]}


def _arrays(s: Sample) -> tuple[np.ndarray, np.ndarray]:
    work = np.array([w for _, w, _, _ in s.ops], dtype=float)
    t = np.array([t for _, _, t, _ in s.ops], dtype=float)
    return work, t


def predict(s: Sample, top: float, half: float, floor_s: float) -> float:
    """The model's time for sample ``s`` (see the module docstring)."""
    work, t = _arrays(s)
    eff = top * work / (work + half) if half > 0 else np.full_like(work, top)
    eff = np.where(work > 0, eff, top)
    return float(np.sum(t / eff) + len(t) * floor_s + s.extra_s)


def fit_time(samples: Sequence[Sample], *, tops: Sequence[float] | None = None,
             halves: Sequence[float] | None = None, floors: Sequence[float] | None = None) -> TimeFit:
    """The (top, half, floor) of the grids that minimise the worst sample's |log error|.

    Raises:
        ValueError: no sample.
    """
    if not samples:
        raise ValueError("fit_time needs at least one measured sample")
    tops = tops or [x / 100 for x in range(30, 101, 2)]
    halves = halves or [0.0, *(10.0 ** e for e in np.arange(6, 12.01, 0.25))]
    floors = floors or [0.0, *(x * 1e-6 for x in (1, 2, 3, 5, 7, 10, 15, 20, 30, 50))]
    arrays = [_arrays(s) for s in samples]
    best: TimeFit | None = None
    for half in halves:
        shapes = [(w / (w + half) if half > 0 else np.ones_like(w)) for w, _ in arrays]
        base = [float(np.sum(np.where(w > 0, t / np.maximum(sh, 1e-12), t))) for (w, t), sh in zip(arrays, shapes,
                                                                                                         strict=True)]
        for top, floor in itertools.product(tops, floors):
            worst = max(s.error(b / top + len(s.ops) * floor + s.extra_s) for b, s in zip(base, samples, strict=True))
            if best is None or worst < best.worst - 1e-12:
                best = TimeFit(top, half, floor, worst)
    assert best is not None
    return best
