"""Sequential tiles on one CPU rank: peak memory and step time vs T, and the largest trainable side.

What is measured
----------------
The model is nowdl's UNet (``nowdl.models.unet(1, 2, depth=3, base_width=8)``, no norms,
float32, batch 1, MSE loss, Adam), planned for one GPU by ``nowdl.compile(...).plan``
(``mode="estimate"``, the ``cpu`` spec measured once per run, ``stages=1, spatial_parts=1, tiles_per_gpu=T``: the planner's cost model
for T sequential tiles, [Note: sequential tiles cost]) and trained by
``nowdl.compile(model, plan=...)`` in this process (one rank, one thread). T = 1 is the stage
without sequential tiles (activations saved).

* peak MiB: one more ``train_step`` after a warm-up step under nowdl's aten-level allocation
  tracker (``nowdl.runtime.training.metrics.peak_of``: parameters, gradients and Adam state
  held before the step, plus the peak of the storages the step allocates: activations,
  windows, gradients; the batch is made before the step), against the plan's
  ``predicted_peak_bytes`` (target ±10%);
* step s: the fastest of 5 ``train_step`` calls without the tracker, the rows' steps taken in
  turn (on a loaded machine the fastest is the least disturbed by other work); ``step / T=1``
  is the cost of sequential tiles in time, set beside the plan's (``predicted step / T=1``, the
  ``cpu`` device spec; target ±20%: the spec's absolute times are not fitted to this machine).

Table 1: T = 1, 2, 4, 8 at a fixed side (512, ``--quick``: 256). Table 2: the largest square
side whose peak stays under a cap (``--cap-mib``, default 64; ``--quick``: 40): without
sequential tiles (T = 1), stepping the side up by 64 from 128 until the peak exceeds the cap;
with them (the smallest T of 16 and 64 that fits), stepping up by 256 (``--quick``: 128) from
twice that side. The step time at each found side is shown. Target: side with / without >= 2.

``--norm`` gives the UNet a BatchNorm after every conv (``unet(..., norm=True)``): the stage of
sequential tiles then runs statistics passes ([Note: sequential norms]); table 1 shows the plan's
step time beside the measured one (``predicted step s``, the ``cpu`` device spec); ``--results``
then writes docs/results/bench_sequential_tiles_norms.md. ``--measured`` plans from a profile
timed on this machine (``mode="measure"``: each op's forward and backward run and timed) instead
of the ``cpu`` roofline, whose per-op times (max pooling, small convolutions) are off by more
than the passes' structure the step cost checks.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import nowdl  # noqa: E402
from nowdl.runtime.spatial.sequential import sub_grid  # noqa: E402
from nowdl.runtime.training.metrics import peak_of  # noqa: E402

MIB = 1 << 20

from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402

NORM = False  # --norm: a BatchNorm after every conv
MODE = "estimate"  # --measured: plans from a profile timed on this machine


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nowdl.models.unet(1, 2, depth=3, base_width=8, norm=NORM)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


_SPEC: list[Any] = []


def _cpu_spec() -> Any:
    """This machine's ``cpu`` spec, measured once per run (every plan of a table then prices ops alike)."""
    if not _SPEC:
        from nowdl.profiler.devices import measure_cpu_spec

        _SPEC.append(measure_cpu_spec())
    return _SPEC[0]


def _compiled(side: int, tiles: int, tmp: str) -> tuple[Any, torch.Tensor, torch.Tensor, float]:
    x = torch.randn(1, 1, side, side)
    y = torch.randn(1, 2, side, side)
    cm = nowdl.compile(_model(), gpus=1, mode=MODE, device_spec=_cpu_spec(), optimizer=_adam, loss_fn=nn.MSELoss(),
                       cache=False, progress=False, stages=1, spatial_parts=1, micro_batches=1, dp=1, replicas=1,
                       tiles_per_gpu=tiles)  # the cpu spec: labels are not copied to a device
    plan = cm.plan(x, target=y)
    path = os.path.join(tmp, f"plan_{side}_{tiles}.json")
    plan.save(path)
    run = nowdl.compile(_model(), plan=path, mode="estimate", optimizer=_adam, loss_fn=nn.MSELoss(), cache=False,
                        progress=False)
    run.predicted_step_s = float(plan.predicted["step_s"])  # type: ignore[attr-defined]
    return run, x, y, float(plan.ranks[0].predicted_peak_bytes)


def measure(side: int, tiles: int, tmp: str, *, timed: bool = True) -> dict[str, Any]:
    """Peak bytes of a training step, the plan's prediction and the fastest step time at ``side``
    with ``tiles`` per GPU (``step``: one more step, for :func:`interleaved`)."""
    cm, x, y, pred = _compiled(side, tiles, tmp)
    loss = cm.train_step(x, y)  # builds the engine
    eng = cm._trainer.engine
    _, peak = peak_of(lambda: cm.train_step(x, y), [eng.stages[s].module for _, s in eng.held], eng.optimizer)
    out = {"peak": peak / MIB, "pred": pred / MIB, "time": float("nan"), "loss": loss,
           "pred_time": cm.predicted_step_s, "step": lambda: cm.train_step(x, y)}
    if timed:
        interleaved([out])
    return out


def interleaved(rows: list[dict[str, Any]], reps: int = 5) -> None:
    """Each row's ``time``: the fastest of ``reps`` steps, the rows' steps taken in turn (so a
    load that comes and goes on a shared machine falls on every row alike)."""
    times: list[list[float]] = [[] for _ in rows]
    for _ in range(reps):
        for r, ts in zip(rows, times, strict=True):
            t0 = time.perf_counter()
            r["step"]()
            ts.append(time.perf_counter() - t0)
    for r, ts in zip(rows, times, strict=True):
        r["time"] = min(ts)


