"""The fewest GPUs that train the built-in UNet on one large image, in estimate mode.

For each image side the planner is asked for 1, 2, 4, ... GPUs until a plan fits, then for every
count between the last power of two that failed and the first that fitted; once with sequential
tiles forbidden (``tiles_per_gpu=1``: spatial tiles up to the GPU count only) and once with
``tiles_per_gpu="auto"``. H100 80 GiB spec, fp32, Adam, one sample per step (``global_batch=1``).

    PYTHONPATH=. python benchmarks/bench_fewest_gpus.py [--sides 8192 16384 32768] [--time-limit 60]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import nowdl
from nowdl.errors import InfeasibleError, NowdlError

__all__ = ["fewest", "main"]


def _plan(side: int, gpus: int, tiles: str | int, time_limit: float) -> Any:
    cm = nowdl.compile(nowdl.models.unet(), gpus=gpus, mode="estimate", device_spec="h100", progress=False,
                       cache=False, global_batch=1, tiles_per_gpu=tiles,
                       planner=nowdl.PlannerOptions(time_limit=time_limit))
    try:
        return cm.plan(torch.empty(1, 3, side, side, device="meta"))
    except (InfeasibleError, NowdlError):
        return None


def fewest(side: int, tiles: str | int, time_limit: float, max_gpus: int = 128) -> tuple[int | None, Any, float]:
    """(fewest GPUs, its plan, planning seconds of that plan); (None, None, 0) up to ``max_gpus``."""
    last_fail, g = 0, 1
    while g <= max_gpus:
        t0 = time.perf_counter()
        plan = _plan(side, g, tiles, time_limit)
        if plan is not None:
            secs = time.perf_counter() - t0
            for h in range(last_fail + 1, g):  # the counts between
                t1 = time.perf_counter()
                p = _plan(side, h, tiles, time_limit)
                if p is not None:
                    return h, p, time.perf_counter() - t1
            return g, plan, secs
        last_fail, g = g, g * 2
    return None, None, 0.0


def _row(side: int, tiles: str | int, found: tuple[int | None, Any, float]) -> str:
    g, plan, secs = found
    if plan is None:
        return f"| {side}² | {tiles} | none up to 128 | | | | |"
    sp = plan.config.get("spatial") or {}
    layout = (f"{plan.config['stages']} stage(s), parts {sp.get('stage_parts', [1])}, "
              f"{max(s.tiles_per_gpu for s in plan.stages)} tile(s)/GPU")
    return (f"| {side}² | {tiles} | {g} | {layout} | {plan.predicted['peak_bytes'] / 2**30:.1f} GiB | "
            f"{plan.predicted['step_s']:.2f} s | {secs:.1f} s |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sides", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args()
    print("| image | tiles_per_gpu | fewest GPUs | plan | peak/GPU | step | plan time |")
    print("|---|---|---|---|---|---|---|")
    for side in args.sides:
        for tiles in (1, "auto"):
            print(_row(side, tiles, fewest(side, tiles, args.time_limit)), flush=True)


if __name__ == "__main__":
    main()
