"""Fit the built-in GPU specs to the GPU records: op efficiency, per-op floor, convolution workspace.

    python benchmarks/fit_specs.py                       # every records file under benchmarks/records/
    python benchmarks/fit_specs.py --write               # and write nowdl/profiler/specs/fitted.json
    python benchmarks/fit_specs.py --results --write     # and docs/results/fit_specs.md

Time ([Note: op efficiency] in nowdl/profiler/flops.py): each measured time of the records (a
training step, a recomputed step, a model's forward or backward summed over its nodes) is a
sample; the ops that make it are those the estimate-mode profile counts node by node at the
spec's peaks (the ops the plan's times sum over), and
``nowdl.profiler.calibrate.fit.fit_time`` chooses (top, half, floor) so that the worst sample's
error is smallest. Memory ([Note: convolution workspace] in nowdl/profiler/memory.py): the
cuDNN workspace ratio that makes the worst of the training and inference rows' predicted peaks
closest to the measured ``max_memory_allocated``; the recompute and offload rows are left out of
the fit and checked with it. The fitted fields go to the h200 spec the records were measured on
and to the h100 (the same Hopper chip; its memory bandwidth is its own). The table compares
every row with the plan before and after the fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harvest.steps import Row, build_model  # noqa: E402
from harvest.torch_tools import mem_tracker_peak  # noqa: E402
from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402

import nowdl  # noqa: E402
from nowdl.profiler import profile  # noqa: E402
from nowdl.profiler.calibrate.fit import Sample, fit_time, predict  # noqa: E402
from nowdl.profiler.calibrate.records import Records, load_records  # noqa: E402
from nowdl.profiler.devices import BUILTIN_SPECS, DATASHEET_SPECS, FITTED_PATH, DeviceSpec  # noqa: E402
from nowdl.profiler.estimate import recording  # noqa: E402
from nowdl.trace.tracer import trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "records"


def step_ops(name: str, args: dict[str, Any], shape: list[int], spec: DeviceSpec) -> tuple[list[Any], list[Any]]:
    """The ops of ``name``'s forward and of its backward as the estimate-mode profile counts them
    node by node on ``spec``'s peaks: the ops a plan's predicted times sum over."""
    model = build_model(name, args)
    x = torch.empty(*shape, device="meta")
    gm = trace(model, (x,)).gm
    with recording() as ops:
        profile(gm, (x,), mode="estimate", device_spec=spec, cache=False, progress=False)
    return ops.get("fwd", []), ops.get("bwd", [])


def time_samples(recs: list[Records], spec: DeviceSpec) -> list[Sample]:
    out: list[Sample] = []
    for r in recs:
        for row in r.rows("steps"):
            if row["kind"] not in ("train", "recompute") or not row.get("step_s"):
                continue
            f, b = step_ops(row["model"], row["args"], row["input"], spec)
            again = f if row["kind"] == "recompute" else []  # the backward runs the forward again
            out.append(Sample(f"{r.path.stem}: {row['label']} step", [*f, *b, *again], float(row["step_s"])))
        for p in r.rows("profiles"):
            total = p.get("total", {})
            if "fwd_s" not in total:
                continue
            f, b = step_ops(p["model"], p["args"], p["input"], spec)
            spread = p.get("spread", {})  # runs of the same measurement that spread widely: an interval
            for what, ops, key in (("forward", f, "fwd_s"), ("backward", b, "bwd_s")):
                lo, hi = spread.get(key, [total[key][0], None])
                out.append(Sample(f"{r.path.stem}: {p['model']} {'x'.join(map(str, p['input']))} {what} (nodes)", ops,
                                  float(lo), measured_hi_s=None if hi is None else float(hi)))
    return out


def planned(row: dict[str, Any], spec: DeviceSpec) -> tuple[float, float]:
    """The plan's peak bytes and step seconds for a step row, on ``spec``, with this code."""
    kw = {k: v for k, v in row["compile"].items() if k not in ("mode", "device_spec")}
    cm = nowdl.compile(build_model(row["model"], row["args"]), mode="estimate", device_spec=spec, device="cpu",
                       loss_fn=nn.CrossEntropyLoss(), cache=False, progress=False, **kw)
    shape = row["input"]
    x = torch.empty(*shape, device="meta")
    y = (torch.zeros(shape[0], dtype=torch.long) if row["model"] == "resnet110v2"
         else torch.zeros(shape[0], *shape[2:], dtype=torch.long))
    plan = cm.plan(x, target=y, train=row["kind"] != "inference")
    return float(max(r.predicted_peak_bytes for r in plan.ranks)), float(plan.predicted.get("step_s", 0.0))


