"""Out-of-core planning (estimate mode, no GPU needed): the fewest H100s each job needs with and
without recomputation and host offload, and the predicted step time of each.

What is measured
----------------
For each model and input below (one sample per micro-batch, fp32, Adam, a meta input), and
each lever setting -- ``recompute="off", offload="off", tiles_per_gpu=1`` (without) and
``recompute="auto", offload="auto", tiles_per_gpu="auto"`` (with: the planner recomputes,
offloads or runs sequential tiles where nothing fits otherwise, [Note: choosing levers] in
partitioner/search/levers.py) -- the script plans as a user would::

    nowdl.compile(model, gpus=N, mode="estimate", device_spec="h100", gpu_memory="80GiB",
                  recompute=..., offload=..., tiles_per_gpu=..., planner=nowdl.PlannerOptions(time_limit=T)).plan(x)

for N = 1, 2, 4, 8, 16, 32, 64 in turn and stops at the first N that plans. A row gives that
N, the plan's predicted step time and throughput, its configuration, the stages that
recompute or offload and the planning wall time of that N. The device is the built-in
``h100`` spec (80 GiB; DGX H100 host: 2 TiB per 8 GPUs, 55 GB/s per GPU to the host).

Models: nowdl's built-in UNet (31M parameters) at 8192², 16384² and 32768²; ResNet-110-v2
at 8192²; and a 3D residual-encoder UNet at 512³ written here after nnU-Net's
``ResEncUNet`` "M" preset (dynamic_network_architectures: 6 stages of 32..320 features, 1, 3,
4, 6, 6, 6 residual blocks, instance norm, leaky ReLU, one conv per decoder stage), since
neither nowdl.models nor MONAI has that network (MONAI's DynUNet has one residual block per
stage).

How to run
----------
    .venv/bin/python benchmarks/bench_out_of_core.py [--markdown] [--only unet8k,resnet] [--time-limit 30]

Progress goes to stderr, the table to stdout (docs/benchmarks.md). Nothing is asserted.
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
from nowdl.errors import NowdlError
from nowdl.models import resnet110v2, unet
from nowdl.plan.plan import Plan, format_bytes

GPUS = (1, 2, 4, 8, 16, 32, 64)
SETTINGS = {"without": ("off", "off", 1), "with": ("auto", "auto", "auto")}

from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402


class _ResBlock(nn.Module):
    """nnU-Net's BasicBlockD: conv-norm-act-conv-norm, plus the input (1x1 conv after an average
    pool when the shape changes), then the activation."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.InstanceNorm3d(cout, affine=True)
        self.act1 = nn.LeakyReLU(0.01, inplace=False)
        self.conv2 = nn.Conv3d(cout, cout, 3, padding=1, bias=False)
        self.norm2 = nn.InstanceNorm3d(cout, affine=True)
        self.act2 = nn.LeakyReLU(0.01, inplace=False)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            pool: nn.Module = nn.AvgPool3d(stride, stride) if stride != 1 else nn.Identity()
            self.skip = nn.Sequential(pool, nn.Conv3d(cin, cout, 1, bias=False), nn.InstanceNorm3d(cout, affine=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm2(self.conv2(self.act1(self.norm1(self.conv1(x)))))
        return self.act2(y + self.skip(x))


class ResEncUNet3d(nn.Module):
    """A residual-encoder 3D UNet shaped like nnU-Net's ResEncUNet M (stem conv, residual
    encoder, transposed-conv decoder with one conv block per stage)."""

    def __init__(self, in_channels: int = 1, out_channels: int = 2,
                 features: Sequence[int] = (32, 64, 128, 256, 320, 320),
                 blocks: Sequence[int] = (1, 3, 4, 6, 6, 6)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv3d(in_channels, features[0], 3, padding=1, bias=False),
                                  nn.InstanceNorm3d(features[0], affine=True), nn.LeakyReLU(0.01))
        self.encoder = nn.ModuleList()
        cin = features[0]
        for i, (f, n) in enumerate(zip(features, blocks, strict=True)):
            self.encoder.append(nn.Sequential(*[_ResBlock(cin if j == 0 else f, f, 2 if (i > 0 and j == 0) else 1)
                                                for j in range(n)]))
            cin = f
        self.up = nn.ModuleList()
        self.decoder = nn.ModuleList()
        for i in range(len(features) - 1, 0, -1):
            self.up.append(nn.ConvTranspose3d(features[i], features[i - 1], 2, stride=2, bias=False))
            self.decoder.append(nn.Sequential(
                nn.Conv3d(2 * features[i - 1], features[i - 1], 3, padding=1, bias=False),
                nn.InstanceNorm3d(features[i - 1], affine=True), nn.LeakyReLU(0.01)))
        self.head = nn.Conv3d(features[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        x = self.stem(x)
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
        x = skips.pop()
        for up, dec in zip(self.up, self.decoder, strict=True):
            x = dec(torch.cat([up(x), skips.pop()], dim=1))
        return self.head(x)


#: key -> (label, builder, input shape)
MODELS: dict[str, tuple[str, Callable[[], nn.Module], tuple[int, ...]]] = {
    "unet8k": ("UNet fp32 @ 8192²", unet, (1, 3, 8192, 8192)),
    "unet16k": ("UNet fp32 @ 16384²", unet, (1, 3, 16384, 16384)),
    "unet32k": ("UNet fp32 @ 32768²", unet, (1, 3, 32768, 32768)),
    "resnet": ("ResNet-110-v2 @ 8192²", resnet110v2, (1, 3, 8192, 8192)),
    "resenc3d": ("ResEnc UNet 3D (nnU-Net M) @ 512³", ResEncUNet3d, (1, 1, 512, 512, 512)),
}

_T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


@dataclass
class Row:
    label: str
    levers: str  # "without" | "with"
    gpus: int | None  # fewest GPUs that plan (None: none up to max(GPUS))
    plan: Plan | None
    plan_s: float  # plan() wall time at that GPU count
    refused: str  # why the last count tried was refused, when none planned


def config_text(plan: Plan) -> str:
    c = plan.config
    sp = c.get("spatial") or {}
    bits = [f"dp {c['dp']}" if c["dp"] > 1 else "", f"{c['stages']} stage{'s' if c['stages'] > 1 else ''}",
            f"{'/'.join(map(str, sp.get('stage_parts') or []))} GPU(s) of tiles on stages {sp.get('stages')}" if sp else "",
            f"{sp['tiles_per_gpu']} tiles per GPU in turn" if sp.get("tiles_per_gpu", 1) > 1 else "",
            "MASTER" if c["replicas"] == 2 else "", f"m {c['micro_batches']}"]
    return ", ".join(b for b in bits if b)


def levers_text(plan: Plan) -> str:
    rc = [s.index for s in plan.stages if s.recompute]
    off = [s.index for s in plan.stages if s.offload]
    parts = []
    if rc:
        parts.append(f"recompute {rc}")
    if off:
        host = max(s.predicted.get("offloaded_bytes", 0.0) for s in plan.stages)
        parts.append(f"offload {off} ({format_bytes(host)}/GPU on host)")
    for s in plan.stages:  # [Note: layer-wise norms cost]
        if s.norm_schedule == "layerwise":
            parts.append(f"stage {s.index} norms layer-wise ({format_bytes(s.predicted.get('norm_host_bytes', 0.0))}"
                         "/GPU on host)")
        elif s.norm_schedule == "passes":
            parts.append(f"stage {s.index} norms by statistics passes")
    return "; ".join(parts) or "-"


def fewest(label: str, build: Callable[[], nn.Module], shape: tuple[int, ...], levers: str, cache: str,
           time_limit: float) -> Row:
    rc, off, tiles = SETTINGS[levers]
    why = ""
    for g in GPUS:
        t0 = time.perf_counter()
        try:
            cm = nowdl.compile(build(), gpus=g, mode="estimate", device_spec="h100", gpu_memory="80GiB", cache=cache,
                               progress=False, recompute=rc, offload=off, tiles_per_gpu=tiles,
                               planner=nowdl.PlannerOptions(time_limit=time_limit))
            plan = cm.plan(torch.empty(shape, device="meta"))
        except NowdlError as e:
            why = str(e).split(":")[0]
            progress(f"{label} {levers} levers, {g} GPUs: refused ({time.perf_counter() - t0:.1f} s): {str(e)[:140]}")
            continue
        dt = time.perf_counter() - t0
        progress(f"{label} {levers} levers, {g} GPUs: step {plan.predicted['step_s']:.3g} s ({dt:.1f} s)")
        return Row(label, levers, g, plan, dt, "")
    return Row(label, levers, None, None, 0.0, why)


def render(rows: Sequence[Row], markdown: bool) -> str:
    head = ["model", "levers", "fewest GPUs", "step (s)", "images/s", "peak/GPU", "configuration", "recompute / offload",
            "plan (s)"]
    body = []
    for r in rows:
        if r.plan is None:
            body.append([r.label, r.levers, f"none <= {GPUS[-1]}", "", "", "", r.refused, "", ""])
            continue
        p = r.plan
        body.append([r.label, r.levers, str(r.gpus), f"{p.predicted['step_s']:.3g}", f"{p.predicted['throughput']:.3g}",
                     format_bytes(p.predicted["peak_bytes"]), config_text(p), levers_text(p), f"{r.plan_s:.1f}"])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), *(fmt.format(*row) for row in body)])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--only", help="comma-separated keys of MODELS")
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per plan() (default 20)")
    args = ap.parse_args(argv)
    keys = args.only.split(",") if args.only else list(MODELS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="nowdl-ooc-") as cache:
        os.environ.setdefault("NOWDL_CACHE_DIR", cache)
        for key in keys:
            label, build, shape = MODELS[key]
            for levers in SETTINGS:
                rows.append(fewest(label, build, shape, levers, cache, args.time_limit))
    print(render(rows, args.markdown))
    return 0


if __name__ == "__main__":
    with recorded("bench_out_of_core", "--results" in sys.argv):
        sys.exit(main())
