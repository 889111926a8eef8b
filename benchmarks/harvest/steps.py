"""Whole steps of real models on one device against their plans: allocator peaks and step times.

A row is one model, input and kind: ``train`` (saved activations kept), ``recompute``, ``offload``
(pinned host memory, a side copy stream), ``seq_tiles`` (T tiles one after another) and
``inference`` (an inference plan, ``eval_step``). Each plans for one GPU in estimate mode on the
device's spec with the configuration pinned (``compile`` keywords in the row, so a CPU test can
plan the same row again), runs a warm-up step, then one step between a peak reset and a read
(``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``, the allocator's own counters),
then ``timed`` steps whose median is the step time. On CPU the peak is nowdl's aten allocation
tracker (``peak_of``). A refused plan or a failing step is a row with its error.
"""

from __future__ import annotations

import functools
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import nowdl
from nowdl.runtime.training.metrics import peak_of

from .records import Records, jsonable, log

__all__ = ["Row", "build_model", "step_rows", "run_row", "STAT_KEYS"]

STAT_KEYS = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "active_bytes.all.peak",
             "inactive_split_bytes.all.peak", "allocated_bytes.large_pool.peak", "allocated_bytes.small_pool.peak",
             "reserved_bytes.large_pool.peak", "reserved_bytes.small_pool.peak", "segment.all.peak",
             "allocation.all.peak", "num_alloc_retries", "num_ooms", "requested_bytes.all.peak")


@dataclass(frozen=True)
class Row:
    model: str  # a key of MODELS
    args: dict[str, Any]  # the model factory's keywords
    input: tuple[int, ...]
    kind: str  # train | recompute | offload | seq_tiles | inference
    tiles: int = 1
    history: bool = False  # record the allocator's event trace of the measured step
    compile_kw: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in sorted(self.compile_kw.items()))
        return f"{self.model} {'x'.join(map(str, self.input))} {self.kind}{f' T={self.tiles}' if self.tiles > 1 else ''}{extra}"


def _monai_unet(spatial_dims: int = 2, in_channels: int = 3, channels: tuple[int, ...] = (32, 64, 128, 256, 512),
                norm: str = "instance", num_res_units: int = 2) -> nn.Module:
    from monai.networks.nets import UNet

    return UNet(spatial_dims=spatial_dims, in_channels=in_channels, out_channels=2, channels=channels,
                strides=(2,) * (len(channels) - 1), num_res_units=num_res_units, norm=norm)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "unet": lambda **kw: nowdl.models.unet(3, 2, **kw),
    "resnet110v2": lambda **kw: nowdl.models.resnet110v2(**kw),
    "monai_unet": _monai_unet,
}
CLASSIFIERS = {"resnet110v2"}


def build_model(name: str, args: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name](**args)


def batch(row: Row, shape: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    shape = shape or row.input
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g)
    y = (torch.randint(0, 10, (shape[0],), generator=g) if row.model in CLASSIFIERS
         else torch.randint(0, 2, (shape[0], *shape[2:]), generator=g))
    return x, y


