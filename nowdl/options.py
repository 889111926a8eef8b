"""The settings of nowdl.compile besides the PlanRequest, checked when made: planner tuning and runtime options.

Every check raises a NowdlError whose first line names the argument, the bad value and the
fix, e.g. ``precision='fp8' is not one of fp32, bf16, fp16: ...``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from nowdl.backends import backend_name
from nowdl.errors import NowdlError
from nowdl.optimizers import OptimizerSpec, check_optimizer
from nowdl.partitioner.search.halo_fusion import check_policy
from nowdl.profiler.devices import BUILTIN_SPECS, DeviceSpec
from nowdl.profiler.profile_graph import PRECISIONS

__all__ = ["ANYTIME_S", "EXACT_S", "PlannerOptions", "RuntimeOptions", "LossFn", "DeviceSpecLike", "CacheSetting", "MODES", "TRACERS"]

#: ``loss_fn(output, target)``: a scalar mean over the micro-batch
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: a built-in spec name ("h100", "cpu", ...), a DeviceSpec JSON path, or a DeviceSpec
DeviceSpecLike = str | DeviceSpec | os.PathLike[str]
#: the profile cache: True (the default folder), False (none) or a folder
CacheSetting = bool | str | os.PathLike[str]

MODES = ("auto", "estimate", "measure")
ANYTIME_S = 30.0  # plan()'s bound without a time limit: wide graphs' anytime split ([Note: anytime split])
# needs far less; the exact DP's splits whose long-skip waits need a small MILP keep their budget
EXACT_S = 600.0  # plan()'s bound with exact=True and no time limit
TRACERS = ("auto", "fx", "export")


def _choice(name: str, value: object, choices: Sequence[str], hint: str = "") -> None:
    if not isinstance(value, str) or value not in choices:
        raise NowdlError(f"{name}={value!r} is not one of {', '.join(choices)}{': ' + hint if hint else ''}")


def _seconds(name: str, value: object, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise NowdlError(f"{name} must be positive seconds, got {value!r}: pass e.g. {example}")


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """How the planner traces and searches (``nowdl.compile(..., planner=PlannerOptions(...))``).

    Attributes:
        time_limit: seconds ``plan()`` may take: what tracing and profiling leave of it goes to
            the configuration search, whose MILP shares it among the best few configurations;
            a solve stopped by it reports status "feasible" and its gap. None (the default):
            the anytime search, ``ANYTIME_S`` at most: graphs too wide for the exact DP get the
            best heuristic split (contracted regions, local search) with its LP bound's gap,
            and no MILP. Set, it asks the MILP to improve that split for that long.
        mip_gap: the MILP stops once its split is proven within this relative gap (0: exact).
        exact: prove the split with the MILP (``time_limit`` or ``EXACT_S`` seconds; ``nowdl
            plan --exact``).
        leaf_modules: module types or qualified names the fx tracer keeps opaque (placed whole).
        tracer: "auto" (fx, else torch.export), "fx" or "export".
        norm_schedule: how a stage of sequential tiles gathers its norms' statistics: "auto" (the
            cheaper that fits host memory), "passes" (statistics passes) or "layerwise" (the
            forward's pass boundaries in host memory; refused when they do not fit), [Note:
            layer-wise norms cost].
    """

    time_limit: float | None = None
    mip_gap: float = 0.01
    leaf_modules: Sequence[type[nn.Module] | str] = ()
    tracer: str = "auto"
    exact: bool = False
    norm_schedule: str = "auto"

    @property
    def budget(self) -> tuple[float, bool]:
        """(seconds ``plan()`` may take, whether the MILP runs on splits the exact DP leaves open)."""
        if self.exact:
            return (self.time_limit or EXACT_S), True
        return (self.time_limit or ANYTIME_S), self.time_limit is not None

    def __post_init__(self) -> None:
        if self.time_limit is not None:
            _seconds("time_limit", self.time_limit, "PlannerOptions(time_limit=60) (nowdl plan --time-limit 60)")
        if not isinstance(self.exact, bool):
            raise NowdlError(f"exact must be True or False, got {self.exact!r}: pass PlannerOptions(exact=True) "
                             "(nowdl plan --exact) for a split proven by the MILP")
        gap = self.mip_gap
        if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 <= gap < 1:
            raise NowdlError(f"mip_gap must be a relative gap in [0, 1), got {gap!r}: pass e.g. PlannerOptions(mip_gap=0.01) "
                             "(nowdl plan --mip-gap 0.01: within 1% of the optimum), or 0 for a proven optimum")
        leaves = self.leaf_modules
        if isinstance(leaves, str) or not isinstance(leaves, Sequence) or not all(
                isinstance(m, str) or (isinstance(m, type) and issubclass(m, nn.Module)) for m in leaves):
            raise NowdlError(f"leaf_modules={leaves!r} is not a list of nn.Module types or qualified names: "
                             "pass e.g. PlannerOptions(leaf_modules=[MyBlock, 'encoder.attn'])")
        object.__setattr__(self, "leaf_modules", tuple(leaves))
        _choice("tracer", self.tracer, TRACERS, "'fx' (symbolic_trace), 'export' (torch.export) or 'auto' (fx, else export)")
        _choice("norm_schedule", self.norm_schedule, ("auto", "passes", "layerwise"),
                "'auto' (the cheaper that fits host memory), 'passes' or 'layerwise'")


def _check_device(device: object) -> None:
    if device is None or isinstance(device, torch.device):
        return
    try:
        torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError):
        raise NowdlError(f"device={device!r} is not a torch device: pass e.g. 'cuda', 'cuda:0' or 'cpu'") from None


def _check_device_spec(spec: object) -> None:
    names = ", ".join(sorted([*BUILTIN_SPECS, "cpu"]))
    if spec is None or isinstance(spec, DeviceSpec):
        return
    if not isinstance(spec, (str, os.PathLike)):
        raise NowdlError(f"device_spec={spec!r} is not a name, a JSON path or a DeviceSpec: pass one of {names} "
                         "or the path of a DeviceSpec JSON (docs/calibrate.md)")
    path = os.fspath(spec)
    if isinstance(spec, str) and spec.strip().lower() in (*BUILTIN_SPECS, "cpu"):
        return
    if not os.path.isfile(path):
        raise NowdlError(f"device_spec={path!r} is neither a built-in spec nor a file: pass one of {names} "
                         "or the path of a DeviceSpec JSON (nowdl calibrate writes one)")


def _check_backend(backend: object) -> None:
    if backend is not None:
        backend_name(backend, "backend")


def _checkpointing(value: object) -> bool | tuple[int, ...]:
    if isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple, range)) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        return tuple(value)
    raise NowdlError(f"activation_checkpointing={value!r} is neither a bool nor a list of stage indices: pass True "
                     "(every stage) or e.g. [0, 1] (the stages whose forward is recomputed in their backward)")


@dataclass(frozen=True, kw_only=True)
class RuntimeOptions:
    """The compile() settings outside the PlanRequest and PlannerOptions: where and how the model
    is profiled (mode, device, device_spec, cache) and trained (optimizer, loss_fn, precision,
    activation checkpointing, halo fusion, timeout, backend). See ``nowdl.compile`` for each."""

    mode: str = "auto"
    device: str | torch.device | None = None
    device_spec: DeviceSpecLike | None = None
    cache: CacheSetting = True
    progress: bool = True
    optimizer: OptimizerSpec = "adam"
    loss_fn: LossFn | None = None
    precision: str = "fp32"
    activation_checkpointing: bool | Sequence[int] = False  # a sequence is kept as a tuple
    halo_fusion: str | int = "auto"
    timeout_s: float = 300.0
    backend: str | None = None

    def __post_init__(self) -> None:
        _choice("mode", self.mode, MODES, "'estimate' (no allocation, device_spec roofline), 'measure' (real "
                "tensors) or 'auto' (measure on CUDA, else estimate)")
        _check_device(self.device)
        _check_device_spec(self.device_spec)
        if not isinstance(self.cache, (bool, str, os.PathLike)):
            raise NowdlError(f"cache={self.cache!r} is not a bool or a folder: pass True (the default folder), "
                             "False (no profile cache) or a folder path")
        if not isinstance(self.progress, bool):
            raise NowdlError(f"progress={self.progress!r} is not a bool: pass True or False")
        check_optimizer(self.optimizer)
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise NowdlError(f"loss_fn={self.loss_fn!r} is not callable: pass loss_fn(output, target) -> a scalar "
                             "tensor, e.g. torch.nn.CrossEntropyLoss()")
        _choice("precision", self.precision, tuple(PRECISIONS),
                "'bf16' or 'fp16' train under autocast (fp16 with a loss scaler), 'fp32' without")
        object.__setattr__(self, "activation_checkpointing", _checkpointing(self.activation_checkpointing))
        object.__setattr__(self, "halo_fusion", check_policy(self.halo_fusion))
        _seconds("timeout_s", self.timeout_s, "timeout_s=300")
        _check_backend(self.backend)
