"""Plans for nets whose BatchNorm sees one value per channel at batch 1: micro-batches of 2 samples.

[Note: one-sample norms] (nowdl/trace/norm_batch.py): tracing such a net on one sample raises
:class:`~nowdl.errors.OneSampleNormError`. :func:`plans_two_samples` wraps a model's ``plan``
method: a training plan asked for with one sample per micro-batch is made instead for 2 samples
(the example repeated), with ``PlanRequest.min_micro_batch = 2`` so that no split of a global batch
goes below it. The error stands, with why, where that is impossible: an inference or
single-sample plan, one sample pinned, or pins that leave no micro-batch of 2 samples.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from nowdl.errors import OneSampleNormError
from nowdl.partitioner.config.candidate import PlanRequest
from nowdl.trace.norm_batch import on_two_samples

__all__ = ["plans_two_samples"]

P = TypeVar("P")


class _Planner(Protocol):
    request: PlanRequest | None


def plans_two_samples(plan: Callable[..., P]) -> Callable[..., P]:
    """Wrap ``plan(self, *examples, target=None, train=True, single=False)`` of an object with a
    ``request`` (a PlanRequest) as the module docstring says."""

    @functools.wraps(plan)
    def wrapped(self: _Planner, *examples: torch.Tensor, target: torch.Tensor | None = None, train: bool = True,
                single: bool = False) -> P:
        try:
            return plan(self, *examples, target=target, train=train, single=single)
        except OneSampleNormError as e:
            req = self.request
            if not train or single or req is None or req.micro_batch_size == 1:
                raise
            self.request = dataclasses.replace(req, min_micro_batch=2)

            def undo() -> None:
                self.request = req

            def again(xs: tuple[torch.Tensor, ...], t: torch.Tensor | None) -> Any:
                return plan(self, *xs, target=t, train=train, single=single)

            result: P = on_two_samples(e, examples, target, again, undo=undo)
            return result

    return wrapped