def largest(cap: float, tiles_choices: list[int], tmp: str, start: int, step: int, limit: int
            ) -> tuple[int, int, dict[str, Any]]:
    """Largest side from ``start`` by ``step`` (until the first that does not fit) whose peak fits
    ``cap`` MiB with the smallest fitting T of ``tiles_choices``; then its step time."""
    nan = float("nan")
    best: tuple[int, int, dict[str, Any]] = (0, 0, {"peak": nan, "pred": nan, "time": nan, "pred_time": nan})
    side = start
    while side <= limit:
        fit = None
        for t in tiles_choices:
            r = measure(side, t, tmp, timed=False)
            print(f"  side {side} T={t}: peak {r['peak']:.1f} MiB", file=sys.stderr, flush=True)
            if r["peak"] <= cap:
                fit = (t, r)
                break
        if fit is None:
            break
        best = (side, fit[0], fit[1])
        side += step
    if best[0]:
        best[2]["time"] = measure(best[0], best[1], tmp)["time"]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--quick", action="store_true", help="smaller side and cap (about 5 minutes)")
    ap.add_argument("--side", type=int, default=None)
    ap.add_argument("--cap-mib", type=float, default=None)
    ap.add_argument("--norm", action="store_true", help="a BatchNorm after every conv (statistics passes)")
    ap.add_argument("--tiles", default="1,2,4,8", help="table 1's tiles per GPU (default 1,2,4,8)")
    ap.add_argument("--no-largest", action="store_true", help="skip table 2")
    ap.add_argument("--measured", action="store_true",
                    help="plan from a profile timed on this machine (mode='measure'), not the cpu roofline")
    args = ap.parse_args()
    global NORM, MODE
    NORM = args.norm
    MODE = "measure" if args.measured else "estimate"
    torch.set_num_threads(1)
    side = args.side or (256 if args.quick else 512)
    cap = args.cap_mib or (40.0 if args.quick else 64.0)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"### 1. Peak memory and step time vs tiles per GPU (UNet depth 3 width 8{', BatchNorm' if NORM else ''}, "
              f"{side}x{side}, batch 1, 1 CPU rank, 1 thread; target: peak ±10% of the plan)\n")
        print("| T | sub-tiles | predicted peak MiB | measured peak MiB | measured / plan | peak / T=1 | step s "
              "| step / T=1 | predicted step s | predicted step / T=1 | step cost / plan's |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        tiles = [int(v) for v in args.tiles.split(",")]
        rows = [measure(side, t, tmp, timed=False) for t in tiles]
        interleaved(rows)
        base = rows[0]
        ratios, costs = [], []
        for t, r in zip(tiles, rows, strict=True):
            ratios.append(r["peak"] / r["pred"])
            sub = "x".join(map(str, sub_grid((1, 1), (side, side), t)))
            cost, plan_cost = r["time"] / base["time"], r["pred_time"] / base["pred_time"]
            costs.append(cost / plan_cost)
            print(f"| {t} | {sub} | {r['pred']:.1f} | {r['peak']:.1f} | {r['peak'] / r['pred']:.3f} "
                  f"| {r['peak'] / base['peak']:.2f} | {r['time']:.2f} | {cost:.2f} "
                  f"| {r['pred_time']:.3g} | {plan_cost:.2f} | {cost / plan_cost:.2f} |", flush=True)
        ok = sum(abs(q - 1) <= 0.10 for q in ratios)
        print(f"\nPeak: {ok} of {len(ratios)} rows within ±10%: {'met' if ok == len(ratios) else 'NOT met'}")
        ok = sum(abs(q - 1) <= 0.20 for q in costs)
        print(f"Step cost (step / T=1) against the plan's: {ok} of {len(costs)} rows within ±20%: "
              f"{'met' if ok == len(costs) else 'NOT met'}")
        if args.no_largest:
            return
        print(f"\n### 2. Largest square side that trains under {cap:g} MiB on 1 rank (target: with / without >= 2)\n")
        print("| tiles per GPU | largest side | T used | predicted peak MiB | measured peak MiB | measured / plan "
              "| step s | predicted step s |")
        print("|---|---|---|---|---|---|---|---|")
        limit = 4096
        s1, t1, r1 = largest(cap, [1], tmp, 128, 64, limit)
        print(f"| 1 (without) | {s1} | {t1} | {r1['pred']:.1f} | {r1['peak']:.1f} | {r1['peak'] / r1['pred']:.3f} "
              f"| {r1['time']:.2f} | {r1['pred_time']:.3g} |", flush=True)
        s2, t2, r2 = largest(cap, [16, 64], tmp, 2 * s1, 128 if args.quick else 256, limit)
        print(f"| sequential | {s2} | {t2} | {r2['pred']:.1f} | {r2['peak']:.1f} | {r2['peak'] / r2['pred']:.3f} "
              f"| {r2['time']:.2f} | {r2['pred_time']:.3g} |")
        print(f"\nside with / without: {s2 / max(s1, 1):.2f} (target >= 2: {'met' if s2 >= 2 * s1 else 'NOT met'})")


if __name__ == "__main__":
    with recorded("bench_sequential_tiles_norms" if "--norm" in sys.argv else "bench_sequential_tiles",
                  "--results" in sys.argv, script="bench_sequential_tiles"):
        main()
