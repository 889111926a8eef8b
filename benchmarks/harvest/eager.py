"""One rank of nowdl against plain eager PyTorch, host copy bandwidth, and host synchronisations.

* ``eager``: the same model, micro-batch, loss and Adam, one step at a time: nowdl's
  ``train_step`` on a one-GPU plan against ``opt.zero_grad(); loss_fn(model(x), y).backward();
  opt.step()`` with the batch copied to the device inside the step (nowdl copies it too), and the
  eager step again with ``channels_last`` and with ``cudnn.benchmark``; median of ``timed`` steps
  after two warm-ups, the variants interleaved.
* ``bandwidth``: host to device and back, pinned and pageable, over sizes (median of 5 copies).
* ``sync_debug``: the synchronising CUDA calls one nowdl step makes
  (``torch.cuda.set_sync_debug_mode("warn")``), and one eager step for comparison.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import nowdl

from .ops import time_fn
from .records import Records, log
from .steps import Row, batch, build_model, compile_kw

__all__ = ["eager_section", "bandwidth_section", "sync_section"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eager_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                device: torch.device, fmt: torch.memory_format | None) -> Callable[[], float]:
    loss_fn = nn.CrossEntropyLoss()

    def step() -> float:
        xd = x.to(device, non_blocking=True)
        if fmt is not None:
            xd = xd.contiguous(memory_format=fmt)
        yd = y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xd), yd)
        loss.backward()
        opt.step()
        return float(loss.detach())  # nowdl's train_step returns the loss as a float too

    return step


def compare_eager(row: Row, spec: str, device: torch.device, timed: int) -> dict[str, Any]:
    x, y = batch(row)
    cm = nowdl.compile(build_model(row.model, row.args), device=device, loss_fn=nn.CrossEntropyLoss(), cache=False,
                       progress=False, **compile_kw(row, spec, device))
    fns: dict[str, Callable[[], Any]] = {"nowdl": lambda: cm.train_step(x, y)}
    for name, fmt, bench in (("eager", None, False), ("eager channels_last", torch.channels_last, False),
                             ("eager cudnn.benchmark", None, True)):
        if device.type != "cuda" and (fmt is not None or bench):
            continue
        m = build_model(row.model, row.args).to(device)
        if fmt is not None:
            m = m.to(memory_format=fmt)
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        step = _eager_step(m, opt, x, y, device, fmt)
        fns[name] = (lambda s=step, b=bench: _with_benchmark(s, b))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(2 + timed):  # interleaved: a burst of other load hits every variant alike
        for k, fn in fns.items():
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            if i >= 2:
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"label": row.label, "model": row.model, "args": row.args, "input": list(row.input), "step_s": med,
            "all": times, "nowdl_over_eager": med["nowdl"] / med["eager"]}


def _with_benchmark(step: Callable[[], Any], on: bool) -> Any:
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = on
    try:
        return step()
    finally:
        torch.backends.cudnn.benchmark = old


def eager_section(recs: Records, cpu: bool, spec: str, device: torch.device, timed: int) -> None:
    rows = ([Row("unet", {"depth": 2, "base_width": 8}, (1, 3, 64, 64), "train")] if cpu else
            [Row("unet", {}, (1, 3, 2048, 2048), "train"), Row("monai_unet", {}, (1, 3, 2048, 2048), "train"),
             Row("resnet110v2", {}, (1, 3, 1024, 1024), "train"), Row("unet", {}, (1, 3, 512, 512), "train")])
    for row in rows:
        if recs.left() < 12:
            recs.add("eager", {"label": row.label, "skipped": "budget"})
            continue
        log(f"eager: {row.label}")
        try:
            r = compare_eager(row, spec, device, timed)
            log("  -> " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["step_s"].items()))
        except Exception as e:  # noqa: BLE001
            r = {"label": row.label, "error": f"{type(e).__name__}: {e}"[:1500]}
        recs.add("eager", r)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def bandwidth_section(recs: Records, device: torch.device) -> None:
    if device.type != "cuda":
        recs.put("bandwidth", [])
        return
    for mib in (1, 16, 256, 1024):
        n = mib * 2**20
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        for pinned in (True, False):
            host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
            for direction, fn in (("h2d", functools.partial(dev.copy_, host, non_blocking=True)),
                                  ("d2h", functools.partial(host.copy_, dev, non_blocking=True))):
                s = time_fn(fn, device, 5, 1)
                recs.add("bandwidth", {"direction": direction, "pinned": pinned, "bytes": n, "s": s, "bytes_per_s": n / s})
    recs.flush()


def sync_section(recs: Records, cpu: bool, spec: str, device: torch.device) -> None:
    """The synchronising calls of one nowdl training step (and of one eager step) on CUDA."""
    if device.type != "cuda":
        recs.put("sync_debug", {"skipped": "CPU"})
        return
    row = Row("unet", {}, (1, 3, 512, 512), "train")
    x, y = batch(row)
    cm = nowdl.compile(build_model(row.model, row.args), device=device, loss_fn=nn.CrossEntropyLoss(), cache=False,
                       progress=False, **compile_kw(row, spec, device))
    m = build_model(row.model, row.args).to(device)
    eager = _eager_step(m, torch.optim.Adam(m.parameters()), x, y, device, None)
    out: dict[str, Any] = {}
    for name, fn in (("nowdl", lambda: cm.train_step(x, y)), ("eager", eager)):
        fn()  # warm: the first step builds stages and optimizer state
        torch.cuda.synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        msgs = [str(w.message).splitlines()[0][:200] for w in caught if "synchroniz" in str(w.message).lower()]
        out[name] = {"count": len(msgs), "first": sorted(set(msgs))[:10]}
    recs.put("sync_debug", out)
