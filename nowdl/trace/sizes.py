"""Input sizes a network cannot take: which multiple its spatial sizes need.

[Note: size multiples] A UNet with two stride-2 levels takes 512 or 508 pixels but not 510: its
decoder meets the encoder's 255-pixel map with a 254-pixel one. The graph fails deep inside
(a ``torch.cat`` or an add), and the message would name an fx node and two odd numbers.
:func:`size_refusal` finds what the network needs instead: the smallest multiple ``m`` (among
the divisors of the product of the graph's strides) such that the nearest multiples of ``m``
below and above the given size both run through the graph, on fake tensors (nothing is
allocated), and says so with the sizes to use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

__all__ = ["size_refusal", "runs_at", "stride_product"]

_STRIDED_FN = {F.conv1d, F.conv2d, F.conv3d, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d,
               F.avg_pool2d, F.avg_pool3d}
_MAX_MULTIPLE = 1024


def _strides(v: object) -> list[int]:
    if isinstance(v, (tuple, list)):
        return [int(s) for s in v if isinstance(s, int)]
    return [int(v)] if isinstance(v, int) else []


def stride_product(gm: fx.GraphModule) -> int:
    """The product of the largest stride of every strided conv and pool in ``gm``, transposed
    convs left out (an upper bound on the multiple its input sizes may need)."""
    prod = 1
    for n in gm.graph.nodes:
        s: list[int] = []
        if n.op == "call_module":
            m = gm.get_submodule(str(n.target))
            if isinstance(m, nn.modules.conv._ConvTransposeNd):
                pass  # upsamples
            elif isinstance(m, (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)):
                s = _strides(m.stride if m.stride is not None else getattr(m, "kernel_size", 1))
        elif n.op == "call_function" and n.target in _STRIDED_FN:
            stride = n.kwargs.get("stride", n.args[2] if len(n.args) > 2 else None)
            if stride is None and "pool" in getattr(n.target, "__name__", ""):
                stride = n.kwargs.get("kernel_size", n.args[1] if len(n.args) > 1 else 1)
            s = _strides(stride)
        prod *= max([1, *s])
        if prod > _MAX_MULTIPLE:
            return _MAX_MULTIPLE
    return prod


def runs_at(gm: fx.GraphModule, inputs: Sequence[torch.Tensor], spatial: Sequence[int]) -> bool:
    """Whether ``gm`` runs on fake copies of ``inputs`` whose spatial sizes are ``spatial``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode:
            fake = [torch.empty((*x.shape[:2], *spatial), dtype=x.dtype) if x.dim() == 2 + len(spatial)
                    else torch.empty(x.shape, dtype=x.dtype) for x in inputs]
            was = gm.training
            try:
                gm.eval()
                gm(*fake)
            finally:
                gm.train(was)
    except Exception:  # noqa: BLE001 (this size does not fit the network)
        return False
    return True


def size_refusal(gm: fx.GraphModule, inputs: Sequence[torch.Tensor], name: str) -> str | None:
    """The message for an input size the network cannot take but a nearby multiple can (see
    [Note: size multiples]); None when the size runs, or no multiple explains the failure."""
    if not inputs or inputs[0].dim() < 3:
        return None
    spatial = [int(d) for d in inputs[0].shape[2:]]
    if runs_at(gm, inputs, spatial):
        return None
    top = stride_product(gm)
    for m in (d for d in range(2, top + 1) if top % d == 0):
        if all(s % m == 0 for s in spatial):
            continue  # already a multiple of m, and it fails: m is not the cause
        down = [max(m, s // m * m) for s in spatial]
        up = [math.ceil(s / m) * m for s in spatial]
        if runs_at(gm, inputs, down) and runs_at(gm, inputs, up):
            shape = "x".join(map(str, inputs[0].shape))
            alts = " or ".join(dict.fromkeys("x".join(map(str, (*inputs[0].shape[:2], *v))) for v in (down, up)))
            return (f"{name} cannot take an input of {shape}: its spatial sizes must be multiples of {m} (paths "
                    f"through its strided convs or pools meet again and must agree in size): use {alts}, or crop or pad the images to a multiple of {m}")
    return None
