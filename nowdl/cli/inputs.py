"""``--input``: the whole input of one micro-batch, batch first, in every command.

``nowdl plan``, ``nowdl profile`` and ``nowdl run`` read ``--input NxCxHxW`` (``NxCxDxHxW`` for 3D
models) the same way: N samples per micro-batch, then one sample's shape. A shape one dimension
short of what the model takes is refused with the fix (``--input 1x3x512x512``, not ``3x512x512``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from nowdl.errors import NowdlError
from nowdl.units import parse_shape

__all__ = ["example_inputs", "first_layer", "whole_input"]

_SPATIAL = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3, nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2,
            nn.ConvTranspose3d: 3, nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3, nn.AvgPool1d: 1,
            nn.AvgPool2d: 2, nn.AvgPool3d: 3}


def first_layer(model: nn.Module) -> tuple[int, int | None] | None:
    """``(rank, channels)`` of the input the model's first convolution or pooling takes (the rank
    counts the batch; channels is None for a pooling); None when the model has neither."""
    for mod in model.modules():
        dims = _SPATIAL.get(type(mod))
        if dims is not None:
            return dims + 2, getattr(mod, "in_channels", None)
    return None


def whole_input(text: str, *, default: Sequence[int] | None = None, model: nn.Module | None = None) -> tuple[int, ...]:
    """Parse ``--input text``, the whole input batch first; refuse a shape without the batch.

    The input expected is ``default`` (the built-in model's or the plan's) or, without one, what
    ``model``'s first convolution or pooling takes. A shape one dimension short whose first
    dimension is the expected channel count lacks the batch.

    Raises:
        NowdlError: ``text`` is not a shape, or it has no batch dimension.
    """
    shape = tuple(parse_shape(text))
    want = ((len(default), default[1] if len(default) > 1 else None) if default is not None
            else first_layer(model) if model is not None else None)
    if want is not None and len(shape) == want[0] - 1 and want[1] in (None, shape[0]):
        raise NowdlError(f"--input {text} has no batch dimension: give the whole input, batch first, e.g. "
                         f"--input 1x{'x'.join(map(str, shape))} (N samples per micro-batch, then one sample's "
                         f"{want[0] - 1} dims)")
    return shape


def example_inputs(shape_texts: list[str] | None, default: list[int] | None, mode: str,
             model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """The example inputs of `nowdl plan`/`profile`: one tensor per ``--input`` (a model whose forward() takes several images gets several)."""
    if not shape_texts:
        if default is None:
            raise NowdlError("give --input SHAPE (e.g. --input 1x3x2048x2048): this model has no default input")
        shapes = [default]
    else:
        shapes = [list(whole_input(shape_texts[0], default=default, model=model)),
                  *(parse_shape(t) for t in shape_texts[1:])]
    if mode == "measure":
        return tuple(torch.randn(s) for s in shapes)
    return tuple(torch.empty(s, device="meta") for s in shapes)
