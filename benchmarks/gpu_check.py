"""GPU check: the profiler, one training step, one whole-image inference and two ranks on one GPU.

One command for a machine with one CUDA GPU (H100/H200: about 4-6 minutes), and a small CPU
mode that CI runs as a test of the script itself (``tests/benchmarks``-style: tests/test_gpu_check.py)::

    .venv/bin/python benchmarks/gpu_check.py                 # CUDA when available, else --cpu
    .venv/bin/python benchmarks/gpu_check.py --cpu --out check.json

Sections (tables to stdout as Markdown, progress to stderr; ``--out`` saves every figure as JSON):

1. **Profiler: measure against estimate.** The built-in UNet and ResNet-110-v2 are profiled
   on one micro-batch in ``mode="measure"`` on this device and in ``mode="estimate"`` on its
   device spec (h100/h200 by the GPU's name; ``cpu`` on CPU). Per node (the slowest measured
   nodes shown, all in ``--out``) and in total: forward and backward time, output and saved
   bytes, with measured / estimated. Bytes should agree exactly (both come from the same
   shapes); times show how far the spec's roofline is from this device.
2. **Memory against the plan.** The UNet planned for one GPU (estimate on the spec) runs one
   training step (after a warm-up step) and, on an inference plan, one whole-image
   ``eval_step`` at a larger size. Measured: ``torch.cuda.max_memory_allocated`` over the step
   (reset before it); on CPU, nowdl's aten allocation tracker (static bytes + the peak of live
   new storages, plus the input) as in ``nowdl run``'s metrics. Against the plan's
   ``predicted_peak_bytes``.
3. **Recompute and offload:** the UNet on one device with its saved
   activations kept, recomputed in the backward, and offloaded to pinned host memory over a
   side copy stream; peak memory and median step time against each plan.
4. **Two processes on the one device** (gloo; NCCL refuses two ranks on one GPU): a 2-stage
   pipeline trains two steps and evaluates a whole image; the losses are compared with one
   process running the same micro-batches, the output with the plain model. If the backend
   cannot send this device's tensors the section says so and the script goes on.

Sizes: GPU, UNet 1x3x1024x1024 (inference 1x3x2048x2048), ResNet-110-v2 1x3x512x512; CPU, a
UNet of depth 2 and width 8 at 64x64 (inference 128x128) and ResNet-110-v2 at 32x32, each node
timed once without warm-up (GPU: median of 5 after 2). Nothing is asserted: the figures are for
docs/benchmarks.md and for correcting the device specs.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.distributed import WorkerError, run_workers  # noqa: E402

import nowdl  # noqa: E402
from nowdl.plan.plan import format_bytes  # noqa: E402
from nowdl.profiler import profile  # noqa: E402
from nowdl.profiler.calibrate.ops import median_times  # noqa: E402
from nowdl.runtime.training.metrics import peak_of, static_bytes  # noqa: E402
from nowdl.trace.tracer import trace  # noqa: E402

SEED = 0


def _log(msg: str) -> None:
    print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)


def _spec_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return next((k for k in ("h200", "h100", "a100", "v100") if k in name), "h100")


def _sizes(cpu: bool) -> dict[str, Any]:
    if cpu:
        return {"unet": {"depth": 2, "base_width": 8}, "unet_in": (1, 3, 64, 64), "unet_big": (1, 3, 128, 128),
                "resnet_in": (1, 3, 32, 32), "top": 8, "repeats": (1, 0), "lever_in": (1, 3, 64, 64), "lever_steps": 1}
    return {"unet": {}, "unet_in": (1, 3, 1024, 1024), "unet_big": (1, 3, 2048, 2048), "resnet_in": (1, 3, 512, 512),
            "top": 15, "repeats": (5, 2), "lever_in": (1, 3, 2048, 2048), "lever_steps": 3}


# ---- 1. profiler ---------------------------------------------------------------------------------
def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else ("-" if a == 0 else "inf")


def profiler_section(name: str, model: nn.Module, shape: tuple[int, ...], device: torch.device, spec: str,
                     top: int, repeats: tuple[int, int]) -> dict[str, Any]:
    """Measure (``repeats``: timed runs, warm-up runs) and estimate ``model`` on one micro-batch;
    print the table; the figures."""
    _log(f"profiling {name} {'x'.join(map(str, shape))}: measure on {device}, estimate on {spec}")
    x = torch.randn(*shape)
    gm = trace(model, (x,)).gm
    t0 = time.perf_counter()
    meas = profile(gm, (x,), mode="measure", device=device, repeats=repeats[0], warmup=repeats[1], cache=False,
                   progress=False)
    t1 = time.perf_counter()
    est = profile(gm, (x.to("meta"),), mode="estimate", device_spec=spec, cache=False, progress=False)
    rows = []
    for m in meas.nodes:
        e = est[m.name] if m.name in est else None
        if e is None or m.op in ("placeholder", "output", "get_attr"):
            continue
        rows.append({"node": m.name, "target": m.target, "fwd_s": [m.fwd_s, e.fwd_s], "bwd_s": [m.bwd_s, e.bwd_s],
                     "out_bytes": [m.out_bytes, e.out_bytes], "saved_bytes": [m.saved_bytes, e.saved_bytes]})
    tot = {k: [sum(r[k][0] for r in rows), sum(r[k][1] for r in rows)]
           for k in ("fwd_s", "bwd_s", "out_bytes", "saved_bytes")}
    print(f"\n### 1. Profiler, {name} {'x'.join(map(str, shape))}: measured on {device} / estimated on {spec}\n")
    print(f"{len(rows)} nodes; the {min(top, len(rows))} slowest measured (forward + backward), then the totals. "
          f"Measuring took {t1 - t0:.1f} s.\n")
    print("| node | op | fwd ms meas / est | ratio | bwd ms meas / est | ratio | out bytes meas / est | "
          "saved bytes meas / est |")
    print("|---|---|---|---|---|---|---|---|")
    shown = sorted(rows, key=lambda r: -(r["fwd_s"][0] + r["bwd_s"][0]))[:top]
    for r in [*shown, {"node": "**total**", "target": "", **tot}]:
        f, b, o, s = r["fwd_s"], r["bwd_s"], r["out_bytes"], r["saved_bytes"]
        print(f"| {r['node']} | {r['target'].rsplit('.', 1)[-1]} | {f[0] * 1e3:.3f} / {f[1] * 1e3:.3f} | "
              f"{_ratio(f[0], f[1])} | {b[0] * 1e3:.3f} / {b[1] * 1e3:.3f} | {_ratio(b[0], b[1])} | "
              f"{format_bytes(o[0])} / {format_bytes(o[1])} | {format_bytes(s[0])} / {format_bytes(s[1])} |")
    differ = [r["node"] for r in rows if r["out_bytes"][0] != r["out_bytes"][1]]
    print(f"\nnodes whose output bytes differ between measure and estimate: {len(differ)}"
          + (f" ({', '.join(differ[:5])})" if differ else ""))
    return {"model": name, "input": list(shape), "device": str(device), "spec": spec, "nodes": rows, "total": tot,
            "measure_s": t1 - t0, "out_bytes_differ": differ}


# ---- 2. memory against the plan ------------------------------------------------------------------
def _peak(step: Any, device: torch.device, modules: list[nn.Module], opt: Any, extra: int) -> tuple[Any, int]:
    """Run ``step()``: its result and the peak bytes (CUDA's allocator, or the CPU tracker + ``extra``)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = step()
        torch.cuda.synchronize(device)
        return out, int(torch.cuda.max_memory_allocated(device))
    out, peak = peak_of(step, modules, opt)
    return out, peak + extra


def memory_section(sizes: dict[str, Any], device: torch.device, spec: str) -> dict[str, Any]:
    """One training step and one whole-image inference of the UNet, measured against their plans."""
    torch.manual_seed(SEED)
    model = nowdl.models.unet(3, 2, **sizes["unet"])
    cm = nowdl.compile(model, gpus=1, mode="estimate", device_spec=spec, device=device, loss_fn=nn.CrossEntropyLoss(),
                       cache=False, progress=False)
    shape = sizes["unet_in"]
    g = torch.Generator().manual_seed(SEED)
    x, y = torch.randn(*shape, generator=g), torch.randint(0, 2, (shape[0], *shape[2:]), generator=g)
    _log(f"training step, UNet {'x'.join(map(str, shape))}")
    cm.train_step(x, y)  # builds the stages and the optimizer state
    eng = cm._train().engine
    assert eng is not None
    mods = [eng.stages[s].module for _, s in eng.held]
    _, train_peak = _peak(lambda: cm.train_step(x, y), device, mods, eng.optimizer, 0)
    train_pred = cm._train().plan.ranks[0].predicted_peak_bytes  # type: ignore[union-attr]
    big = torch.randn(*sizes["unet_big"], generator=g)
    _log(f"whole-image inference, UNet {'x'.join(map(str, big.shape))}")
    cm.eval_step(big)  # plans for inference and builds its stages
    runner = cm._train().evaluator().last
    imods = [runner.engine.stages[s].module for _, s in runner.engine.held]
    extra = big.numel() * big.element_size() if device.type != "cuda" else 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _, inf_peak = _peak(lambda: cm.eval_step(big), device, imods, None, extra)
    inf_pred = runner.plan.ranks[0].predicted_peak_bytes
    how = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "aten allocation tracker (CPU)"
    print(f"\n### 2. Peak memory against the plan, one {device} device ({how})\n")
    print("| step | input | measured | predicted | measured / predicted |")
    print("|---|---|---|---|---|")
    rows = [("training step (Adam)", shape, train_peak, train_pred), ("whole-image inference", tuple(big.shape),
                                                                      inf_peak, inf_pred)]
    for what, shp, meas, pred in rows:
        print(f"| {what} | {'x'.join(map(str, shp))} | {format_bytes(meas)} | {format_bytes(pred)} | {meas / pred:.2f} |")
    static = static_bytes(imods, None)
    print(f"\ninference weights and buffers: {format_bytes(static)}; the inference plan: "
          f"{runner.plan.config['stages']} stage(s), schedule {runner.plan.config['schedule']}")
    return {"train": {"input": list(shape), "measured": train_peak, "predicted": train_pred},
            "inference": {"input": list(big.shape), "measured": inf_peak, "predicted": inf_pred}}


# ---- 3. recompute and offload on the device -----------------------------------------------------
def lever_section(sizes: dict[str, Any], device: torch.device, spec: str) -> dict[str, Any]:
    """The UNet on one device with saved activations kept, recomputed, and offloaded to pinned host
    memory (a side copy stream on CUDA): peak memory and step time against each plan."""
    shape = sizes["lever_in"]
    g = torch.Generator().manual_seed(SEED)
    x, y = torch.randn(*shape, generator=g), torch.randint(0, 2, (shape[0], *shape[2:]), generator=g)
    print(f"\n### 3. Recompute and offload, UNet {'x'.join(map(str, shape))} on one {device.type} device\n")
    print("| saved activations | measured peak | predicted peak | ratio | step time (median) | predicted step | "
          "ratio | loss after 2 steps |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for what, kw in (("kept", {"recompute": "off", "offload": "off"}), ("recomputed", {"recompute": "on", "offload": "off"}),
                     ("offloaded", {"recompute": "off", "offload": "on"})):
        _log(f"levers: {what}")
        torch.manual_seed(SEED)
        model = nowdl.models.unet(3, 2, **sizes["unet"])
        try:
            cm = nowdl.compile(model, gpus=1, stages=1, spatial_parts=1, mode="estimate", device_spec=spec,
                               device=device, loss_fn=nn.CrossEntropyLoss(), cache=False, progress=False, **kw)
            loss = [cm.train_step(x, y) for _ in range(2)][-1]
        except Exception as e:  # a lever the spec or this build refuses: say so and go on
            print(f"| {what} | not run: {type(e).__name__}: {str(e).splitlines()[0][:160]} |||||||")
            rows.append({"what": what, "error": str(e).splitlines()[0]})
            continue
        eng = cm._train().engine
        assert eng is not None
        mods = [eng.stages[s].module for _, s in eng.held]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        run = functools.partial(cm.train_step, x, y)
        _, peak = _peak(run, device, mods, eng.optimizer, 0)
        (step_s,) = median_times([run], device, sizes["lever_steps"], 0)
        plan = cm._train().plan
        assert plan is not None
        pred, pred_s = plan.ranks[0].predicted_peak_bytes, float(plan.predicted.get("step_s", 0.0))
        print(f"| {what} | {format_bytes(peak)} | {format_bytes(pred)} | {peak / pred:.2f} | {step_s * 1e3:.1f} ms | "
              f"{pred_s * 1e3:.1f} ms | {_ratio(step_s, pred_s)} | {loss:.6f} |")
        rows.append({"what": what, "measured": peak, "predicted": pred, "step_s": step_s, "predicted_step_s": pred_s,
                     "loss": loss})
        del cm, eng, mods, run  # the next row's peak must not count this row's weights and Adam state
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"input": list(shape), "rows": rows}


