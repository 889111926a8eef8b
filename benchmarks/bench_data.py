"""Data benchmark: 4 gloo ranks train a 4-tile spatial UNet on a large tiled TIFF, each reading only its tile.

What is measured
----------------
A synthetic ``--size``² single-channel uint8 TIFF, tiled ``--tile``² (512² by default), and a
mask of the same layout are written to a temporary folder. Four CPU processes (gloo,
``tests/helpers/distributed.py``'s ``run_workers``, one thread each) train nowdl's UNet
(``unet(in_channels=1, out_channels=2, depth=2, base_width=--width)``) planned with one
spatial stage of P = 4 square tiles (``gpus=4, stages=1, spatial_parts=4``) on ``--crop``²
crops (the whole image by default), ``--batch`` crops per step, through
``nowdl.data.crops(...).lazy_batch``: each rank's engine reads its own tile of every crop from
the TIFF (the halo arrives from the neighbours), and the ranks that compute the loss read the
mask crop. The reads go through ``nowdl.runtime.data.prefetch.TileReadAhead``, as in ``nowdl run``:
the first step learns each rank's windows, and from then on the next step's windows are read
on a background thread while a step runs.

Table 1, per rank: image pixels read, as a share of the pixels of the crops of the run (and of
the image), and mask pixels read. Target: <= 1/4 of the image plus halo (no halo is read:
the halos are exchanged). Table 2, per step: the slowest rank's step time and, per rank, the
seconds spent reading during the step (on the read-ahead thread: this step's windows not read
ahead yet, and the next step's) and the seconds the step waited for reads (the data wait). The
first step also traces and builds the stages.

How to run
----------
    .venv/bin/python benchmarks/bench_data.py [--size 8192] [--crop 8192] [--steps 3]

Tables go to stdout as Markdown, progress to stderr. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.distributed import run_workers  # noqa: E402

import nowdl  # noqa: E402
from nowdl.runtime.data.feed import label_loss  # noqa: E402
from nowdl.runtime.data.loader import StepSampler  # noqa: E402
from nowdl.runtime.data.prefetch import TileReadAhead  # noqa: E402

P = 4

from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_image(d: Path, size: int, tile: int) -> tuple[Path, Path]:
    """A smooth random image (blocks + noise) and its thresholded mask, as tiled TIFFs."""
    import tifffile

    rng = np.random.default_rng(0)
    coarse = rng.integers(0, 255, (size // 64, size // 64), dtype=np.uint8)
    img = np.repeat(np.repeat(coarse, 64, 0), 64, 1)
    img = (img // 2 + rng.integers(0, 128, (size, size), dtype=np.uint8)).astype(np.uint8)
    mask = (img > 127).astype(np.uint8)
    paths = d / "image.tif", d / "mask.tif"
    for path, arr in zip(paths, (img, mask), strict=True):
        tifffile.imwrite(path, arr, tile=(tile, tile), compression=None)
    return paths


def worker(rank: int, world: int, image: str, mask: str, crop: int, batch: int, steps: int,
           width: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nowdl.models.unet(in_channels=1, out_channels=2, depth=2, base_width=width)
    cm = nowdl.compile(model, gpus=world, stages=1, micro_batches=batch, dp=1, replicas=1, spatial_parts=P,
                       spatial_stages=1, slice="square", mode="estimate", progress=False, cache=False,
                       loss_fn=label_loss(torch.nn.CrossEntropyLoss()), timeout_s=1800,
                       optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    ds = nowdl.data.crops(f"tiff:{image}", (1, crop, crop), labels=f"tiff:{mask}", seed=0)
    ahead = TileReadAhead(ds, StepSampler(len(ds), batch, seed=0), stop=steps)  # as `nowdl run` reads
    rows = []
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = ahead.batch(step)
        made = time.perf_counter() - t0
        read0, blocked0 = ds.counter.seconds, ahead.blocked
        loss = cm.train_step(x, y)
        torch.distributed.barrier()
        rows.append({"step_s": time.perf_counter() - t0, "wait_s": made + ahead.blocked - blocked0,
                     "read_s": ds.counter.seconds - read0, "loss": loss})
        if rank == 0:
            log(f"step {step + 1}/{steps}: loss {loss:.4f}, {rows[-1]['step_s']:.1f} s")
    ahead.close()
    plan = cm._trainer.plan
    return {"rows": rows, "pixels": dict(ds.counter.pixels), "bytes": dict(ds.counter.bytes),
            "tiles": plan.stages[0].tiles() if plan is not None else "?"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--size", type=int, default=8192, help="image side (default 8192)")
    ap.add_argument("--crop", type=int, default=8192, help="crop side = the model's input (default: the image)")
    ap.add_argument("--tile", type=int, default=512, help="TIFF tile side (default 512)")
    ap.add_argument("--batch", type=int, default=1, help="crops per step (default 1)")
    ap.add_argument("--steps", type=int, default=3, help="steps (default 3)")
    ap.add_argument("--width", type=int, default=4, help="UNet base width (default 4)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="nowdl-bench-data-") as tmp:
        t0 = time.perf_counter()
        image, mask = write_image(Path(tmp), args.size, args.tile)
        log(f"wrote {image} ({os.path.getsize(image) / 2**20:.0f} MiB) and its mask in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        res = run_workers(worker, P, str(image), str(mask), args.crop, args.batch, args.steps, args.width,
                          init_group=False, timeout_s=3000, env={"OMP_NUM_THREADS": "1"})
        wall = time.perf_counter() - t0
    img_px = args.size ** 2
    crops_px = args.steps * args.batch * args.crop ** 2
    print(f"## Data path: {P} gloo ranks, {res[0]['tiles']}, {args.size}x{args.size} uint8 TIFF ({args.tile}² tiles), "
          f"{args.crop}² crops x {args.batch} per step, {args.steps} steps, unet depth 2 width {args.width} "
          f"({wall:.0f} s)\n")
    print("| rank | image pixels read | share of the run's crops | share of the image (per crop) | mask pixels read |")
    print("|---:|---:|---:|---:|---:|")
    for r, out in enumerate(res):
        px = out["pixels"].get(str(image), 0)
        mk = out["pixels"].get(str(mask), 0)
        per_crop = px / (args.steps * args.batch)
        print(f"| {r} | {px:,} | {px / crops_px:.4f} | {per_crop / img_px:.4f} | {mk:,} |")
    print("\n| step | step time (slowest rank) | reading per rank (s) | data wait per rank (s) | wait / step |")
    print("|---:|---:|---|---|---:|")
    for s in range(args.steps):
        step_s = max(out["rows"][s]["step_s"] for out in res)
        reads = [out["rows"][s]["read_s"] for out in res]
        waits = [out["rows"][s]["wait_s"] for out in res]
        print(f"| {s + 1} | {step_s:.2f} s | {', '.join(f'{w:.3f}' for w in reads)} | "
              f"{', '.join(f'{w:.3f}' for w in waits)} | {max(waits) / step_s:.1%} |")


if __name__ == "__main__":
    with recorded("bench_data", "--results" in sys.argv):
        main()
