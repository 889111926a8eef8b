"""What a stage keeps of its outputs until their backward: the autograd edge, not the tensor.

[Note: backward roots] A stage's backward starts from its outputs and the gradients received for
them. Autograd needs only where each output enters the graph (its ``GradientEdge``), not its
values: keeping the output tensor itself held every in-flight micro-batch's outputs, also those no
node of the stage saves (a residual ``add`` read by the next stage's ``relu``, a UNet decoder's
output read by the next stage's ``cat``), one copy per micro-batch in flight, never charged by the
plan (UNet K = 4 GPipe M = 8 rank 2: 9.54 MiB measured, 1.10x its plan; with edges 9.16 MiB,
1.06x; ResNet-20 K = 4 GPipe M = 4 rank 1 was 1.10x too). :class:`Root` keeps the
edge and the output's dtype, shape and device; the output's memory then goes when its send is
done and nothing in the stage saved it. ``torch.autograd.backward`` takes edges since torch 2.7;
with an older torch the tensor itself is kept (:func:`edges`: probed on the first output that
needs a backward, since the probe's backward imports sympy, a second that prediction never needs).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["Root", "edges"]


@functools.cache
def edges() -> bool:
    """Whether this torch's ``autograd.backward`` accepts ``GradientEdge`` roots (2.7 and later)."""
    try:
        from torch.autograd.graph import get_gradient_edge

        x = torch.ones(1, requires_grad=True)
        with torch.enable_grad():  # the first Root may be made under no_grad's sibling modes
            torch.autograd.backward([get_gradient_edge(x * 2)], [torch.ones(1)])
        return x.grad is not None
    except (ImportError, TypeError, RuntimeError, AttributeError):
        return False


class Root:
    """One output of a stage as its backward needs it: the gradient edge (or the tensor on an
    older torch), and the dtype, shape and device its received gradient must have."""

    __slots__ = ("target", "requires_grad", "dtype", "shape", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.requires_grad = t.requires_grad
        self.target: Any = None  # nothing to start a backward from
        if t.requires_grad:
            if edges():
                from torch.autograd.graph import get_gradient_edge

                self.target = get_gradient_edge(t)
            else:
                self.target = t
        self.dtype, self.shape, self.device = t.dtype, t.shape, t.device

    def zeros(self) -> torch.Tensor:
        """A zero gradient for this output (to add received tile pieces into)."""
        return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
