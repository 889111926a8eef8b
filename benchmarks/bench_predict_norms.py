"""Norm nets streamed in windows: nowdl's statistics passes against MONAI's sliding_window_inference.

What is measured
----------------
Two MONAI networks whose norms take statistics over the whole image, with seeded weights, on a
generated ``--size``² RGB slide (a pyramidal tiled TIFF read through OpenSlide by both sides, as
in ``bench_predict.py``):

* ``UNet`` (channels 8, 16, 32, strides 2, 2, one residual unit): six InstanceNorms in a chain;
* ``SegResNet`` (8 initial filters, blocks down 1, 2, 2, up 1, 1): GroupNorms (8 groups), fifteen
  in a chain.

Rows, every one in the same job of ``--ranks`` gloo processes (one thread each), taking turns
(each repeat runs every row once):

* ``nowdl, whole image``: one window covers the slide; one spatial stage of R tiles computes the
  whole-image forward, the norms' statistics reduced over the tiles;
* ``nowdl, windows of W²``: the slide streams in windows of ``--window``²; the statistics passes
  ([Note: statistics passes] in nowdl/runtime/predict/passes.py) gather the norms' statistics of
  the whole slide first, one pass per norm in the chain, then the writing pass;
* ``sliding_window_inference``: MONAI's, ``W²`` windows, gaussian blending, overlap 0.25 and 0.5,
  on rank 0 with R threads (the other ranks sleep): every window normalises with its own
  statistics.

On 2 ranks the plans are made on the ``cpu`` spec calibrated first on 2 gloo ranks as
``bench_recompute_planned.py`` does (``--rounds``): the links (``link_bw``, and
``link_latency_s``, one halo exchange round's CPU time) and the spatial runtime's work per tiled
op (``tile_op_s``, [Note: tiled runtime overhead]); a window's forward on tiles pays both per
tiled op, and each statistics pass per window again.

Each time includes reading the slide, the forward(s) and writing the same OME-Zarr (the MONAI
rows with nowdl's writer on one process, as ``bench_predict.py`` does); nowdl's excludes
planning and building the stages (a first, untimed call). Columns: median wall time; the
statistics passes and their wall and CPU time within it (measured on rank 0, CPU time: the
process's, which leaves out waiting for a CPU other processes hold) against the inference plan's
``config.statistics_passes`` (``seconds_per_window`` times the windows), and their ratio (CPU /
plan); peak memory per rank (nowdl: the first call's) against the plan, and their ratio; the
largest absolute difference in the logits to a one-process whole-image forward.

How to run
----------
    .venv/bin/python benchmarks/bench_predict_norms.py [--size 1024] [--window 256] [--ranks 2] [--repeats 3] [--rounds 30]

Tables go to stdout as Markdown, progress to stderr. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_predict import _rank0_alone, sliding_row, write_inputs  # noqa: E402
from bench_recompute_planned import calibrated_spec  # noqa: E402
from helpers.distributed import run_workers  # noqa: E402
from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402

import nowdl  # noqa: E402
from nowdl.runtime.predict.runner import plan_for  # noqa: E402
from nowdl.units import format_bytes  # noqa: E402

NETS = {
    "UNet": ("UNet (8, 16, 32), InstanceNorm", dict(spatial_dims=2, in_channels=3, out_channels=2,
                                                   channels=(8, 16, 32), strides=(2, 2), num_res_units=1)),
    "SegResNet": ("SegResNet (8 filters, blocks 1, 2, 2 / 1, 1), GroupNorm", dict(
        spatial_dims=2, init_filters=8, in_channels=3, out_channels=2, blocks_down=(1, 2, 2), blocks_up=(1, 1))),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_net(name: str) -> torch.nn.Module:
    from monai.networks import nets

    torch.manual_seed(0)
    return getattr(nets, name)(**NETS[name][1]).eval()  # type: ignore[no-any-return]


def plan_spec(ranks: int, rounds: int) -> Any:
    """On 2 ranks: the ``cpu`` spec with this machine's links and the spatial runtime's work per
    tiled op measured now on 2 gloo ranks (``bench_recompute_planned.calibrated_spec``); else ``cpu``."""
    return calibrated_spec(rounds) if ranks == 2 else "cpu"


def worker(rank: int, world: int, name: str, slide: str, d: str, window: int, repeats: int, spec: Any
           ) -> dict[str, Any]:
    """Every row of one net, interleaved: this rank's wall seconds per repeat, rank 0's summaries."""
    torch.set_num_threads(1)
    cm = nowdl.compile(make_net(name), gpus=world, stages=1, spatial_parts=world, micro_batches=1, dp=1,
                       replicas=1, mode="measure", device_spec=spec, progress=False, cache=False, timeout_s=3600)
    source, out = f"openslide:{slide}", Path(d)
    rows: dict[str, dict[str, Any]] = {}
    for label, win in (("whole", None), ("windows", (window, window))):
        first = cm.predict(source, out / f"{name}-{label}.zarr", window=win, overwrite=True)  # plans, builds, measures
        rec = plan_for(cm, torch.empty((1, 3, *(win or _slide_size(slide))), device="meta")).config
        rows[label] = {"line": first.line(), "peaks": first.peak_bytes, "plan": first.predicted_bytes,
                       "windows": first.windows, "passes": first.passes,
                       "plan_passes_s": rec.get("statistics_passes", {}).get("seconds_per_window", 0.0) * first.windows,
                       "run": lambda w=win, lab=label: cm.predict(source, out / f"{name}-{lab}.zarr", window=w,
                                                                   overwrite=True, measure_memory=False)}
    net = make_net(name)
    for overlap in (0.25, 0.5):
        rows[f"swi-{overlap}"] = {"run": sliding_row("2d", slide, out / f"{name}-swi-{overlap}.zarr", window, overlap,
                                                    net), "threads": world}
    times: dict[str, list[float]] = {k: [] for k in rows}
    pass_s: list[float] = []
    pass_cpu: list[float] = []
    for _ in range(repeats):
        for label, row in rows.items():
            torch.set_num_threads(row.get("threads", 1))
            torch.distributed.barrier()
            t0 = time.perf_counter()
            if "threads" in row:  # the others sleep while rank 0 runs MONAI
                _rank0_alone(rank, out / f".done-{name}-{label}-{len(times[label])}", row["run"])
            else:
                summary = row["run"]()
                if label == "windows":
                    pass_s.append(summary.pass_seconds)
                    pass_cpu.append(summary.pass_cpu_seconds)
            torch.distributed.barrier()
            times[label].append(time.perf_counter() - t0)
            torch.set_num_threads(1)
    return {"times": times, "pass_s": pass_s, "pass_cpu": pass_cpu,
            "rows": {k: {n: v for n, v in r.items() if n != "run"} for k, r in rows.items()}}


def _slide_size(slide: str) -> tuple[int, int]:
    import openslide

    w, h = openslide.OpenSlide(slide).level_dimensions[0]
    return h, w


def reference(name: str, pixels: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return make_net(name)(torch.from_numpy(pixels)[None])[0].numpy()  # type: ignore[no-any-return]


def table(name: str, size: int, window: int, ranks: int, repeats: int, res: dict[str, Any],
          diffs: dict[str, float]) -> None:
    rows, wall = res["rows"], {k: statistics.median(v) for k, v in res["times"].items()}
    print(f"\n### MONAI {NETS[name][0]}, {size}², windows of {window}², {ranks} ranks, median of {repeats}\n")
    print("| method | wall | statistics passes: wall, CPU / plan | passes measured (CPU) / planned | "
          "peak memory per rank / plan | peak measured / planned | max abs diff to whole-image forward |")
    print("|---|---:|---|---:|---|---:|---:|")
    for k, row in rows.items():
        if k.startswith("swi-"):
            label, passes, mem = (f"sliding_window_inference {window}², overlap {k[4:]}, gaussian: rank 0, "
                                  f"{ranks} thread(s)", "none (statistics of each window)", "")
            ratio = peak_ratio = ""
        else:
            how = row["line"].split(" window(s), ")[1].split("; peak")[0]
            label = f"nowdl predict, {'whole image' if k == 'whole' else f'windows of {window}²'}, " \
                    f"{row['windows']} window(s): {how.split(';')[0].rstrip(')')})"
            cpu = statistics.median(res["pass_cpu"]) if row["passes"] else 0.0
            passes = (f"{row['passes']}: {statistics.median(res['pass_s']):.2f} s, {cpu:.2f} s / {row['plan_passes_s']:.2f} s"
                      if row["passes"] else "none")
            ratio = f"{cpu / row['plan_passes_s']:.2f}" if row["passes"] and row["plan_passes_s"] > 0 else ""
            peak_ratio = ", ".join(f"{p / q:.2f}" for p, q in zip(row["peaks"], row["plan"], strict=True) if p and q)
            mem = ", ".join(f"{format_bytes(p)} / plan {format_bytes(q)}" for p, q in zip(row["peaks"], row["plan"],
                                                                                         strict=True) if p and q)
        print(f"| {label} | {wall[k]:.2f} s | {passes} | {ratio} | {mem} | {peak_ratio} | {diffs[k]:.2e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--size", type=int, default=1024, help="slide side (default 1024)")
    ap.add_argument("--window", type=int, default=256, help="window side, both methods (default 256)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks = CPU cores used by every row (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row, interleaved (default 3)")
    ap.add_argument("--rounds", type=int, default=30, help="rounds of each calibration probe (default 30)")
    ap.add_argument("--nets", default=",".join(NETS), help=f"which nets (default {','.join(NETS)})")
    args = ap.parse_args()
    import zarr

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="nowdl-bench-norms-") as tmp:
        d = Path(tmp)
        pixels = write_inputs(d, args.size, 8)["2d"]
        spec = plan_spec(args.ranks, args.rounds)
        for name in args.nets.split(","):
            log(f"{name}: {args.ranks} ranks, {args.repeats} repeats")
            res = run_workers(worker, args.ranks, name, str(d / "slide.tif"), str(d), args.window, args.repeats,
                              spec, timeout_s=7200, env={"OMP_NUM_THREADS": "1"})[0]
            ref = reference(name, pixels)
            diffs = {k: float(np.abs(np.asarray(zarr.open_array(str(d / f"{name}-{k}.zarr" / "0"))[:]) - ref).max())
                     for k in res["rows"]}
            for k in ("whole", "windows"):
                log(res["rows"][k]["line"])
            table(name, args.size, args.window, args.ranks, args.repeats, res, diffs)


if __name__ == "__main__":
    with recorded("bench_predict_norms", "--results" in sys.argv):
        main()
