"""FLOP and memory-traffic counting per aten op (FlopCounterMode formulas plus our own rules).

Conventions (a multiply-add counts 2 FLOPs):

* convolution, mm/addmm/bmm/baddbmm, attention: ``torch.utils.flop_counter`` formulas,
  e.g. conv2d = 2*N*Cout*Hout*Wout*(Cin/groups)*kh*kw. Bias additions are NOT counted
  (as FlopCounterMode); their backward formulas are used for the backward pass.
* pointwise ops (aten ops tagged ``pointwise``: add, mul, relu, sigmoid, threshold_backward,
  ...): 1 FLOP per floating-point output element (integer counters and masks: 0).
* batch/layer/group norm forward: 8 FLOPs per input element in training (mean 1, variance 3,
  normalise 2, affine 2) and 2 in eval (scale and shift); their backward: 8 per element.
* max/avg pooling forward: output numel x kernel volume; max-pool backward: grad_output
  numel; avg-pool backward: grad_output numel x kernel volume; adaptive pooling (either
  direction): input numel of the op.
* reductions (sum, mean, amax, var, ...): input numel; softmax/log_softmax (and backward):
  3 x numel.
* upsampling: nearest 0 (a copy); (bi/tri)linear 2 * 2**d per output element, bicubic
  2 * 4**d (d spatial dims), the same per grad_output element in backward.
* everything else (copies, cat, views, factories): 0 FLOPs.

Bytes moved by an op = bytes of its tensor arguments plus outputs (a broadcast view is
counted at most its storage size); view and metadata-only ops move nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from nowdl.profiler.devices import OP_CLASSES, DeviceSpec

__all__ = ["OpCostMode", "count_flops", "op_flops", "op_bytes"]

aten = torch.ops.aten

_NORM_TRAIN = 8
_NORM_EVAL = 2
_NORM_BWD = 8
_SOFTMAX = 3

_BN = {aten.native_batch_norm, aten._native_batch_norm_legit, aten.cudnn_batch_norm,
       aten.miopen_batch_norm, aten._native_batch_norm_legit_functional}
_BN_EVAL = {aten._native_batch_norm_legit_no_training}
_NORM_OTHER = {aten.native_layer_norm, aten.native_group_norm}
_NORM_BWD_OPS = {aten.native_batch_norm_backward, aten.cudnn_batch_norm_backward,
                 aten.miopen_batch_norm_backward, aten.native_layer_norm_backward,
                 aten.native_group_norm_backward}
_POOL_KERNEL = {aten.max_pool2d_with_indices, aten.max_pool3d_with_indices, aten.avg_pool2d,
                aten.avg_pool3d, aten.max_pool2d, aten.max_pool3d, aten.max_pool1d,
                aten.avg_pool1d, aten.avg_pool2d_backward, aten.avg_pool3d_backward,
                aten.mkldnn_max_pool2d, aten.mkldnn_max_pool3d}
_POOL_BWD_KERNEL_ARG = {aten.avg_pool2d_backward: 2, aten.avg_pool3d_backward: 2}
_POOL_MAX_BWD = {aten.max_pool2d_with_indices_backward, aten.max_pool3d_with_indices_backward}
_ADAPTIVE = {aten._adaptive_avg_pool2d, aten._adaptive_avg_pool3d, aten.adaptive_max_pool2d,
             aten.adaptive_max_pool3d, aten._adaptive_avg_pool2d_backward,
             aten._adaptive_avg_pool3d_backward, aten.adaptive_max_pool2d_backward,
             aten.adaptive_max_pool3d_backward}
_REDUCE = {aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.var, aten.std,
           aten.var_mean, aten.std_mean, aten.norm, aten.linalg_vector_norm, aten.prod,
           aten.logsumexp, aten.argmax, aten.argmin}
_SOFTMAX_OPS = {aten._softmax, aten._log_softmax, aten._softmax_backward_data,
                aten._log_softmax_backward_data}
_UP_NEAREST = {aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d,
               aten._upsample_nearest_exact1d, aten._upsample_nearest_exact2d,
               aten._upsample_nearest_exact3d, aten.upsample_nearest1d_backward,
               aten.upsample_nearest2d_backward, aten.upsample_nearest3d_backward}
_UP_LINEAR = {aten.upsample_linear1d: 1, aten.upsample_bilinear2d: 2,
              aten.upsample_trilinear3d: 3, aten._upsample_bilinear2d_aa: 2,
              aten.upsample_linear1d_backward: 1, aten.upsample_bilinear2d_backward: 2,
              aten.upsample_trilinear3d_backward: 3}
_UP_CUBIC = {aten.upsample_bicubic2d, aten._upsample_bicubic2d_aa,
             aten.upsample_bicubic2d_backward}
_CONV_OPS = {aten.convolution, aten._convolution, aten.convolution_backward,
             aten.cudnn_convolution, aten.cudnn_convolution_transpose}
_MM_OPS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
_FREE = {aten.detach, aten.alias, aten._unsafe_view, aten.empty, aten.empty_like,
         aten.empty_strided, aten.lift_fresh, aten.lift_fresh_copy, aten.sym_size,
         aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.is_same_size,
         aten._local_scalar_dense}


def _numel(t: Any) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else 0


def _first_tensor(x: Any) -> torch.Tensor | None:
    for t in tree_flatten(x)[0]:
        if isinstance(t, torch.Tensor):
            return t
    return None


def _kernel_volume(k: Any, dims: int) -> int:
    if isinstance(k, int):
        return k**dims
    ks = list(k)
    if len(ks) == 1:
        return int(ks[0]) ** dims
    return int(math.prod(int(v) for v in ks))


def op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs of one aten op call (see the module docstring for the formulas)."""
    packet = func.overloadpacket
    if packet in flop_registry:
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    if packet in _BN:
        training = next((a for a in args if isinstance(a, bool)), True)
        return (_NORM_TRAIN if training else _NORM_EVAL) * _numel(args[0])
    if packet in _BN_EVAL:
        return _NORM_EVAL * _numel(args[0])
    if packet in _NORM_OTHER:
        return _NORM_TRAIN * _numel(args[0])
    if packet in _NORM_BWD_OPS:
        return _NORM_BWD * _numel(args[0])
    if packet in _POOL_KERNEL:
        if packet in _POOL_BWD_KERNEL_ARG:
            grad_out = args[0]
            k = args[_POOL_BWD_KERNEL_ARG[packet]]
            return _numel(grad_out) * _kernel_volume(k, grad_out.dim() - 2)
        o = _first_tensor(out)
        if o is None:
            return 0
        dims = 3 if "3d" in packet.__name__ else 2 if "2d" in packet.__name__ else 1
        k = args[1] if len(args) > 1 else kwargs.get("kernel_size", 1)
        return _numel(o) * _kernel_volume(k, dims)
    if packet in _POOL_MAX_BWD:
        return _numel(args[0])
    if packet in _ADAPTIVE:
        return _numel(args[0])
    if packet in _REDUCE:
        return _numel(args[0])
    if packet in _SOFTMAX_OPS:
        return _SOFTMAX * _numel(args[0])
    if packet in _UP_NEAREST:
        return 0
    if packet in _UP_LINEAR:
        return _numel(_first_tensor(out)) * 2 * 2 ** _UP_LINEAR[packet]
    if packet in _UP_CUBIC:
        return _numel(_first_tensor(out)) * 2 * 4**2
    if torch.Tag.pointwise in func.tags:
        o = _first_tensor(out)
        return o.numel() if o is not None and o.is_floating_point() else 0
    return 0


