"""The profiler's backend interface: how nodes are executed and timed.

:class:`Backend` runs the nodes the walker (:mod:`nowdl.profiler.runner`) hands it, on real
tensors (:class:`nowdl.profiler.measure.MeasureBackend`) or fake ones
(:class:`nowdl.profiler.estimate.EstimateBackend`), and reports each forward or backward phase
as a :class:`PhaseResult`.
"""

from __future__ import annotations

import statistics
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nowdl.profiler.memory import AllocTracker

__all__ = ["Backend", "PhaseResult"]


@dataclass
class PhaseResult:
    """What a backend learned about one forward or backward phase of one run."""

    seconds: float | None = None  # None: this run is not timed
    flops: int | None = None
    workspace: int | None = None
    alloc: AllocTracker | None = None  # the phase's allocation log ([Note: allocation log] in profiler/alloc/log.py)


class Backend(ABC):
    """How nodes are executed and timed: real tensors (measure) or fake ones (estimate)."""

    device_label: str = ""
    device_type: str = "cpu"  # where the tensors live (autocast runs for this device type)
    n_runs: int = 1  # runs per node; the first is the accounting run
    memoise: bool = False  # reuse identical nodes' costs (see [Note: node memo])

    def context(self) -> AbstractContextManager[Any]:
        """Context around the whole walk (e.g. FakeTensorMode)."""
        return nullcontext()

    @abstractmethod
    def input(self, t: Any) -> Any:
        """An example input as the backend's tensor."""

    @abstractmethod
    def attr(self, obj: Any) -> Any:
        """A get_attr value as the backend's tensor."""

    @abstractmethod
    def static_tensors(self) -> Iterable[torch.Tensor]:
        """Parameters and buffers as the backend sees them (excluded from activations)."""

    @abstractmethod
    def call_module(self, mod: torch.nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        """Run a submodule."""

    @abstractmethod
    def params_of(self, mod: torch.nn.Module) -> list[torch.Tensor]:
        """The backend's parameter tensors of ``mod`` (their grads are cleared after runs)."""

    def summarise(self, seconds: Sequence[float]) -> float:
        """One figure for a phase's timed runs: their median."""
        return statistics.median(seconds)

    @abstractmethod
    def phase(self, name: str, accounting: bool) -> AbstractContextManager[PhaseResult]:
        """Context around a node's forward (``name="fwd"``) or backward (``"bwd"``)."""