# ---- 4. two processes on one device --------------------------------------------------------------
def _data(step: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2, *shape[1:], generator=g), torch.randint(0, 2, (2, *shape[2:]), generator=g)


def _two_worker(rank: int, world: int, device: str, sizes: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(SEED)
    model = nowdl.models.unet(3, 2, **sizes["unet"])
    cm = nowdl.compile(model, gpus=2, stages=2, dp=1, replicas=1, spatial_parts=1, micro_batches=2, mode="estimate",
                       balance="compute",
                       device=device, loss_fn=nn.CrossEntropyLoss(), cache=False, progress=False, timeout_s=120,
                       backend="gloo")
    losses = [cm.train_step(*_data(s, sizes["unet_in"])) for s in range(2)]
    big = torch.randn(*sizes["unet_big"], generator=torch.Generator().manual_seed(7))
    out = cm.eval_step(big)
    return {"losses": losses, "out": None if out is None else out.cpu(), "sd": cm.state_dict()}


def two_process_section(sizes: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Two gloo ranks on ``device``: a 2-stage pipeline trains and evaluates, against one process."""
    _log(f"two processes on {device} (gloo)")
    print(f"\n### 4. Two processes on one {device.type} device (gloo, 2 pipeline stages)\n")
    try:
        # spawn: this process has used CUDA and autograd, which a forked child cannot
        res = run_workers(_two_worker, 2, str(device), sizes, timeout_s=300,
                          start_method="spawn" if device.type == "cuda" else "forkserver")
    except WorkerError as e:
        lines = {r: (f.strip().splitlines() or [""])[-1] for r, f in sorted(e.failures.items())} or {-1: str(e)}
        print("not run: " + "; ".join(f"rank {r}: {line}" for r, line in lines.items()))
        return {"ok": False, "error": lines, "failures": {str(r): f for r, f in e.failures.items()}}
    torch.manual_seed(SEED)
    ref = nowdl.models.unet(3, 2, **sizes["unet"])
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)  # the optimizer compile() builds by default
    want = []
    for s in range(2):
        x, y = _data(s, sizes["unet_in"])
        opt.zero_grad()
        total = 0.0
        for xi, yi in zip(x.chunk(2), y.chunk(2), strict=True):
            loss = nn.functional.cross_entropy(ref(xi), yi) / 2
            loss.backward()
            total += float(loss.detach())
        opt.step()
        want.append(total)
    big = torch.randn(*sizes["unet_big"], generator=torch.Generator().manual_seed(7))
    ref.load_state_dict(res[0]["sd"])
    with torch.no_grad():
        out_want = ref.eval()(big)
    loss_diff = max(abs(a - b) for a, b in zip(res[0]["losses"], want, strict=True))
    out_diff = float((res[0]["out"] - out_want).abs().max())
    print("| check | value |\n|---|---|")
    print(f"| losses (2 ranks) | {', '.join(f'{v:.6f}' for v in res[0]['losses'])} |")
    print(f"| losses (one process) | {', '.join(f'{v:.6f}' for v in want)} |")
    print(f"| largest loss difference | {loss_diff:.2e} |")
    print(f"| whole-image output {'x'.join(map(str, big.shape))}: largest difference to the plain model | "
          f"{out_diff:.2e} |")
    return {"ok": True, "losses": res[0]["losses"], "reference": want, "loss_diff": loss_diff, "out_diff": out_diff}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the small CPU mode (default when CUDA is not available)")
    ap.add_argument("--out", metavar="FILE", help="save every figure as JSON")
    ap.add_argument("--skip", action="append", default=[], choices=("profiler", "memory", "two", "levers"),
                    help="leave a section out (repeatable)")
    args = ap.parse_args(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    spec = _spec_name(device)
    sizes = _sizes(cpu)
    t0 = time.perf_counter()
    print(f"## nowdl GPU check on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'} "
          f"(torch {torch.__version__}, nowdl {nowdl.__version__}, device spec {spec})")
    out: dict[str, Any] = {"device": str(device), "spec": spec, "torch": torch.__version__}
    if "profiler" not in args.skip:
        torch.manual_seed(SEED)
        out["profiler"] = [
            profiler_section("UNet", nowdl.models.unet(3, 2, **sizes["unet"]), sizes["unet_in"], device, spec,
                             sizes["top"], sizes["repeats"]),
            profiler_section("ResNet-110-v2", nowdl.models.resnet110v2(), sizes["resnet_in"], device, spec, sizes["top"],
                             sizes["repeats"]),
        ]
    if "memory" not in args.skip:
        out["memory"] = memory_section(sizes, device, spec)
    if "levers" not in args.skip:
        out["levers"] = lever_section(sizes, device, spec)
    if "two" not in args.skip:
        out["two_processes"] = two_process_section(sizes, device)
    out["wall_s"] = time.perf_counter() - t0
    print(f"\nwall time: {out['wall_s']:.1f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=lambda v: None if isinstance(v, float)
                                             and not math.isfinite(v) else str(v)))
        _log(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
