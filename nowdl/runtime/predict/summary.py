"""The summary line of a prediction: images, pixels per second, peak memory per rank against the plan."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from nowdl.plan.plan import Plan
from nowdl.runtime.predict.windows import Reach
from nowdl.units import format_bytes

__all__ = ["PredictSummary"]


@dataclass
class PredictSummary:
    """What a prediction did; :meth:`line` is the summary rank 0 prints.

    ``peak_bytes[r]`` is rank r's measured peak over the windows it measured (CUDA: the
    allocator's peak; CPU: weights plus the storages a window allocates, on the first two
    windows of each image); ``predicted_bytes[r]`` the plan's ``predicted_peak_bytes``.
    ``approximate`` names the whole-image ops whose statistics were taken over a window.
    """

    world: int = 1
    images: int = 0
    pixels: int = 0
    windows: int = 0
    seconds: float = 0.0
    margin: tuple[int, ...] = ()
    approximate: str = ""
    streamed: str = ""
    passes: int = 0
    pass_seconds: float = 0.0
    pass_cpu_seconds: float = 0.0  # this process's CPU time in the passes (wall minus waiting, on a shared CPU)
    peak: int | None = None
    predicted: int | None = None
    peak_bytes: list[int | None] = field(default_factory=list)
    predicted_bytes: list[int | None] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # a re-plan for memory (runtime/predict/memory.py)

    def add_peak(self, peak: int | None) -> None:
        if peak is not None:
            self.peak = max(self.peak or 0, peak)

    def add_image(self, spatial: Sequence[int], windows: int, reach: Reach, plan: Plan | None, rank: int,
                  passes: Any = None) -> None:
        """Count one image of ``windows`` windows; ``passes``: its statistics passes (or None)."""
        self.images += 1
        self.pixels += math.prod(spatial)
        self.windows += windows
        self.margin = reach.margin
        if windows > 1 and reach.whole:
            unhooked = passes.unhooked if passes is not None else ()
            self.approximate = reach.whole_text(also=unhooked) or self.approximate
            self.streamed = reach.whole_text(exact=True, also=unhooked) or self.streamed
        if passes is not None:
            self.passes = max(self.passes, passes.passes)
            self.pass_seconds += passes.seconds
            self.pass_cpu_seconds += passes.cpu_seconds
        if plan is not None and rank < len(plan.ranks):
            self.predicted = max(self.predicted or 0, int(plan.ranks[rank].predicted_peak_bytes))

    def gather(self) -> None:
        """Every rank's peak and predicted bytes (collective)."""
        mine: Any = (self.peak, self.predicted)
        got = [mine]
        if self.world > 1 and dist.is_initialized():
            got = [None] * self.world
            dist.all_gather_object(got, mine)
        self.peak_bytes = [g[0] for g in got]
        self.predicted_bytes = [g[1] for g in got]

    def line(self) -> str:
        """``predicted 1 image(s), 4.19 Mpixel in 12.3 s (0.34 Mpixel/s), 9 window(s); peak per rank ...``"""
        rate = self.pixels / self.seconds / 1e6 if self.seconds > 0 else float("nan")
        mem = ", ".join(f"{format_bytes(p) if p is not None else '?'}"
                        + (f" (plan {format_bytes(q)})" if q is not None else "")
                        for p, q in zip(self.peak_bytes, self.predicted_bytes, strict=True))
        stats = (f"; {self.passes} statistics pass(es) over the windows for {self.streamed}, "
                 f"{self.pass_seconds:.1f} s" if self.passes else "")
        how = ("exact (margin " + "x".join(map(str, self.margin)) + f" px{stats})" if not self.approximate else
               f"NOT exact: computed over each window for {self.approximate}{stats}")
        return (f"predicted {self.images} image(s), {self.pixels / 1e6:.2f} Mpixel in {self.seconds:.1f} s "
                f"({rate:.2f} Mpixel/s), {self.windows} window(s), {how}; peak memory per rank: {mem}")
