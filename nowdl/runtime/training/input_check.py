"""Every training step's inputs checked against what the plan was set up for, before any communication.

[Note: input check] The first ``train_step`` plans (or loads the plan), checks the batch against
it and builds every rank's stages, buffers and messages for those shapes. A later step whose
inputs differ (a 1024² image after 512² crops, another batch size, float64 instead of float32)
would otherwise fail deep in a tiled op, or kill a rank inside a collective when the sizes of a
message disagree. :class:`InputSpec` records the shapes and dtypes of the first step (the plan's
model inputs at the global batch) and :func:`check_step_inputs` refuses anything else on every
rank, before the step sends a byte, in one paragraph naming both shapes and the fix.
``eval_step`` does not use it: inference plans per input shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nowdl.errors import NowdlError
from nowdl.runtime.spatial.tiles import TiledInput

__all__ = ["InputSpec", "input_spec", "with_target", "check_step_inputs", "shape_text"]


@dataclass(frozen=True)
class InputSpec:
    """The global-batch shapes and dtypes a set-up model trains on (one entry per model input)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    target_shape: tuple[int, ...] | None = None  # None: no target tensor at set-up
    target_dtype: torch.dtype | None = None


def shape_text(shape: Sequence[int]) -> str:
    """'2x3x512x512'."""
    return "x".join(str(int(d)) for d in shape)


def _tensors(x: Any) -> list[Any] | None:
    if x is None:
        return None
    if isinstance(x, (torch.Tensor, TiledInput)):
        return [x]
    if isinstance(x, (list, tuple)) and all(isinstance(t, (torch.Tensor, TiledInput)) for t in x):
        return list(x)
    raise NowdlError(f"train_step takes a tensor (or a tuple of tensors) as x, got {type(x).__name__}")


def input_spec(plan_inputs: Sequence[Sequence[int]], batch: int, x: Any, y: Any) -> InputSpec:
    """What the plan takes per step: each model input of the plan (one micro-batch) at the
    global ``batch``, with the dtypes of the set-up step's ``x`` and ``y``."""
    xs = _tensors(x) or []
    shapes = tuple((int(batch),) + tuple(int(d) for d in s[1:]) for s in plan_inputs)
    dtypes = tuple(t.dtype for t in xs)
    ty = y if isinstance(y, (torch.Tensor, TiledInput)) else None
    return InputSpec(shapes, dtypes, None if ty is None else tuple(int(d) for d in ty.shape),
                     None if ty is None else ty.dtype)


def with_target(spec: InputSpec, y: Any) -> InputSpec:
    """``spec`` with the target of the first step that passes one (set-up may run without it)."""
    if spec.target_shape is not None or not isinstance(y, (torch.Tensor, TiledInput)):
        return spec
    if spec.shapes and int(y.shape[0]) != spec.shapes[0][0]:
        raise NowdlError(f"train_step: the target y has {int(y.shape[0])} samples but x has {spec.shapes[0][0]} "
                         "per step: pass one target per sample")
    return InputSpec(spec.shapes, spec.dtypes, tuple(int(d) for d in y.shape), y.dtype)


def _refuse(what: str, got: Sequence[int], got_dtype: torch.dtype, want: Sequence[int],
            want_dtype: torch.dtype | None, spatial: bool) -> NowdlError:
    w = f"{shape_text(want)} ({str(want_dtype).removeprefix('torch.')})" if want_dtype is not None else shape_text(want)
    head = (f"train_step: {what} has shape {shape_text(got)} ({str(got_dtype).removeprefix('torch.')}) but this "
            f"model was set up for {w} by its first step (the plan, every rank's stages and messages are "
            "for that shape); ")
    if len(got) != len(want) or got[1:] != want[1:]:
        size = "x".join(str(d) for d in want[2:])
        fix = (f"pass inputs of that shape (crop or resize to {size}), or plan for the new size with a new "
               "nowdl.compile(model, ...) whose first step gets it (eval_step re-plans per input shape)"
               if spatial else "pass tensors of that shape, or compile the model again for the new shape")
    elif got[0] != want[0]:
        fix = f"pass {want[0]} samples per step (the global batch of the plan), or re-plan for {got[0]}"
    else:
        fix = f"convert it with .to({str(want_dtype)})"
    return NowdlError(head + fix)


def check_step_inputs(spec: InputSpec, x: Any, y: Any) -> None:
    """Refuse ``x``/``y`` whose shapes or dtypes differ from the set-up step's (None passes:
    ranks that need no data may pass None once set up).

    Raises:
        NowdlError: one paragraph naming the input, both shapes and dtypes, and the fix.
    """
    xs = _tensors(x)
    if xs is not None:
        if len(xs) != len(spec.shapes):
            raise NowdlError(f"train_step: got {len(xs)} input tensor(s) but the model was set up for "
                             f"{len(spec.shapes)}: pass the same inputs every step")
        for i, (t, want) in enumerate(zip(xs, spec.shapes, strict=True)):
            got = tuple(int(d) for d in t.shape)
            want_dtype = spec.dtypes[i] if i < len(spec.dtypes) else None
            if got != want or (want_dtype is not None and t.dtype != want_dtype):
                name = "x" if len(xs) == 1 else f"input {i}"
                raise _refuse(name, got, t.dtype, want, want_dtype, len(want) > 2)
    if spec.target_shape is not None and isinstance(y, (torch.Tensor, TiledInput)):
        got = tuple(int(d) for d in y.shape)
        if got != spec.target_shape or y.dtype != spec.target_dtype:
            raise _refuse("the target y", got, y.dtype, spec.target_shape, spec.target_dtype, len(got) > 2)