def step_rows(cpu: bool) -> list[Row]:
    """The rows in priority order (the first five are the H200 rows of docs/benchmarks.md)."""
    if cpu:
        u, m, r = {"depth": 2, "base_width": 8}, {"channels": (4, 8, 16)}, {"width": 4}
        m3 = {"spatial_dims": 3, "in_channels": 1, "channels": (4, 8, 16)}
        return [Row("unet", u, (1, 3, 64, 64), "train", history=True), Row("unet", u, (1, 3, 128, 128), "inference"),
                Row("unet", u, (1, 3, 64, 64), "recompute"), Row("unet", u, (1, 3, 64, 64), "offload"),
                Row("unet", u, (1, 3, 64, 64), "seq_tiles", tiles=4),
                Row("monai_unet", m, (1, 3, 64, 64), "train"), Row("monai_unet", m, (1, 3, 64, 64), "seq_tiles", tiles=4),
                Row("resnet110v2", r, (1, 3, 32, 32), "train"), Row("monai_unet", m3, (1, 1, 16, 16, 16), "train")]
    m3 = {"spatial_dims": 3, "in_channels": 1, "channels": (16, 32, 64, 128, 256)}
    return [
        Row("unet", {}, (1, 3, 1024, 1024), "train"),
        Row("unet", {}, (1, 3, 2048, 2048), "inference"),
        Row("unet", {}, (1, 3, 2048, 2048), "train", history=True),
        Row("unet", {}, (1, 3, 2048, 2048), "recompute"),
        Row("unet", {}, (1, 3, 2048, 2048), "offload"),
        Row("unet", {}, (1, 3, 2048, 2048), "seq_tiles", tiles=4),
        Row("monai_unet", {}, (1, 3, 2048, 2048), "train"),
        Row("monai_unet", {}, (1, 3, 4096, 4096), "inference"),
        Row("monai_unet", {}, (1, 3, 2048, 2048), "recompute"),
        Row("monai_unet", {}, (1, 3, 2048, 2048), "offload"),
        Row("monai_unet", {}, (1, 3, 2048, 2048), "seq_tiles", tiles=4),
        Row("resnet110v2", {}, (1, 3, 1024, 1024), "train"),
        Row("resnet110v2", {}, (1, 3, 2048, 2048), "inference"),
        Row("resnet110v2", {}, (1, 3, 1024, 1024), "recompute"),
        Row("resnet110v2", {}, (1, 3, 1024, 1024), "offload"),
        Row("resnet110v2", {}, (1, 3, 1024, 1024), "seq_tiles", tiles=4),
        Row("monai_unet", m3, (1, 1, 128, 128, 128), "train"),
        Row("monai_unet", m3, (1, 1, 256, 256, 256), "inference"),
        Row("unet", {}, (1, 3, 2048, 2048), "train", compile_kw={"precision": "bf16"}),
        Row("unet", {}, (1, 3, 4096, 4096), "train"),
        Row("unet", {}, (1, 3, 4096, 4096), "seq_tiles", tiles=4),
        Row("unet", {}, (1, 3, 8192, 8192), "inference"),
        Row("unet", {}, (2, 3, 2048, 2048), "train"),
    ]


def compile_kw(row: Row, spec: str, device: torch.device) -> dict[str, Any]:
    """The ``nowdl.compile`` keywords of ``row`` (one GPU, the configuration pinned)."""
    kw: dict[str, Any] = {"gpus": 1, "stages": 1, "spatial_parts": 1, "dp": 1, "replicas": 1, "micro_batches": 1,
                          "mode": "estimate", "device_spec": spec, "recompute": "off", "offload": "off",
                          "tiles_per_gpu": 1}
    if row.kind == "recompute":
        kw["recompute"] = "on"
    elif row.kind == "offload":
        kw["offload"] = "on"
    elif row.kind == "seq_tiles":
        kw["tiles_per_gpu"] = row.tiles
    return {**kw, **row.compile_kw}


def _reset(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _measure(step: Callable[[], Any], device: torch.device, modules: list[nn.Module], opt: Any,
             history: bool) -> tuple[dict[str, Any], list[list[Any]] | None]:
    """Peaks of one ``step()``; the allocator's (action, bytes, stream) events when ``history``."""
    if device.type != "cuda":
        _, peak = peak_of(step, modules, opt)
        return {"max_allocated": peak, "max_reserved": None, "stats": {}}, None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = {"allocated_before": torch.cuda.memory_allocated(device),
            "reserved_before": torch.cuda.memory_reserved(device)}
    if history:
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=500_000)
    step()
    torch.cuda.synchronize(device)
    events = None
    if history:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap.get("device_traces", [[]])[device.index or 0]
        events = [[e.get("action"), int(e.get("size", 0)), int(e.get("stream", 0))] for e in trace]
    stats = torch.cuda.memory_stats(device)
    return {**base, "max_allocated": int(torch.cuda.max_memory_allocated(device)),
            "max_reserved": int(torch.cuda.max_memory_reserved(device)),
            "stats": {k: stats.get(k) for k in STAT_KEYS}}, events


def _engine_of(cm: Any, inference: bool) -> Any:
    tr = cm._train()
    return tr.evaluator().last.engine if inference else tr.engine


