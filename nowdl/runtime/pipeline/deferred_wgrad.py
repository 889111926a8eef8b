"""Deferred weight gradients for the zero-bubble schedule: a backward's ``B`` now, its ``W`` later.

[Note: deferred weight gradients] Under ``schedule="zb"`` the engine runs each micro-batch's
backward in two actions ([Note: zero-bubble order] in schedule/zero_bubble_order.py): ``B``
computes the gradients of the stage's inputs, which the stage before waits for, and ``W`` the
gradients of the weights of its convolutions and linear layers, which nobody needs before the
optimizer step. :func:`enable` switches the class of every ``nn.Conv{1,2,3}d``,
``nn.ConvTranspose{1,2,3}d`` and ``nn.Linear`` of a stage module to a subclass whose forward,
only inside :func:`capturing` (the engine's forward of a zero-bubble stage), runs through an
autograd Function. Its backward computes the input gradient exactly as autograd's own
convolution / linear backward does (``aten.convolution_backward`` with the weight outputs
masked off; ``grad @ W`` for linear) and, inside :func:`deferring` (the engine's ``B``), queues
the (saved input, output gradient) pair instead of computing the weight and bias gradients;
the ``W`` action (:func:`run_weight_grads`) computes them with the same aten ops
(``aten.convolution_backward`` with only the weight and bias outputs; ``grad^T @ x`` and the
sum over rows for linear) and accumulates them into ``.grad`` in micro-batch order, a layer's
contributions summed before they are added, as autograd sums a shared weight's.

Outside those contexts the subclasses ARE the original modules (``super().forward``): the
model behaves as before in every other use. Norm layers and other parameters keep their
gradients in ``B``; activation-checkpointed, spatial and autocast stages are not deferred (their
``W`` is empty), so they stay exact too. The queued pair holds the layer's input and its output
gradient until ``W`` runs: that is the memory the cost model charges for a micro-batch in flight
until its ``W`` ([Note: held buffers] in partitioner/costs/held_tensors.py).

[Note: W holds no graph] The queued ``compute`` keeps the input *detached*: a saved tensor
unpacked in a backward carries its producer's ``grad_fn``, and through it the whole graph above
(each ``AccumulateGrad`` node holds its leaf), so a layer whose input came from a ``cat`` of
received tensors kept every receive buffer of the micro-batch alive until ``W`` (the UNet's zb
last stage at K = 4: three more micro-batches of them, 1.28x its prediction). The values are
the same storage, so the weight gradients are unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["WeightGrad", "enable", "capturing", "deferring", "run_weight_grads"]

_aten = torch.ops.aten


@dataclass
class WeightGrad:
    """One queued weight-gradient computation: ``compute()`` gives the gradients of ``params``."""

    params: tuple[nn.Parameter | None, ...]
    compute: Callable[[], tuple[Tensor | None, ...]]


class _State:
    capture = False
    sink: list[WeightGrad] | None = None


_STATE = _State()


@contextlib.contextmanager
def capturing(on: bool = True) -> Iterator[None]:
    """Forwards inside build graphs whose weight gradients can be deferred."""
    old = _STATE.capture
    _STATE.capture = on
    try:
        yield
    finally:
        _STATE.capture = old


@contextlib.contextmanager
def deferring(sink: list[WeightGrad]) -> Iterator[None]:
    """Backwards inside queue their deferrable weight gradients into ``sink``."""
    old = _STATE.sink
    _STATE.sink = sink
    try:
        yield
    finally:
        _STATE.sink = old


def _finish(ctx: Any, compute: Callable[[], tuple[Tensor | None, ...]]) -> tuple[Tensor | None, ...]:
    """Weight grads now (no sink: an ordinary backward) or queued (returned as None)."""
    params = ctx.params
    if not any(p is not None and p.requires_grad for p in params):
        return (None,) * len(params)
    if _STATE.sink is None:
        return compute()
    _STATE.sink.append(WeightGrad(params, compute))
    return (None,) * len(params)


class _ConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, geom: tuple[Any, ...]) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.geom = geom
        ctx.params = (weight, bias)
        return _aten.convolution(x, weight, bias, *geom)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        geom = ctx.geom
        bias = ctx.params[1]
        bias_sizes = list(bias.shape) if bias is not None else None
        gi = None
        if ctx.needs_input_grad[0]:
            gi = _aten.convolution_backward(g, x, w, bias_sizes, *geom, [True, False, False])[0]
        x = x.detach()  # [Note: W holds no graph]
        want_w, want_b = bool(ctx.needs_input_grad[1]), bias is not None and bool(ctx.needs_input_grad[2])

        def compute() -> tuple[Tensor | None, ...]:
            _, gw, gb = _aten.convolution_backward(g, x, w, bias_sizes, *geom, [False, want_w, want_b])
            return (gw if want_w else None, gb if want_b else None)

        gw, gb = _finish(ctx, compute)
        return gi, gw, gb, None


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)
        return _aten.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        bias = ctx.params[1]
        gi = g.matmul(w) if ctx.needs_input_grad[0] else None
        x = x.detach()  # [Note: W holds no graph]
        want_w, want_b = bool(ctx.needs_input_grad[1]), bias is not None and bool(ctx.needs_input_grad[2])

        def compute() -> tuple[Tensor | None, ...]:
            g2 = g.reshape(-1, g.shape[-1])
            gw = g2.t().mm(x.reshape(-1, x.shape[-1])) if want_w else None
            gb = g2.sum(0) if want_b else None
            return gw, gb

        gw, gb = _finish(ctx, compute)
        return gi, gw, gb


def _can_defer(x: Tensor) -> bool:
    return _STATE.capture and torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type)


def _conv_forward(self: Any, transposed: bool, x: Tensor, *rest: Any) -> Tensor:
    if (not _can_defer(x) or rest or self.padding_mode != "zeros" or isinstance(self.padding, str)
            or x.dim() == len(self.kernel_size) + 1):  # unbatched input: let the module handle it
        return super(type(self), self).forward(x, *rest)  # type: ignore[no-any-return]
    out_pad = list(self.output_padding) if transposed else [0] * len(self.kernel_size)
    geom = (list(self.stride), list(self.padding), list(self.dilation), transposed, out_pad, self.groups)
    return _ConvFn.apply(x, self.weight, self.bias, geom)  # type: ignore[no-any-return]


class _Conv1d(nn.Conv1d):
    def forward(self, x: Tensor, *rest: Any) -> Tensor:
        return _conv_forward(self, False, x, *rest)


class _Conv2d(nn.Conv2d):
    def forward(self, x: Tensor, *rest: Any) -> Tensor:
        return _conv_forward(self, False, x, *rest)


class _Conv3d(nn.Conv3d):
    def forward(self, x: Tensor, *rest: Any) -> Tensor:
        return _conv_forward(self, False, x, *rest)


class _ConvTranspose1d(nn.ConvTranspose1d):
    def forward(self, x: Tensor, *rest: Any) -> Tensor:  # type: ignore[override]
        return _conv_forward(self, True, x, *rest)


class _ConvTranspose2d(nn.ConvTranspose2d):
    def forward(self, x: Tensor, *rest: Any) -> Tensor:  # type: ignore[override]
        return _conv_forward(self, True, x, *rest)


class _ConvTranspose3d(nn.ConvTranspose3d):
    def forward(self, x: Tensor, *rest: Any) -> Tensor:  # type: ignore[override]
        return _conv_forward(self, True, x, *rest)


class _Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        if not _can_defer(x):
            return super().forward(x)
        return _LinearFn.apply(x, self.weight, self.bias)  # type: ignore[no-any-return]


_SWAP: dict[type, type] = {
    nn.Conv1d: _Conv1d, nn.Conv2d: _Conv2d, nn.Conv3d: _Conv3d, nn.ConvTranspose1d: _ConvTranspose1d,
    nn.ConvTranspose2d: _ConvTranspose2d, nn.ConvTranspose3d: _ConvTranspose3d, nn.Linear: _Linear,
}


def enable(module: nn.Module) -> int:
    """Switch ``module``'s convolutions and linear layers (exactly those classes, not subclasses)
    to their deferrable subclasses, in place; returns how many. Idempotent."""
    n = 0
    for m in module.modules():
        new = _SWAP.get(type(m))
        if new is not None:
            m.__class__ = new
        if type(m) in _SWAP.values():
            n += 1
    return n


def run_weight_grads(queue: list[WeightGrad], on_final: Callable[[Tensor], None] | None = None) -> None:
    """Compute the queued weight gradients and add them to ``.grad`` (one sum per parameter).

    Args:
        on_final: called with each parameter once its gradient is added (the gradient sync's
            buckets, when this is the stage's last ``W`` of the step).
    """
    total: dict[int, tuple[nn.Parameter, Tensor]] = {}
    for item in queue:
        for p, g in zip(item.params, item.compute(), strict=True):
            if p is None or g is None:
                continue
            prev = total.get(id(p))
            total[id(p)] = (p, g if prev is None else prev[1] + g)
    queue.clear()
    with torch.no_grad():
        for p, g in total.values():
            if p.grad is None:
                p.grad = g.detach()
            else:
                p.grad += g
            if on_final is not None:
                on_final(p)
