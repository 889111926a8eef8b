"""The fewest GPUs that train each out-of-core job, in estimate mode, with the planner choosing
recompute, host offload and sequential tiles, against the plan without them.

For each job (bench_out_of_core.MODELS: the built-in UNet at 8192², 16384² and 32768²,
ResNet-110-v2 at 8192², nnU-Net's residual-encoder UNet "M" at 512³) the planner is asked, with
``recompute="auto", offload="auto", tiles_per_gpu="auto"``, for 1, 2, 4, ... GPUs until a plan
fits, then for every count between the last power of two that failed and the first that fitted.
On the fewest count found it is asked again without the levers (``recompute="off",
offload="off", tiles_per_gpu=1``), and the fewest powers of two that fit without them are
looked for too (``--no-baseline`` skips that scan). H100 80 GiB spec (``h100``: 2 TiB of host
memory per 8 GPUs, 55 GB/s each to the host), fp32, Adam, one sample per step
(``global_batch=1``), a profile cache shared by the GPU counts of a job. A count refused
because the search ran out of its time limit ([Note: search deadline]) is marked, since a plan
might exist there.

Nets with norms ([Note: norm passes cost]: sequential tiles run statistics passes for them):
MONAI's ``UNet(spatial_dims=2, in_channels=3, out_channels=2, channels=(32, 64, 128, 256, 512),
strides=(2, 2, 2, 2), num_res_units=2)`` with its default InstanceNorm and with ``norm="batch"``
at 16384² and 32768², nnU-Net's PlainConvUNet (``dynamic_network_architectures``, InstanceNorm) at 512³ and
MONAI's SegResNet (GroupNorm) at 16384² (``NORM_MODELS``; ``--only`` takes their keys too).

    PYTHONPATH=. python benchmarks/bench_fewest_gpus.py [--only unet8k,resnet] [--time-limit 60]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from bench_out_of_core import MODELS, config_text, levers_text
from torch import nn

import nowdl
from nowdl.errors import NowdlError

__all__ = ["fewest", "main"]

def _monai_unet(norm: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from monai.networks.nets import UNet

        kw = {} if norm == "instance" else {"norm": norm}
        return UNet(spatial_dims=2, in_channels=3, out_channels=2, channels=(32, 64, 128, 256, 512),
                    strides=(2, 2, 2, 2), num_res_units=2, **kw)
    return build


def _segresnet() -> nn.Module:
    from monai.networks.nets import SegResNet

    return SegResNet(spatial_dims=2, in_channels=3, out_channels=2)


def _plain_conv_unet() -> nn.Module:
    """nnU-Net's own PlainConvUNet (``dynamic_network_architectures``) as its 3d_fullres plans
    build it for a large volume: 6 stages of 32, 64, 128, 256, 320, 320 features, two
    conv-InstanceNorm-LeakyReLU per stage, strided convs down, transposed convs up, conv bias."""
    from dynamic_network_architectures.architectures.unet import PlainConvUNet

    return PlainConvUNet(input_channels=1, n_stages=6, features_per_stage=(32, 64, 128, 256, 320, 320),
                         conv_op=nn.Conv3d, kernel_sizes=3, strides=(1, 2, 2, 2, 2, 2), n_conv_per_stage=2,
                         num_classes=2, n_conv_per_stage_decoder=2, conv_bias=True, norm_op=nn.InstanceNorm3d,
                         norm_op_kwargs={"eps": 1e-5, "affine": True}, nonlin=nn.LeakyReLU,
                         nonlin_kwargs={"inplace": True})


NORM_MODELS: dict[str, tuple[str, Callable[[], nn.Module], tuple[int, ...]]] = {
    "monai_in16k": ("MONAI UNet (InstanceNorm) @ 16384²", _monai_unet("instance"), (1, 3, 16384, 16384)),
    "monai_bn16k": ("MONAI UNet (BatchNorm) @ 16384²", _monai_unet("batch"), (1, 3, 16384, 16384)),
    "monai_in32k": ("MONAI UNet (InstanceNorm) @ 32768²", _monai_unet("instance"), (1, 3, 32768, 32768)),
    "monai_bn32k": ("MONAI UNet (BatchNorm) @ 32768²", _monai_unet("batch"), (1, 3, 32768, 32768)),
    "plain3d": ("nnU-Net PlainConvUNet 3D (InstanceNorm) @ 512³", _plain_conv_unet, (1, 1, 512, 512, 512)),
    "segresnet": ("SegResNet (GroupNorm) @ 16384²", _segresnet, (1, 3, 16384, 16384)),
}
JOBS = {**MODELS, **NORM_MODELS}

AUTO: dict[str, Any] = dict(recompute="auto", offload="auto", tiles_per_gpu="auto")
OFF: dict[str, Any] = dict(recompute="off", offload="off", tiles_per_gpu=1)
MAX_GPUS = 64
_T0 = time.perf_counter()

from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402


def _say(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


@dataclass
class Found:
    gpus: int | None = None
    plan: Any = None
    secs: float = 0.0
    timed_out: list[int] = field(default_factory=list)  # counts refused because the time limit ran out


def _plan(build: Callable[[], nn.Module], shape: tuple[int, ...], gpus: int, levers: dict[str, Any],
          time_limit: float, cache: str, found: Found) -> tuple[Any, float]:
    t0 = time.perf_counter()
    cm = nowdl.compile(build(), gpus=gpus, mode="estimate", device_spec="h100", progress=False, cache=cache,
                       global_batch=1, planner=nowdl.PlannerOptions(time_limit=time_limit), **levers)
    try:
        plan = cm.plan(torch.empty(shape, device="meta"))
    except NowdlError as e:
        secs = time.perf_counter() - t0
        if str(e).startswith("time limit:"):
            found.timed_out.append(gpus)
        _say(f"  {gpus} GPUs refused in {secs:.1f} s: {str(e)[:150]}")
        return None, secs
    secs = time.perf_counter() - t0
    _say(f"  {gpus} GPUs: step {plan.predicted['step_s']:.3g} s, planned in {secs:.1f} s")
    return plan, secs


def fewest(build: Callable[[], nn.Module], shape: tuple[int, ...], levers: dict[str, Any], time_limit: float,
           cache: str, *, between: bool = True) -> Found:
    """The fewest GPUs (powers of two, then the counts between) whose plan fits."""
    found = Found()
    last_fail, g = 0, 1
    while g <= MAX_GPUS:
        plan, secs = _plan(build, shape, g, levers, time_limit, cache, found)
        if plan is not None:
            found.gpus, found.plan, found.secs = g, plan, secs
            for h in range(last_fail + 1, g) if between else ():
                p, s = _plan(build, shape, h, levers, time_limit, cache, found)
                if p is not None:
                    found.gpus, found.plan, found.secs = h, p, s
                    break
            return found
        last_fail, g = g, g * 2
    return found


def _step(plan: Any) -> str:
    return f"{plan.predicted['step_s']:.3g} s"


def row(label: str, auto: Found, same: Any, base: Found | None) -> str:
    if auto.plan is None:
        return f"| {label} | none up to {MAX_GPUS} | | | | | | | |"
    p = auto.plan
    timed = f" (time limit ran out on {auto.timed_out})" if auto.timed_out else ""
    without = _step(same) if same is not None else "does not fit"
    if base is None:
        base_txt = "not run"
    elif base.plan is None:
        base_txt = f"none up to {MAX_GPUS}"
    else:
        base_txt = f"{base.gpus} ({_step(base.plan)})" + (f", time limit ran out on {base.timed_out}" if base.timed_out else "")
    return (f"| {label} | {auto.gpus}{timed} | {config_text(p)} | {levers_text(p)} | "
            f"{p.predicted['peak_bytes'] / 2**30:.1f} GiB | {_step(p)} | {auto.secs:.1f} s | {without} | {base_txt} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--only", help="comma-separated keys of bench_out_of_core.MODELS and NORM_MODELS: " + ",".join(JOBS))
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per plan() (default 60)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the fewest GPUs without the levers")
    args = ap.parse_args()
    keys = args.only.split(",") if args.only else list(JOBS)
    lines = ["| job | fewest GPUs (levers auto) | plan | recompute / offload / norms | peak/GPU | step | plan() time | "
             "step without levers, same GPUs | fewest GPUs without levers (powers of two; step) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key in keys:
        label, build, shape = JOBS[key]
        with tempfile.TemporaryDirectory(prefix="nowdl-fewest-") as cache:
            _say(f"{label}: levers auto")
            auto = fewest(build, shape, AUTO, args.time_limit, cache)
            same = None
            if auto.gpus is not None:
                _say(f"{label}: without levers on {auto.gpus} GPUs")
                same, _ = _plan(build, shape, auto.gpus, OFF, args.time_limit, cache, Found())
            base = None
            if not args.no_baseline:
                _say(f"{label}: fewest without levers")
                base = fewest(build, shape, OFF, args.time_limit, cache, between=False)
        lines.append(row(label, auto, same, base))
        print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    with recorded("bench_fewest_gpus", "--results" in sys.argv):
        main()
