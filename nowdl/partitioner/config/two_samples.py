"""Plans for nets whose BatchNorm sees one value per channel at batch 1: micro-batches of 2 samples.

[Note: one-sample norms] (nowdl/trace/norm_batch.py): tracing such a net on one sample gives a
graph for inference only, with the :class:`~nowdl.errors.OneSampleNormError` a training plan
raises. :func:`plans_two_samples` wraps a model's ``plan`` method: a training plan asked for
with one sample per micro-batch is made instead for 2 samples
(the example repeated), with ``PlanRequest.min_micro_batch = 2`` so that no split of a global batch
goes below it. The error stands, with why, where that is impossible: a single-sample training
plan, one sample pinned, or pins that leave no micro-batch of 2 samples.

A net that fx traces (its check runs in eval mode) meets the BatchNorm when the plan profiles it
in training: that failure becomes the same error. An inference plan (``train=False``:
``eval_step``, ``predict``) needs no batch statistics: the graph (traced with those BatchNorms in
eval mode where the tracer met them: ``Traced.one_sample`` holds the error) is profiled with
them in eval mode and planned.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
from torch import nn

from nowdl.errors import OneSampleNormError, ProfileError
from nowdl.partitioner.config.candidate import PlanRequest
from nowdl.trace.norm_batch import on_two_samples, one_sample_norm_error, one_value_norms_in_eval
from nowdl.trace.tracer import Traced

__all__ = ["plans_two_samples"]

P = TypeVar("P")


class _Planner(Protocol):
    request: PlanRequest | None
    model: nn.Module

    def trace(self, *example_inputs: torch.Tensor) -> Traced: ...


def plans_two_samples(plan: Callable[..., P]) -> Callable[..., P]:
    """Wrap ``plan(self, *examples, target=None, train=True, single=False)`` of an object with a
    ``request`` (a PlanRequest), a ``model`` and a ``trace`` method as the module docstring says."""

    @functools.wraps(plan)
    def wrapped(self: _Planner, *examples: torch.Tensor, target: torch.Tensor | None = None, train: bool = True,
                single: bool = False) -> P:
        def attempt(xs: tuple[torch.Tensor, ...], t: torch.Tensor | None) -> P:
            try:
                return plan(self, *xs, target=t, train=train, single=single)
            except ProfileError as e:  # an fx graph traces anyway: the profile's forward meets it
                one = one_sample_norm_error(self.model, xs, e)
                if one is None:
                    raise
                raise one from e

        try:
            one = self.trace(*examples).one_sample
            if one is not None and train:
                raise copy.copy(one)  # the graph is for inference only
            if one is None:
                try:
                    return attempt(examples, target)
                except OneSampleNormError:
                    if train:
                        raise
            with one_value_norms_in_eval():  # inference: those BatchNorms as in eval mode
                return plan(self, *examples, target=target, train=train, single=single)
        except OneSampleNormError as e:
            if not train:
                raise
            req = self.request
            if single or req is None or req.micro_batch_size == 1:
                raise
            self.request = dataclasses.replace(req, min_micro_batch=2)

            def undo() -> None:
                self.request = req

            result: P = on_two_samples(e, examples, target, attempt, undo=undo)
            return result

    return wrapped
