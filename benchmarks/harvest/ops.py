"""Forward and backward time, FLOPs, bytes and workspace of single ops over a grid of shapes and dtypes.

Each row is one op on random tensors: forward timed alone, backward timed alone (``autograd.grad``
of the output with a random output gradient, a fresh forward before each), with CUDA events (or
the host clock on CPU), the median of ``repeats`` after ``warmup``. FLOPs and bytes come from
nowdl's own counter (:class:`nowdl.profiler.flops.OpCostMode`), so a fitted rate means what the
estimate divides by. ``fwd_ws``/``bwd_ws``: the allocator's peak during the call above what was
allocated before it plus the call's outputs (on CUDA: the library workspace, cuDNN's for convs).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from nowdl.profiler.flops import OpCostMode

__all__ = ["op_grid", "run_op", "time_fn"]

Make = Callable[[torch.device, torch.dtype, torch.Generator], tuple[Callable[..., Any], list[torch.Tensor]]]


def _rand(g: torch.Generator, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype,
          grad: bool = True) -> torch.Tensor:
    t = torch.randn(shape, generator=g, device=device if g.device.type == device.type else "cpu")
    return t.to(device=device, dtype=dtype).requires_grad_(grad)


def conv(dims: int, cin: int, cout: int, side: int, k: int = 3, stride: int = 1, n: int = 1,
         transpose: bool = False) -> tuple[str, dict[str, Any], Make]:
    shape = (n, cin) + (side,) * dims
    fn = {(2, False): F.conv2d, (3, False): F.conv3d, (2, True): F.conv_transpose2d,
          (3, True): F.conv_transpose3d}[(dims, transpose)]
    wshape = (cin, cout) + (k,) * dims if transpose else (cout, cin) + (k,) * dims
    pad = 0 if transpose else k // 2

    def make(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple[Callable[..., Any], list[torch.Tensor]]:
        x, w = _rand(g, shape, device, dtype), _rand(g, wshape, device, dtype)
        return (lambda x, w: fn(x, w, stride=stride, padding=pad)), [x, w]

    name = f"conv_transpose{dims}d" if transpose else f"conv{dims}d"
    return name, {"input": list(shape), "weight": list(wshape), "stride": stride, "padding": pad}, make


def unary(name: str, dims: int, c: int, side: int, n: int = 1) -> tuple[str, dict[str, Any], Make]:
    shape = (n, c) + (side,) * dims
    ops: dict[str, Callable[..., Any]] = {
        "relu": F.relu, "leaky_relu": lambda x: F.leaky_relu(x, 0.01), "sigmoid": torch.sigmoid,
        "max_pool": lambda x: (F.max_pool2d if dims == 2 else F.max_pool3d)(x, 2),
        "avg_pool": lambda x: (F.avg_pool2d if dims == 2 else F.avg_pool3d)(x, 2),
        "adaptive_avg_pool": lambda x: (F.adaptive_avg_pool2d if dims == 2 else F.adaptive_avg_pool3d)(x, 1),
        "upsample_nearest": lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
        "upsample_linear": lambda x: F.interpolate(x, scale_factor=2, mode="bilinear" if dims == 2 else "trilinear",
                                                   align_corners=False),
        "dropout": lambda x: F.dropout(x, 0.1, training=True),
    }
    op = ops[name]

    def make(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple[Callable[..., Any], list[torch.Tensor]]:
        return op, [_rand(g, shape, device, dtype)]

    return name, {"input": list(shape)}, make


def binary(name: str, dims: int, c: int, side: int) -> tuple[str, dict[str, Any], Make]:
    shape = (1, c) + (side,) * dims
    op = {"add": torch.add, "mul": torch.mul, "cat": lambda a, b: torch.cat([a, b], 1)}[name]

    def make(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple[Callable[..., Any], list[torch.Tensor]]:
        return op, [_rand(g, shape, device, dtype), _rand(g, shape, device, dtype)]

    return name, {"input": list(shape)}, make


def norm(name: str, dims: int, c: int, side: int, n: int = 1) -> tuple[str, dict[str, Any], Make]:
    shape = (n, c) + (side,) * dims

    def make(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple[Callable[..., Any], list[torch.Tensor]]:
        x = _rand(g, shape, device, dtype)
        w, b = _rand(g, (c,), device, dtype), _rand(g, (c,), device, dtype)
        if name == "batch_norm":
            return (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)), [x, w, b]
        if name == "instance_norm":
            return (lambda x, w, b: F.instance_norm(x, weight=w, bias=b)), [x, w, b]
        return (lambda x, w, b: F.group_norm(x, min(8, c), w, b)), [x, w, b]

    return name, {"input": list(shape)}, make


def linear(n: int, fin: int, fout: int) -> tuple[str, dict[str, Any], Make]:
    def make(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple[Callable[..., Any], list[torch.Tensor]]:
        return F.linear, [_rand(g, (n, fin), device, dtype), _rand(g, (fout, fin), device, dtype)]

    return "linear", {"input": [n, fin], "weight": [fout, fin]}, make


def op_grid(cpu: bool) -> Iterator[tuple[str, dict[str, Any], Make, tuple[str, ...]]]:
    """(op, params, maker, dtypes) in priority order: what UNets, ResNets and 3D nets run at the sizes
    nowdl plans, from launch-bound small shapes to memory-filling ones."""
    both = ("float32", "bfloat16")
    if cpu:
        yield (*conv(2, 8, 8, 32), ("float32",))
        yield (*conv(3, 4, 4, 8), ("float32",))
        yield (*norm("instance_norm", 2, 8, 32), ("float32",))
        yield (*unary("max_pool", 2, 8, 32), ("float32",))
        yield (*binary("cat", 2, 8, 32), ("float32",))
        return
    # 2D 3x3 convs, C in = C out, over (channels, side) pairs a UNet/ResNet meets
    for c, s in ((64, 2048), (64, 1024), (128, 1024), (128, 512), (256, 512), (256, 256), (512, 256), (512, 128),
                 (1024, 64), (32, 4096), (16, 1024), (16, 256), (32, 128), (64, 64), (16, 32)):
        yield (*conv(2, c, c, s), both)
    yield (*conv(2, 3, 64, 2048), both)  # a first conv
    yield (*conv(2, 64, 128, 1024, stride=2), both)  # a strided conv
    yield (*conv(2, 64, 256, 512, k=1), both)  # ResNet bottleneck 1x1s
    yield (*conv(2, 256, 64, 512, k=1), both)
    yield (*conv(2, 64, 2, 2048, k=1), both)  # a UNet head
    yield (*conv(2, 128, 64, 1024, k=2, stride=2, transpose=True), both)
    yield (*conv(2, 512, 256, 256, k=2, stride=2, transpose=True), both)
    # 3D
    for c, s in ((32, 128), (32, 64), (64, 64), (128, 32), (256, 16), (320, 8), (16, 128), (16, 32)):
        yield (*conv(3, c, c, s), both)
    yield (*conv(3, 1, 32, 128), both)
    yield (*conv(3, 64, 32, 64, k=2, stride=2, transpose=True), both)
    # norms, pools, upsampling, elementwise
    for kind in ("batch_norm", "instance_norm", "group_norm"):
        for dims, c, s in ((2, 64, 2048), (2, 64, 1024), (2, 256, 256), (2, 32, 128), (3, 32, 128), (3, 128, 32)):
            yield (*norm(kind, dims, c, s), both)
    for kind in ("max_pool", "avg_pool", "upsample_nearest", "upsample_linear", "relu", "leaky_relu", "adaptive_avg_pool",
                 "dropout", "sigmoid"):
        for dims, c, s in ((2, 64, 2048), (2, 128, 512), (2, 32, 128), (3, 32, 128), (3, 64, 32)):
            yield (*unary(kind, dims, c, s), both)
    for kind in ("add", "mul", "cat"):
        for dims, c, s in ((2, 64, 2048), (2, 128, 512), (2, 32, 128), (3, 32, 128)):
            yield (*binary(kind, dims, c, s), both)
    yield (*linear(8, 2048, 1000), both)
    yield (*linear(4096, 4096, 4096), both)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int,
            before: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``fn()`` (``before()`` runs untimed ahead of each call)."""
    times = []
    for i in range(warmup + repeats):
        ctx = before() if before is not None else None
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn() if ctx is None else fn(ctx)
            b.record()
            b.synchronize()
            dt = a.elapsed_time(b) / 1e3
        else:
            t = time.perf_counter()
            fn() if ctx is None else fn(ctx)
            dt = time.perf_counter() - t
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


