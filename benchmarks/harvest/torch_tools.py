"""torch's own step estimators (``torch.distributed._tools``) on the first step rows, beside a measured eager step.

For each row: one plain eager step (model, Adam, cross entropy; the batch on the device) measured
with the allocator's peak and the median time; then, on fake tensors of the same device,
``MemTracker``'s peak (the sum over its categories) and ``RuntimeEstimator``'s step time in both
its modes (``operator-level-cost-model``, a roofline, and ``operator-level-benchmark``, which
runs each op alone on the GPU). Each estimator that fails is an error entry; the others stay.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import torch
from torch import nn

from .records import Records, log
from .steps import Row, batch, build_model

__all__ = ["torch_tools_section", "mem_tracker_peak"]


def _eager(row: Row, device: torch.device, timed: int) -> dict[str, Any]:
    m = build_model(row.model, row.args).to(device)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    x, y = (t.to(device) for t in batch(row))
    inference = row.kind == "inference"

    def step() -> None:
        if inference:
            with torch.no_grad():
                m(x)
            return
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()

    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(timed):
        t = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return {"step_s": statistics.median(times), "max_allocated": peak}


def _fake_step(row: Row, device: torch.device, wrap: Any) -> Any:
    """Run one step of ``row`` on fake tensors of ``device`` inside ``wrap(model, opt, x)`` (a context)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), device:
        m = build_model(row.model, row.args)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        x = torch.randn(*row.input, device=device)
        y = (torch.randint(0, 2, (row.input[0], *row.input[2:]), device=device) if row.model != "resnet110v2"
             else torch.randint(0, 10, (row.input[0],), device=device))
        with wrap(m, opt, x) as tool:
            if row.kind == "inference":
                with torch.no_grad():
                    m(x)
            else:
                for i in range(2):  # the second step has the optimizer state, as a measured steady step does
                    if i and hasattr(tool, "reset_mod_stats"):
                        tool.reset_mod_stats()  # MemTracker's module stats are per iteration; its peak stays
                    nn.functional.cross_entropy(m(x), y).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        return tool


def mem_tracker_peak(row: Row, device: torch.device) -> int:
    """torch's MemTracker's peak for one eager step of ``row`` on fake tensors of ``device``."""
    return int(_mem_tracker(row, device)["peak"])


def _mem_tracker(row: Row, device: torch.device) -> dict[str, Any]:
    from torch.distributed._tools.mem_tracker import MemTracker

    def wrap(m: nn.Module, opt: Any, x: torch.Tensor) -> Any:
        mt = MemTracker()
        mt.track_external(m, opt, x)
        return mt

    mt = _fake_step(row, device, wrap)
    snap = mt.get_tracker_snapshot("peak")
    per = {str(k): {str(c): int(v) for c, v in cats.items()} for k, cats in snap.items()}
    dev = next((v for k, v in per.items() if k.startswith(device.type)), {})
    return {"peak": int(dev.get("Total", sum(v for c, v in dev.items() if c != "Total"))), "categories": dev}


def _runtime(row: Row, device: torch.device, mode: str) -> dict[str, Any]:
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    est = RuntimeEstimator()

    def wrap(m: nn.Module, opt: Any, x: torch.Tensor) -> Any:
        return est(estimate_mode_type=mode)

    t = time.perf_counter()
    _fake_step(row, device, wrap)
    steps = 1 if row.kind == "inference" else 2
    return {"step_s": est.total_runtime / 1e3 / steps, "wall_s": time.perf_counter() - t}


def torch_tools_section(recs: Records, rows: list[Row], device: torch.device, timed: int) -> None:
    for row in rows:
        if recs.left() < 15:
            recs.add("torch_tools", {"label": row.label, "skipped": "budget"})
            continue
        log(f"torch tools: {row.label}")
        rec: dict[str, Any] = {"label": row.label, "model": row.model, "args": row.args, "input": list(row.input),
                               "kind": row.kind}
        recs.add("torch_tools", rec)
        for key, fn in (("eager", functools.partial(_eager, row, device, timed)),
                        ("mem_tracker", functools.partial(_mem_tracker, row, device)),
                        ("runtime_cost_model", functools.partial(_runtime, row, device, "operator-level-cost-model")),
                        ("runtime_benchmark", functools.partial(_runtime, row, device, "operator-level-benchmark"))):
            if key.startswith("runtime") and device.type != "cuda":
                continue  # GPU estimators (on CPU the cost model ends the process with a C++ terminate)
            rec[key] = {"error": "running (a crash here ends the child process)"}
            recs.flush()
            try:
                rec[key] = fn()
            except Exception as e:  # noqa: BLE001 - an estimator that fails here is a finding, not the end
                rec[key] = {"error": f"{type(e).__name__}: {e}"[:800]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        recs.flush()