def _steps_s(step: Callable[[], Any], device: torch.device, n: int) -> list[float]:
    out = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t)
    return out


def run_row(row: Row, spec: str, device: torch.device, timed: int) -> tuple[dict[str, Any], list[list[Any]] | None]:
    """Plan, run and measure one row; the record and the allocator events (when asked)."""
    kw = compile_kw(row, spec, device)
    rec: dict[str, Any] = {"model": row.model, "args": row.args, "input": list(row.input), "kind": row.kind,
                           "tiles": row.tiles, "compile": kw, "spec": spec, "device": str(device)}
    _reset(device)
    model = build_model(row.model, row.args)
    t = time.perf_counter()
    cm = nowdl.compile(model, device=device, loss_fn=nn.CrossEntropyLoss(), cache=False, progress=False, **kw)
    x, y = batch(row)
    inference = row.kind == "inference"
    step = functools.partial(cm.eval_step, x) if inference else functools.partial(cm.train_step, x, y)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first = _steps_s(step, device, 1)[0]  # plans, builds the stages, creates the optimizer state
    rec["first_step_s"] = first
    rec["plan_and_first_step_s"] = time.perf_counter() - t
    if device.type == "cuda":
        rec["first_step_max_allocated"] = int(torch.cuda.max_memory_allocated(device))
        rec["first_step_max_reserved"] = int(torch.cuda.max_memory_reserved(device))
    eng = _engine_of(cm, inference)
    plan = cm._train().evaluator().last.plan if inference else cm._train().plan
    mods = [eng.stages[s].module for _, s in eng.held]
    measured, events = _measure(step, device, mods, None if inference else eng.optimizer, row.history)
    rec.update(measured)
    times = _steps_s(step, device, timed)
    if device.type == "cuda":  # what the cache holds after the timed steps (fragmentation shows here)
        rec["reserved_after"] = int(torch.cuda.memory_reserved(device))
        rec["max_reserved_all_steps"] = int(torch.cuda.max_memory_reserved(device))
    rec["step_s"] = statistics.median(times)
    rec["step_s_all"] = times
    rk = plan.ranks[0]
    rec["predicted_peak"] = float(rk.predicted_peak_bytes)
    rec["predicted_step_s"] = float(plan.predicted.get("step_s", 0.0))
    rec["predicted"] = jsonable(dict(plan.predicted))
    rec["stage_predicted"] = [jsonable(dict(s.predicted)) for s in plan.stages]
    rec["plan_config"] = jsonable(dict(plan.config))
    rec["ratio"] = rec["max_allocated"] / rec["predicted_peak"] if rec["predicted_peak"] else None
    del cm, eng, mods, step
    _reset(device)
    return rec, events


def steps_section(recs: Records, cpu: bool, spec: str, device: torch.device, timed: int,
                  history_out: Callable[[str, list[list[Any]]], None]) -> None:
    """Every row of :func:`step_rows` while the budget lasts (a row needs ~15 s on a GPU)."""
    for row in step_rows(cpu):
        if recs.left() < 12:
            recs.add("steps", {"label": row.label, "skipped": "budget"})
            continue
        log(f"step row: {row.label}")
        t = time.perf_counter()
        try:
            rec, events = run_row(row, spec, device, timed)
        except Exception as e:  # noqa: BLE001 - a refused plan or a failing step is a row too
            rec, events = {"error": f"{type(e).__name__}: {e}"[:1500]}, None
            _reset(device)
        rec = {"label": row.label, **rec, "wall_s": time.perf_counter() - t}
        if events is not None:
            history_out(row.label, events)
            rec["history_events"] = len(events)
        recs.add("steps", rec)
        ratio = rec.get("ratio")
        log(f"  -> {'error: ' + rec['error'][:200] if 'error' in rec else f'measured/plan {ratio:.2f}'}"
            f" ({rec['wall_s']:.1f} s)")


def dump_history(path: Any) -> Callable[[str, list[list[Any]]], None]:
    """A ``history_out`` writing each row's events into one JSON file (label -> events)."""
    store: dict[str, Any] = {}

    def out(label: str, events: list[list[Any]]) -> None:
        store[label] = events
        path.write_text(json.dumps(store))

    return out