def _alloc(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _peak_above(fn: Callable[[], Any], device: torch.device) -> tuple[Any, int]:
    """``fn()`` and the allocator peak during it above what was allocated before it (CUDA; 0 on CPU)."""
    if device.type != "cuda":
        return fn(), 0
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    _sync(device)
    return out, torch.cuda.max_memory_allocated(device) - base


def _nbytes(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(_nbytes(x) for x in v)
    return 0


def run_op(op: str, params: dict[str, Any], make: Make, dtype: torch.dtype, device: torch.device, repeats: int,
           warmup: int, layout: str = "contiguous") -> dict[str, Any]:
    """One grid row: times, FLOPs, bytes and workspaces of ``op`` in ``dtype`` and ``layout``."""
    g = torch.Generator().manual_seed(0)
    fn, ins = make(device, dtype, g)
    if layout == "channels_last":
        fmt = torch.channels_last if ins[0].dim() == 4 else torch.channels_last_3d
        ins = [t.detach().to(memory_format=fmt).requires_grad_(True) if t.dim() >= 4 else t for t in ins]
    with torch.no_grad():
        out0 = fn(*ins)
    go = torch.randn_like(out0)
    _, first_peak = _peak_above(lambda: fn(*ins), device)  # the first call: cuDNN's benchmark trials run here
    with OpCostMode() as counted:
        fn(*ins)
    fwd_s = time_fn(lambda: fn(*ins), device, repeats, warmup)
    fresh = lambda: fn(*ins)  # noqa: E731 - a new graph for every backward
    bwd_s = time_fn(lambda out: torch.autograd.grad(out, ins, go), device, repeats, warmup, before=fresh)
    out, fwd_peak = _peak_above(lambda: fn(*ins), device)
    out_bytes = _nbytes(out)
    grads, bwd_peak = _peak_above(functools.partial(torch.autograd.grad, out, ins, go), device)
    grad_bytes = _nbytes(grads)
    out = grads = None  # freed before the counted pass
    try:
        with OpCostMode() as counted_bwd:
            o = fn(*ins)
            torch.autograd.grad(o, ins, go)
        fb = (int(counted_bwd.flops), int(counted_bwd.bytes))
    except Exception:  # noqa: BLE001 - the counter may not see the backward's thread: leave it out
        fb = (-1, -1)
    return {"op": op, "dtype": str(dtype).removeprefix("torch."), "layout": layout, **params,
            "flops": int(counted.flops), "bytes": int(counted.bytes), "fwd_bwd_flops": fb[0],
            "fwd_bwd_bytes": fb[1], "out_bytes": out_bytes, "fwd_s": fwd_s, "bwd_s": bwd_s,
            "fwd_ws": max(0, fwd_peak - out_bytes), "first_call_ws": max(0, first_peak - out_bytes), "bwd_ws": max(0, bwd_peak - grad_bytes),
            "cudnn_benchmark": torch.backends.cudnn.benchmark, "cudnn_tf32": torch.backends.cudnn.allow_tf32}
