"""Per-node costs of whole models: nowdl's profiler measuring on the device against its estimate.

Each model is traced once and profiled twice on one micro-batch: ``mode="measure"`` on the device
(median of ``repeats`` after ``warmup`` per node) and ``mode="estimate"`` on the device's spec.
A row per node keeps the op, its output shape and dtype, FLOPs, output and saved bytes, and both
forward and backward times, so a fit can read per-node time against size and op class.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from nowdl.profiler import profile
from nowdl.trace.tracer import trace

from .records import Records, log
from .steps import build_model

__all__ = ["profile_rows", "profile_model"]


def profile_rows(cpu: bool) -> list[tuple[str, dict[str, Any], tuple[int, ...]]]:
    if cpu:
        return [("unet", {"depth": 2, "base_width": 8}, (1, 3, 64, 64)), ("resnet110v2", {"width": 4}, (1, 3, 32, 32))]
    return [("unet", {}, (1, 3, 1024, 1024)), ("monai_unet", {}, (1, 3, 1024, 1024)),
            ("resnet110v2", {}, (1, 3, 512, 512)),
            ("monai_unet", {"spatial_dims": 3, "in_channels": 1, "channels": (16, 32, 64, 128, 256)}, (1, 1, 128, 128, 128))]


def profile_model(name: str, args: dict[str, Any], shape: tuple[int, ...], device: torch.device, spec: str,
                  repeats: tuple[int, int]) -> dict[str, Any]:
    model = build_model(name, args)
    x = torch.randn(*shape)
    gm = trace(model, (x,)).gm
    t0 = time.perf_counter()
    meas = profile(gm, (x,), mode="measure", device=device, repeats=repeats[0], warmup=repeats[1], cache=False,
                   progress=False)
    t1 = time.perf_counter()
    est = profile(gm, (x.to("meta"),), mode="estimate", device_spec=spec, cache=False, progress=False)
    rows = []
    for m in meas.nodes:
        if m.op in ("placeholder", "output", "get_attr") or m.name not in est:
            continue
        e = est[m.name]
        rows.append({"node": m.name, "target": m.target, "out_shape": list(m.out_shape or ()), "dtype": m.out_dtype,
                     "flops": e.flops, "out_bytes": [m.out_bytes, e.out_bytes], "saved_bytes": [m.saved_bytes, e.saved_bytes],
                     "workspace_bytes": [m.workspace_bytes, e.workspace_bytes], "fwd_s": [m.fwd_s, e.fwd_s],
                     "bwd_s": [m.bwd_s, e.bwd_s]})
    tot = {k: [sum(r[k][0] for r in rows), sum(r[k][1] for r in rows)] for k in ("fwd_s", "bwd_s", "out_bytes", "saved_bytes")}
    return {"model": name, "args": args, "input": list(shape), "spec": spec, "nodes": rows, "total": tot,
            "measure_s": t1 - t0, "time_scale": list(meas.time_scale),
            "out_bytes_differ": [r["node"] for r in rows if r["out_bytes"][0] != r["out_bytes"][1]]}


def profiles_section(recs: Records, cpu: bool, spec: str, device: torch.device, repeats: tuple[int, int]) -> None:
    for name, args, shape in profile_rows(cpu):
        if recs.left() < 15:
            recs.add("profiles", {"model": name, "input": list(shape), "skipped": "budget"})
            continue
        log(f"profile {name} {'x'.join(map(str, shape))}")
        try:
            recs.add("profiles", profile_model(name, args, shape, device, spec, repeats))
        except Exception as e:  # noqa: BLE001 - one model's failure is its row
            recs.add("profiles", {"model": name, "input": list(shape), "error": f"{type(e).__name__}: {e}"[:1500]})