def fit_workspace(recs: list[Records], spec: DeviceSpec) -> tuple[float, float]:
    """The convolution workspace ratio (0 to 3 by 0.05) that makes the worst training or inference
    row's |log(measured / planned)| smallest; the ratio and that error."""
    rows = [row for r in recs for row in r.rows("steps") if row["kind"] in ("train", "inference")]
    best = (0.0, math.inf)
    for i in range(61):
        ratio = round(i * 0.05, 2)
        s = dataclasses.replace(spec, conv_workspace=ratio or None)
        worst = max(abs(math.log(row["max_allocated"] / planned(row, s)[0])) for row in rows)
        if worst < best[1] - 1e-9:
            best = (ratio, worst)
    return best


def table(recs: list[Records], before: DeviceSpec, after: DeviceSpec, samples: list[Sample],
          fitted: dict[str, Any]) -> str:
    lines = ["### Memory: every step row against the plan, before and after the fit", "",
             "| records | row | measured | planned before | ratio | planned after | ratio | torch MemTracker | ratio | "
             "step ms | planned ms after | ratio |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        for row in r.rows("steps"):
            p0, _ = planned(row, before)
            p1, s1 = planned(row, after)
            m, st = row["max_allocated"], row.get("step_s")
            mt = (mem_tracker_peak(Row(row["model"], row["args"], tuple(row["input"]), row["kind"]), torch.device("cpu"))
                  if row["kind"] in ("train", "inference") else None)  # torch's estimator of an eager step
            mt_txt = f"{mt / 2**30:.2f} GiB | {m / mt:.2f}" if mt else "— | —"
            step = f"{st * 1e3:.1f} | {s1 * 1e3:.1f} | {st / s1:.2f}" if st else f"— | {s1 * 1e3:.1f} | —"
            lines.append(f"| {r.path.stem} | {row['label']} | {m / 2**30:.2f} GiB | {p0 / 2**30:.2f} GiB | {m / p0:.2f} | "
                         f"{p1 / 2**30:.2f} GiB | {m / p1:.2f} | {mt_txt} | {step} |")
    t = fitted["time"]
    lines += ["", "### Time: every sample against the fit", "",
              "| sample | ops | measured ms | roofline ms | fitted ms | fitted against measured |",
              "|---|---|---|---|---|---|"]
    for s in samples:
        roof = predict(s, 1.0, 0.0, 0.0)
        fit = predict(s, t["top"], t["half"], t["floor_s"])
        meas = f"{s.measured_s * 1e3:.1f}" + (f"–{s.measured_hi_s * 1e3:.1f}" if s.measured_hi_s else "")
        off = math.exp(s.error(fit)) - 1
        where = "within" if not off else f"{'+' if fit > s.measured_s else '-'}{off:.0%} outside"
        lines.append(f"| {s.label} | {len(s.ops)} | {meas} | {roof * 1e3:.1f} | {fit * 1e3:.1f} | {where} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write the fit to {FITTED_PATH.relative_to(ROOT)}")
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    recs = [load_records(p) for p in sorted(RECORDS.glob("*.json")) if not p.name.endswith(".history.json")]
    recs = [r for r in recs if "h200" in r.device.lower() or "h100" in r.device.lower()]
    base = DATASHEET_SPECS["h200"]
    samples = time_samples(recs, base)
    tf = fit_time(samples)
    timed = dataclasses.replace(base, op_floor_s=tf.floor_s, op_efficiency={"other": (tf.top, tf.half)})
    ratio, mem_err = fit_workspace(recs, timed)
    fitted = {
        "time": {"top": tf.top, "half": tf.half, "floor_s": tf.floor_s, "worst_log_error": round(tf.worst, 4)},
        "conv_workspace": ratio, "memory_worst_log_error": round(mem_err, 4),
        "records": [r.path.name for r in recs], "torch": sorted({r.torch for r in recs}),
        "fitted_by": "benchmarks/fit_specs.py",
    }
    after = dataclasses.replace(timed, conv_workspace=ratio or None)
    print(f"## Fit of the h200/h100 specs to {', '.join(fitted['records'])}\n")
    print(f"time: efficiency {tf.top:.2f} x work / (work + {tf.half:.3g}), floor {tf.floor_s * 1e6:.1f} µs per op "
          f"(worst sample off by {math.exp(tf.worst) - 1:.1%}); convolution workspace {ratio:.2f} x operands "
          f"(worst fitted row off by {math.exp(mem_err) - 1:.1%})\n")
    print(table(recs, BUILTIN_SPECS["h200"] if not args.write else base, after, samples, fitted))
    if args.write:
        FITTED_PATH.write_text(json.dumps({"h200": fitted, "h100": fitted}, indent=1) + "\n")
        print(f"\nwrote {FITTED_PATH.relative_to(ROOT)} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    with recorded("fit_specs", "--results" in sys.argv):
        sys.exit(main())
