"""Autocast (bf16/fp16) on tiles: the dtypes a tiled op runs in, chosen as the unsplit op's.

[Note: tiles under autocast] The tiled ops are autograd Functions that exchange halos and call
ATen directly (``torch.convolution``, ``convolution_backward``, sum pools, norms from their
statistics). Autocast does not reach inside them consistently: ``torch.convolution`` is not on
autocast's list while ``F.conv2d`` is, a saved fp32 input would meet a bf16 output gradient in
``convolution_backward``, and a halo slab sent in one dtype would be received into a buffer of
another (gloo's "Received data size doesn't match expected size"). So each tiled op decides its
dtype OUTSIDE its Function, as autocast would for the unsplit op, casts its inputs there
(differentiable casts, as autocast makes), and runs its Function with autocast off:

* convolutions and transposed convolutions: input, weight and bias in the autocast dtype;
* pools, upsampling and norms: the dtype the unsplit op gives under the current autocast,
  found by running it on a one-pixel probe (CPU autocast runs ``max_pool3d``/``avg_pool3d`` in
  float32 and the others in their input's dtype; CUDA's lists differ: the probe follows them);
* norm statistics, the average pool's sums and linear interpolation are computed in float32
  for bf16/fp16 tensors and rounded once, as ATen's reduced-precision kernels do.

Every rank of a tile group makes the same choice, so every message has one dtype on both
ends. Without autocast nothing is cast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

__all__ = ["autocast_dtype", "conv_operands", "probe_dtype", "autocast_off", "opmath", "REDUCED"]

REDUCED = (torch.bfloat16, torch.float16)


def autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The autocast dtype active for ``x``'s device, or None when autocast is off there."""
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return None
    return torch.get_autocast_dtype(dev)


def conv_operands(x: Tensor, weight: Tensor | None, bias: Tensor | None
                  ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``x``, ``weight`` and ``bias`` cast to the autocast dtype (unchanged without autocast):
    what autocast does to the operands of ``F.conv*``."""
    dt = autocast_dtype(x)
    if dt is None or not x.is_floating_point():
        return x, weight, bias

    def cast(t: Tensor | None) -> Tensor | None:
        return t if t is None or t.dtype == dt else t.to(dt)

    return cast(x), cast(weight), cast(bias)  # type: ignore[return-value]


_PROBED: dict[tuple[str, str, torch.dtype, torch.dtype], torch.dtype] = {}


def probe_dtype(x: Tensor, key: str, op: Callable[[Tensor], Tensor], ndim: int) -> torch.dtype:
    """The dtype ``op`` (the unsplit op, e.g. ``F.max_pool3d``) gives on ``x`` under the current
    autocast: ``x``'s own dtype without autocast, else found once per (op, dtypes) on a tiny
    probe of ``x``'s dtype."""
    dt = autocast_dtype(x)
    if dt is None or not x.is_floating_point():
        return x.dtype
    k = (x.device.type, key, dt, x.dtype)
    if k not in _PROBED:
        probe = torch.zeros((1, 1) + (2,) * ndim, dtype=x.dtype, device=x.device)
        with torch.no_grad():
            _PROBED[k] = op(probe).dtype
    return _PROBED[k]


@contextlib.contextmanager
def autocast_off(x: Tensor) -> Iterator[None]:
    """Autocast disabled on ``x``'s device (a no-op context when it is off already)."""
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        yield
        return
    with torch.autocast(dev, enabled=False):
        yield


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype ATen computes a ``dtype`` reduction in: float32 for bf16/fp16, else ``dtype``."""
    return torch.float32 if dtype in REDUCED else dtype
