"""Measured compute: achieved FLOP/s or bytes/s per op class, forward and backward together.

Each class runs one representative op on real tensors of ``device``: conv2d (3x3, 32 -> 32
channels; 64 -> 64 at 512² on CUDA), conv3d (3x3x3, 16 -> 16; 32 -> 32 at 64³ on CUDA), matmul
(square ``mm``), elementwise (ReLU) and norm (training batch norm), forward and backward through autograd with a given output gradient.
The FLOPs and bytes are counted by :class:`~nowdl.profiler.flops.OpCostMode` on the very same
call (so a calibrated rate means exactly what the estimate-mode roofline divides by), and the
time is the median over repeats after warm-up. Rate = FLOPs / time for conv2d, conv3d and
matmul; bytes / time for elementwise and norm.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F  # noqa: N812

from nowdl.profiler.devices import OP_CLASSES
from nowdl.profiler.flops import OpCostMode

__all__ = ["measure_ops", "median_times", "OP_SHAPES", "CUDA_SHAPES"]

#: class -> (quick shapes, full shapes): the input's shape (matmul: n of an n x n product)
OP_SHAPES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "conv2d": ((1, 32, 64, 64), (2, 32, 128, 128)),
    "conv3d": ((1, 16, 16, 16, 16), (1, 16, 32, 32, 32)),
    "matmul": ((384,), (1024,)),
    "elementwise": ((1, 32, 128, 128), (8, 32, 128, 128)),
    "norm": ((1, 32, 64, 64), (4, 32, 128, 128)),
}

#: class -> full shapes on CUDA. A GPU runs OP_SHAPES' ops in microseconds, where launch overhead
#: and idle units dominate: on an H200 those rates made the UNet's estimate 14x slower than its
#: measured time. These are the sizes the networks nowdl plans run at (64 channels at 512²).
CUDA_SHAPES: dict[str, tuple[int, ...]] = {
    "conv2d": (1, 64, 512, 512),
    "conv3d": (1, 32, 64, 64, 64),
    "matmul": (8192,),
    "elementwise": (4, 64, 512, 512),
    "norm": (4, 64, 512, 512),
}


def _runner(op_class: str, shape: Sequence[int], device: torch.device,
            dtype: torch.dtype) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """A closure running one forward and backward of ``op_class``, and the leaves it fills with
    gradients (cleared before every run, so no accumulation is timed)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    leaves: list[torch.Tensor] = []

    def make(*s: int, grad: bool = True) -> torch.Tensor:
        t = torch.randn(*s, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)
        if grad:
            leaves.append(t)
        return t

    if op_class == "matmul":
        n = shape[0]
        a, b = make(n, n), make(n, n)
        go = make(n, n, grad=False)
        return lambda: torch.mm(a, b).backward(go), leaves
    x = make(*shape)
    c = shape[1]
    if op_class in ("conv2d", "conv3d"):
        k = (3,) * (len(shape) - 2)
        w = make(c, c, *k)
        conv = F.conv2d if op_class == "conv2d" else F.conv3d
        go = make(*shape, grad=False)
        return lambda: conv(x, w, padding=1).backward(go), leaves
    go = make(*shape, grad=False)
    if op_class == "elementwise":
        return lambda: F.relu(x).backward(go), leaves
    weight, bias = make(c), make(c)
    return lambda: F.batch_norm(x, None, None, weight, bias, training=True).backward(go), leaves


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_times(fns: Sequence[Callable[[], object]], device: torch.device, repeats: int, warmup: int,
                 before: Callable[[], object] | None = None) -> list[float]:
    """Median time of each of ``fns`` (``before`` runs untimed ahead of every call); the repeats
    go round all of them in turn, so a burst of load from other processes hits each alike."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + repeats):
        for j, fn in enumerate(fns):
            if before is not None:
                before()
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if i >= warmup:
                times[j].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _rate(op_class: str, shape: Sequence[int], device: torch.device, dtype: torch.dtype, repeats: int,
          warmup: int) -> float:
    run, leaves = _runner(op_class, shape, device, dtype)
    with OpCostMode() as counted:
        run()
    work = counted.flops if OP_CLASSES[op_class] == "flops" else counted.bytes

    def clear() -> None:
        for t in leaves:
            t.grad = None

    (median,) = median_times([run], device, repeats, warmup, before=clear)
    return work / max(median, 1e-9)


def measure_ops(device: torch.device, dtypes: Sequence[torch.dtype] = (torch.float32,), *, quick: bool = False,
                repeats: int | None = None, say: Callable[[str], None] | None = None) -> dict[str, dict[str, float]]:
    """``{dtype name: {op class: achieved rate}}`` on ``device`` (see the module docstring)."""
    reps = repeats or (3 if quick else 7)
    out: dict[str, dict[str, float]] = {}
    for dt in dtypes:
        name = str(dt).removeprefix("torch.")
        rates: dict[str, float] = {}
        for cls_, (small, big) in OP_SHAPES.items():
            shape = small if quick else CUDA_SHAPES[cls_] if device.type == "cuda" else big
            if say:
                say(f"{cls_} {name} {'x'.join(map(str, shape))}")
            rates[cls_] = _rate(cls_, shape, device, dt, reps, 1 if quick else 2)
        out[name] = rates
    return out