def _tensor_bytes(t: torch.Tensor) -> int:
    b = t.numel() * t.element_size()
    try:
        return min(b, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return b


def op_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Bytes an op reads and writes (0 for views and metadata-only ops)."""
    if func.is_view or func.overloadpacket in _FREE:
        return 0
    total = 0
    for t in tree_flatten((args, kwargs, out))[0]:
        if isinstance(t, torch.Tensor):
            total += _tensor_bytes(t)
    return total


def _tensor_core(packet: Any) -> bool | None:
    """Whether ``packet`` may use TF32 tensor cores for float32 (None: not a matmul op)."""
    if packet in _CONV_OPS:
        return bool(torch.backends.cudnn.allow_tf32)
    if packet in _MM_OPS:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    return None


_NORM_ALL = _BN | _BN_EVAL | _NORM_OTHER | _NORM_BWD_OPS


def _op_class(func: Any, args: tuple[Any, ...]) -> str | None:
    """The calibrated op class (``DeviceSpec.op_throughput``) of an aten op, None for the others."""
    packet = func.overloadpacket
    if packet in _CONV_OPS:
        w = args[2] if packet is aten.convolution_backward and len(args) > 2 else args[1] if len(args) > 1 else None
        return "conv3d" if isinstance(w, torch.Tensor) and w.dim() == 5 else "conv2d"
    if packet in _MM_OPS:
        return "matmul"
    if packet in _NORM_ALL:
        return "norm"
    if torch.Tag.pointwise in func.tags:
        return "elementwise"
    return None


class OpCostMode(TorchDispatchMode):
    """Counts FLOPs, bytes moved and (given a DeviceSpec) roofline seconds of every aten op.

    Roofline time of one op = max(flops / peak, bytes / mem_bw), summed over ops; matmul and
    convolution ops use the spec's rate for their dtype (TF32 for float32 when torch allows
    TF32 for that op kind), every other op the float32 CUDA-core rate. When the spec holds a
    calibrated rate for the op's class and dtype (``op_throughput``, from ``nowdl calibrate``),
    that rate replaces the peak: FLOP/s for conv2d/conv3d/matmul, bytes/s (in place of
    ``mem_bw``) for elementwise and norm ops.

    [Note: op efficiency] A GPU reaches a fraction of its peak that grows with an op's size: a
    3x3 convolution of 64 channels at 2048² runs at about half the TF32 peak on an H200, a
    BatchNorm on 16 MiB far below the memory bandwidth, and every kernel launch costs a few
    microseconds. A spec fitted from a GPU's records (``benchmarks/fit_specs.py``) holds both:
    the roofline time of each op is divided by ``efficiency(class, work) = top x work / (work +
    half)`` (work: FLOPs for the FLOP classes, bytes for the others; ``DeviceSpec.op_efficiency``),
    and every op that does work adds ``op_floor_s``. Without a fit both are neutral (1 and 0).
    """

    def __init__(self, spec: DeviceSpec | None = None, *, record: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.record: list[tuple[str, float, float, float]] | None = [] if record else None
        """With ``record``: per op that did work, (class or "other", work, roofline seconds at the
        peaks, FLOPs): what ``benchmarks/fit_specs.py`` fits efficiencies and the floor to."""
        self.flops = 0
        self.bytes = 0
        self.seconds = 0.0
        self.ops = 0  # aten ops that did work (FLOPs or bytes), each charged the spec's floor

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        f = op_flops(func, args, kwargs, out)
        b = op_bytes(func, args, kwargs, out)
        self.flops += f
        self.bytes += b
        if self.spec is not None and (f or b):
            packet = func.overloadpacket
            tc = _tensor_core(packet)
            t = _first_tensor(args)
            dtype = t.dtype if t is not None else torch.float32
            if tc is None:
                peak = self.spec.fp32_flops
            else:
                peak = self.spec.flops_for(dtype, tf32=tc)
            op_class = _op_class(func, args)
            rate = self.spec.achieved(op_class, dtype) if op_class is not None else None
            if rate is not None and op_class is not None and OP_CLASSES[op_class] == "flops":
                secs = max(f / rate, b / self.spec.mem_bw)
            elif rate is not None:
                secs = max(f / self.spec.fp32_flops, b / rate)
            else:
                secs = max(f / peak, b / self.spec.mem_bw)
            # [Note: op efficiency]
            by_flops = op_class is not None and OP_CLASSES[op_class] == "flops" or (op_class is None and f > 0)
            if self.record is not None:
                self.record.append((op_class or "other", float(f if by_flops else b), secs, float(f)))
            secs /= self.spec.efficiency(op_class, f if by_flops else b)
            self.seconds += secs + (self.spec.op_floor_s or 0.0)
            self.ops += 1
        return out


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Forward FLOPs of ``fn(*args, **kwargs)`` with this module's conventions."""
    with OpCostMode() as mode:
        fn(*args, **kwargs)
    return mode.flops
