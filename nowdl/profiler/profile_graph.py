"""profile(): the cost of every node of a traced graph, measured on a device or estimated on fake tensors."""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

import torch

from nowdl.cpumem import keep_freed_memory
from nowdl.profiler.cache import (
    cache_key,
    graph_digest,
    load_cached,
    resolve_cache_dir,
    store_cached,
)
from nowdl.profiler.compose import scale_times, whole_pass
from nowdl.profiler.cost import Profile
from nowdl.profiler.devices import HOST_FIELDS, DeviceSpec, get_device_spec
from nowdl.profiler.estimate import EstimateBackend
from nowdl.profiler.measure import MeasureBackend, device_label, resolve_device
from nowdl.profiler.memory import OPTIMIZER_STATES
from nowdl.profiler.runner import Backend, dtype_name, walk

__all__ = ["profile", "check_precision", "MODES", "OPTIMIZERS", "PRECISIONS"]

log = logging.getLogger(__name__)

MODES = ("estimate", "measure")
#: precision name -> the autocast dtype the runtime trains with (None: no autocast)
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS = tuple(OPTIMIZER_STATES)


def check_precision(precision: str) -> str:
    """``precision`` if it is one of PRECISIONS (else a NowdlError listing them)."""
    from nowdl.errors import NowdlError

    if precision not in PRECISIONS:
        raise NowdlError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    return precision


def _profile_dtype(gm: torch.nn.Module, inputs: tuple[Any, ...]) -> str:
    for t in [*inputs, *gm.parameters()]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return dtype_name(t.dtype)
    return "float32"


