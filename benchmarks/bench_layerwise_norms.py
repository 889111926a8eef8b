"""Norms on sequential tiles, statistics passes against the layer-wise schedule, measured on one CPU rank.

nowdl's UNet with a BatchNorm after every conv (``nowdl.models.unet(1, 2, depth=3,
base_width=8, norm=True)``: 14 norms deep), float32, batch 1, MSE loss, Adam, on one CPU rank
with one thread, T sub-tiles one after another ([Note: sequential norms], [Note: layer-wise
norms], [Note: layer-wise backward]). Both rows run the planner's plan for ``tiles_per_gpu=T``
with ``stages[0].norm_schedule`` set by hand (on a CPU the host memory is the device's own). Per
row: the fastest of ``--reps`` steps (the rows' steps taken in turn, so a load that comes and
goes falls on both alike), the losses of the first three steps (the two schedules compute the
same values), and the most bytes the layer-wise schedule kept in host memory at once (its
forward's values, the backward's boundary and gradients) against the planner's figure for it
([Note: layer-wise norms cost]).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

import nowdl
from nowdl.partitioner.costs.costmodel import Costs
from nowdl.partitioner.costs.sequential_tiles import schedule_of
from nowdl.partitioner.spatial.tileable import spatial_rules
from nowdl.runtime.spatial.sequential import sub_grid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nowdl.models.unet(1, 2, depth=3, base_width=8, norm=True)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--side", type=int, default=256)
    ap.add_argument("--tiles", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(1, 1, args.side, args.side, generator=g), torch.randn(1, 2, args.side, args.side, generator=g)
    cm = nowdl.compile(_model(), gpus=1, mode="estimate", optimizer=_adam, loss_fn=nn.MSELoss(), cache=False,
                       progress=False, stages=1, spatial_parts=1, micro_batches=1, dp=1, replicas=1,
                       tiles_per_gpu=args.tiles)
    plan = json.loads(cm.plan(x, target=y).to_json())
    runs: dict[str, Any] = {}
    tmp = tempfile.mkdtemp(prefix="nowdl-layerwise-")  # the plans are read at the first step
    for sched in ("passes", "layerwise"):
        plan["stages"][0]["norm_schedule"] = sched
        path = os.path.join(tmp, f"{sched}.json")
        with open(path, "w") as f:
            json.dump(plan, f)
        runs[sched] = nowdl.compile(_model(), plan=path, mode="estimate", optimizer=_adam, loss_fn=nn.MSELoss(),
                                    cache=False, progress=False)
    losses: dict[str, list[float]] = {k: [] for k in runs}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(max(3, args.reps)):
        for k, r in runs.items():
            t0 = time.perf_counter()
            loss = r.train_step(x, y)
            times[k].append(time.perf_counter() - t0)
            if rep < 3:
                losses[k].append(float(loss))
    print(f"UNet depth 3 width 8, BatchNorm after every conv, {args.side}x{args.side}, T = {args.tiles}, batch 1, "
          "1 CPU rank, 1 thread\n")
    prof = cm.profile(x)
    costs = Costs(profile=prof, rules=spatial_rules(cm.trace(x).gm, prof.out_ranks()), link_bw=1e9, mem_cap=None,
                  host_memory=1.0, host_link_bw=1.0)
    planned = schedule_of(costs, 1, sub_grid((1, 1), (args.side, args.side), args.tiles)).host_bytes / 2**20
    print("| norm schedule | fastest step s | step / passes | losses of steps 1-3 | host memory at once MiB | "
          "planned MiB |")
    print("|---|---|---|---|---|---|")
    for k, r in runs.items():
        seq = next(t.sequential for t in r._trainer.engine.tiled.values())
        print(f"| {k} | {min(times[k]):.2f} | {min(times[k]) / min(times['passes']):.2f} | "
              f"{', '.join(f'{v:.6f}' for v in losses[k])} | {seq.host_meter[1] / 2**20:.1f} | "
              f"{planned if k == 'layerwise' else 0.0:.1f} |")
    print(f"\nSame losses: {'yes' if losses['passes'] == losses['layerwise'] else 'NO'}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    with recorded("bench_layerwise_norms", "--results" in sys.argv):
        main()
