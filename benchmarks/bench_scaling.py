"""Scaling study (estimate mode, no GPU needed): predicted throughput from 8 to 2,048 H100s.

What is measured
----------------
For ResNet-110-v2 at 1024² and nowdl's UNet at 8192² and 16384² (one sample per micro-batch,
a meta input), and 8, 16, 32, ..., 2,048 GPUs of DGX H100 nodes (8 GPUs per node: NVLink
450 GB/s inside a node, InfiniBand 50 GB/s per GPU between nodes; the built-in ``h100`` spec
and its ``dgx-h100`` node), ``nowdl.compile(model, gpus=N, mode="estimate",
device_spec="h100", gpu_memory="80GiB", planner=nowdl.PlannerOptions(time_limit=60)).plan(x)`` picks the configuration
(pipeline stages, spatial tiles, MASTER, data parallelism, micro-batches) with the highest
predicted throughput, placed on the nodes ([Note: placement]) and costed per link crossed
([Note: links per crossing]). Each row prints the predicted throughput (images/s), the
efficiency against ideal linear scaling from the first row of the model
(``(thr_N / N) / (thr_first / N_first)``), the chosen configuration, the bytes per step that
cross node boundaries, and the planning wall time of that row (``plan()`` end to end; the
profile is cached after the first row of a model, so later rows are trace + search).

Predictions are a roofline of the H100 spec: optimistic in absolute terms, and they assume
the global batch grows with the GPU count (weak scaling: the data-parallel degree grows).

How to run
----------
    .venv/bin/python benchmarks/bench_scaling.py [--quick] [--markdown] [--max-gpus N] [--models a,b]

``--quick`` stops at 64 GPUs; ``--markdown`` prints the table as Markdown (docs/benchmarks.md).
Progress goes to stderr, the table to stdout. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

import nowdl
from nowdl.models import resnet110v2, unet
from nowdl.plan.plan import Plan, format_bytes

GPUS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
LIMIT_S = 60.0  # the target for planning 2,048 GPUs

#: (label, builder, image side)
MODELS: dict[str, tuple[str, Callable[[], nn.Module], int]] = {
    "resnet": ("ResNet-110-v2 @ 1024²", resnet110v2, 1024),
    "unet8k": ("UNet @ 8192²", unet, 8192),
    "unet16k": ("UNet @ 16384²", unet, 16384),
}

_T0 = time.perf_counter()

from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


@dataclass
class Row:
    model: str
    gpus: int
    plan: Plan | None
    seconds: float
    error: str = ""

    @property
    def throughput(self) -> float:
        return float(self.plan.predicted["throughput"]) if self.plan is not None else 0.0


def config_text(plan: Plan) -> str:
    c = plan.config
    sp = c.get("spatial") or {}
    parts = []
    if c["dp"] > 1:
        parts.append(f"dp {c['dp']}")
    parts.append(f"{c['stages']} stage{'s' if c['stages'] > 1 else ''}")
    if sp.get("stages"):
        tiles = "/".join(str(p) for p in sp.get("stage_parts") or [sp.get("parts")])
        parts.append(f"{tiles} tiles on stages {sp['stages']}")
    if c["replicas"] == 2:
        parts.append("MASTER")
    parts.append(f"m {c['micro_batches']}")
    return ", ".join(parts)


def plan_row(label: str, build: Callable[[], nn.Module], image: int, gpus: int, cache: str) -> Row:
    x = torch.empty(1, 3, image, image, device="meta")
    t0 = time.perf_counter()
    try:
        cm = nowdl.compile(build(), gpus=gpus, mode="estimate", device_spec="h100", gpu_memory="80GiB",
                           cache=cache, progress=False, planner=nowdl.PlannerOptions(time_limit=LIMIT_S))
        plan = cm.plan(x)
    except nowdl.NowdlError as e:
        return Row(label, gpus, None, time.perf_counter() - t0, str(e).split(":")[0])
    return Row(label, gpus, plan, time.perf_counter() - t0)


def render(rows: Sequence[Row], markdown: bool) -> str:
    headers = ["model", "GPUs", "nodes", "images/s", "efficiency", "configuration", "cross-node / step",
               "halo across", "plan s"]
    first: dict[str, Row] = {}
    body = []
    for r in rows:
        if r.plan is None:
            body.append([r.model, str(r.gpus), "", "", "", f"none ({r.error})", "", "", f"{r.seconds:.1f}"])
            continue
        base = first.setdefault(r.model, r)
        eff = (r.throughput / r.gpus) / (base.throughput / base.gpus) if base.throughput else float("nan")
        topo = r.plan.topology or {}
        cross = topo.get("cross_node_bytes") or {}
        body.append([r.model, str(r.gpus), str(topo.get("nodes", 1)), f"{r.throughput:.4g}", f"{eff:.1%}",
                     config_text(r.plan), format_bytes(cross.get("total", 0.0)), format_bytes(cross.get("halo", 0.0)),
                     f"{r.seconds:.1f}"])
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--quick", action="store_true", help="stop at 64 GPUs")
    ap.add_argument("--max-gpus", type=int, default=2048)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    top = 64 if args.quick else args.max_gpus
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="nowdl-scaling-") as cache:
        os.environ.setdefault("NOWDL_CACHE_DIR", cache)
        for key in args.models.split(","):
            label, build, image = MODELS[key]
            for g in GPUS:
                if g > top:
                    break
                progress(f"{label}: planning {g} GPUs")
                row = plan_row(label, build, image, g, cache)
                rows.append(row)
                progress(f"{label}: {g} GPUs in {row.seconds:.1f} s"
                         + (f": {row.throughput:.4g} images/s, {config_text(row.plan)}" if row.plan else f": {row.error}"))
    print(render(rows, args.markdown))
    slow = [r for r in rows if r.gpus == 2048 and r.seconds > LIMIT_S]
    print()
    print(f"planning 2,048 GPUs: {', '.join(f'{r.model} {r.seconds:.1f} s' for r in rows if r.gpus == 2048) or 'not run'}"
          + (f" (over the {LIMIT_S:g} s target: {', '.join(r.model for r in slow)})" if slow else ""))
    return 0


if __name__ == "__main__":
    with recorded("bench_scaling", "--results" in sys.argv):
        sys.exit(main())