def profile(
    gm: torch.fx.GraphModule,
    example_inputs: tuple[torch.Tensor, ...],
    *,
    mode: str = "estimate",
    device: str | torch.device | None = None,
    device_spec: str | DeviceSpec | os.PathLike[str] | None = None,
    optimizer: str = "adam",
    repeats: int = 5,
    warmup: int = 2,
    cache: bool | str | os.PathLike[str] = True,
    progress: bool = True,
    fingerprint: str = "",
    precision: str = "fp32",
) -> Profile:
    """Cost of every node of ``gm`` for one micro-batch shaped like ``example_inputs``.

    ``mode="measure"`` runs node by node on real tensors on ``device`` (default cuda when
    available, else cpu; the model is deep-copied there if its parameters live elsewhere),
    timing the median of ``repeats`` runs after ``warmup``. ``mode="estimate"`` allocates
    nothing: fake tensors give exact shapes, bytes, saved tensors and FLOPs, and times come
    from a roofline on ``device_spec`` (a built-in name, a JSON path or a DeviceSpec;
    default ``h100``). ``optimizer`` sets the optimizer-state bytes (sgd 0, momentum 1,
    adam/adamw 2 states per parameter). ``precision`` "bf16" or "fp16" profiles every forward
    under ``torch.autocast`` in that dtype, as the runtime trains (parameters, gradients and
    optimizer state stay in the model's dtype). Results are cached as JSON under ``cache``
    (True: ``$NOWDL_CACHE_DIR`` or ``~/.cache/nowdl/profiles``; a path; False: off).
    The model's parameters, buffers (e.g. BatchNorm running stats), grads and the global
    RNG state are left as they were. Raises ProfileError naming a node that cannot run.
    """
    from nowdl.errors import ProfileError

    if mode not in MODES:
        raise ProfileError(f"unknown profile mode {mode!r}; choose one of {list(MODES)}")
    opt = optimizer.lower() if isinstance(optimizer, str) else optimizer
    if opt not in OPTIMIZER_STATES:
        raise ProfileError(f"unknown optimizer {optimizer!r}; choose one of {list(OPTIMIZERS)}")
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (
            example_inputs,)
    if precision not in PRECISIONS:
        raise ProfileError(f"unknown precision {precision!r}; choose one of {list(PRECISIONS)}")
    if repeats < 1 or warmup < 0:
        raise ProfileError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, "
                           f"warmup={warmup}")
    cache_dir = resolve_cache_dir(cache)
    input_shapes = [list(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)]
    dtype = _profile_dtype(gm, example_inputs)

    dev: torch.device | None = None
    spec: DeviceSpec | None = None
    key_parts: dict[str, Any] = {
        "fingerprint": fingerprint,
        "graph": graph_digest(gm),
        "input_shapes": input_shapes,
        "input_dtypes": [str(t.dtype) for t in example_inputs if isinstance(t, torch.Tensor)],
        "dtype": dtype,
        "mode": mode,
        "optimizer": opt,
        "precision": precision,
    }
    if mode == "measure":
        dev = resolve_device(device)
        key_parts["device"] = device_label(dev)
        key_parts["repeats"] = repeats
        key_parts["threads"] = torch.get_num_threads() if dev.type == "cpu" else None
        # time nodes under the allocator settings the runtime uses ([Note: CPU freed memory])
        key_parts["keep_freed"] = keep_freed_memory() if dev.type == "cpu" else None
        key_parts["whole_pass"] = 2  # [Note: whole-pass scale], [Note: thread clock minimum]
    else:
        spec = get_device_spec(device_spec, cache_dir=cache_dir)
        key_parts["spec"] = {k: v for k, v in spec.to_dict().items() if k not in HOST_FIELDS}  # no bearing on a profile
    key = cache_key(key_parts)
    if cache_dir is not None:
        hit = load_cached(cache_dir, key)
        if hit is not None:
            return hit

    t0 = time.perf_counter()
    backend: Backend
    scale = (1.0, 1.0)
    if mode == "measure":
        assert dev is not None
        with _preserved_state(gm, dev) as model:
            backend = MeasureBackend(model, dev, repeats, warmup)
            costs, edges = walk(model, example_inputs, backend, opt, progress, PRECISIONS[precision])
            whole = whole_pass(model, example_inputs, dev, costs, PRECISIONS[precision])
        if whole is not None:  # [Note: whole-pass scale]: the forward only
            costs, scale = scale_times(costs, whole[0])
    else:
        assert spec is not None
        backend = EstimateBackend(gm, spec)
        with torch.random.fork_rng(devices=[]):
            costs, edges = walk(gm, example_inputs, backend, opt, progress, PRECISIONS[precision])
    prof = Profile(
        nodes=costs,
        edges=edges,
        source=mode,
        device=backend.device_label,
        dtype=dtype,
        optimizer=opt,
        input_shapes=input_shapes,
        fingerprint=fingerprint,
        wall_s=time.perf_counter() - t0,
        precision=precision,
        time_scale=scale,
    )
    log.info("profiled %d nodes (%s on %s) in %.2fs", len(costs), mode, prof.device,
             prof.wall_s)
    if cache_dir is not None:
        store_cached(cache_dir, key, prof)
    return prof


class _preserved_state:
    """Yields the model on ``dev`` (a deep copy if it lives elsewhere); on exit restores the
    original's buffers and grads and the RNG state, which was seeded for the run."""

    def __init__(self, gm: torch.fx.GraphModule, dev: torch.device) -> None:
        self.gm = gm
        self.dev = dev

    def __enter__(self) -> torch.fx.GraphModule:
        gm = self.gm
        tensors = [*gm.parameters(), *gm.buffers()]
        on_dev = all(t.device == self.dev for t in tensors)
        self.model = gm if on_dev else copy.deepcopy(gm).to(self.dev)
        self.buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        self.grads = [(p, p.grad) for p in self.model.parameters()]
        for p in self.model.parameters():
            p.grad = None
        devices = [self.dev.index or 0] if self.dev.type == "cuda" else []
        self.rng = torch.random.fork_rng(devices=devices)
        self.rng.__enter__()
        torch.manual_seed(0)
        return self.model

    def __exit__(self, *exc: object) -> None:
        self.rng.__exit__(None, None, None)
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        for p, g in self.grads:
            p.grad = g
