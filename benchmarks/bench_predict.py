"""Predict benchmark: nowdl predict against MONAI's sliding_window_inference, on the same model, image and cores.

What is measured
----------------
Two cases, each a MONAI UNet (instance norm, MONAI's default) with seeded weights:

* 2D pathology: a generated ``--size``² RGB slide, written as a pyramidal tiled TIFF (two
  levels, 256² tiles) and read through OpenSlide (``openslide:``); UNet channels (8, 16, 32),
  strides (2, 2), one residual unit, 2 classes.
* 3D radiology: a generated ``--depth``³ single-channel volume in a NIfTI file (``nifti:``);
  the same UNet in 3D.

Rows, per case, on R = ``--ranks`` CPU cores:

* ``nowdl predict``: R gloo processes, one thread each, one spatial stage of R tiles
  (``gpus=R, stages=1, spatial_parts=R``); the window is the whole image (it fits), so every
  pixel is exact, InstanceNorm included. Timed: the second ``cm.predict`` call (the first plans
  and traces), reading the slide or volume and writing OME-Zarr (with its pyramid).
* ``nowdl predict, windows``: the same with windows of half the image side (at least 48), so
  the image streams in windows; InstanceNorm's statistics are then taken over each window (the
  summary line says so), hence a difference.
* ``sliding window 0.25 / 0.5``: ``monai.inferers.sliding_window_inference`` with ``--roi``
  windows, ``mode="gaussian"``, in one process with R threads (MONAI has no multi-process
  form; R threads use the same cores), timed from reading the image to writing the output
  with ``zarr.save_array``.

Columns: wall time, the sliding window's time over nowdl's (target for nowdl: <= 0.7x the
0.25-overlap window's), peak memory per rank (weights plus the peak of live tensor storages
during the prediction: ``nowdl.runtime.training.metrics.peak_of``, the same meter for both;
nowdl's on the first window), and the largest absolute difference in the logits to a
one-process whole-image forward.

How to run
----------
    .venv/bin/python benchmarks/bench_predict.py [--size 512] [--depth 64] [--ranks 2] [--roi 128]

Tables go to stdout as Markdown, progress to stderr. Nothing is asserted.
"""

from __future__ import annotations

import argparse
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
from nowdl.runtime.training.metrics import peak_of  # noqa: E402
from nowdl.units import format_bytes  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_net(dims: int, in_ch: int) -> torch.nn.Module:
    from monai.networks.nets import UNet

    torch.manual_seed(0)
    return UNet(spatial_dims=dims, in_channels=in_ch, out_channels=2, channels=(8, 16, 32), strides=(2, 2),
                num_res_units=1).eval()


def write_inputs(d: Path, size: int, depth: int) -> dict[str, Any]:
    """A pyramidal slide and a NIfTI volume of smooth blobs plus noise; returns their pixels as the model sees them."""
    import nibabel
    import tifffile

    rng = np.random.default_rng(0)
    coarse = rng.integers(0, 255, (size // 32, size // 32, 3), dtype=np.uint8)
    img = np.repeat(np.repeat(coarse, 32, 0), 32, 1) // 2 + rng.integers(0, 128, (size, size, 3), dtype=np.uint8)
    with tifffile.TiffWriter(d / "slide.tif") as w:
        w.write(img, tile=(256, 256), photometric="rgb", compression="zlib")
        w.write(img[::2, ::2], tile=(256, 256), photometric="rgb", compression="zlib", subfiletype=1)
    vol = rng.random((depth, depth, depth)).astype(np.float32)
    nibabel.save(nibabel.Nifti1Image(vol, np.diag([0.8, 0.8, 1.5, 1.0])), str(d / "vol.nii.gz"))
    return {"2d": img.transpose(2, 0, 1).astype(np.float32) / 255, "3d": vol[None]}


def nowdl_worker(rank: int, world: int, case: str, source: str, out: str, window: int | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    dims, in_ch = (2, 3) if case == "2d" else (3, 1)
    cm = nowdl.compile(make_net(dims, in_ch), gpus=world, stages=1, spatial_parts=world, micro_batches=1, dp=1,
                       replicas=1, mode="estimate", optimizer="sgd", progress=False, cache=False, timeout_s=1800)
    win = None if window is None else (window,) * dims
    cm.predict(source, out + ".warm.zarr", window=win)  # plans, traces, builds the stages
    torch.distributed.barrier()
    t0 = time.perf_counter()
    summary = cm.predict(source, out, window=win)
    torch.distributed.barrier()
    return {"s": time.perf_counter() - t0, "line": summary.line(), "peaks": summary.peak_bytes}


def sliding(case: str, source: Path, out: Path, roi: int, overlap: float, threads: int) -> dict[str, Any]:
    import zarr
    from monai.inferers import sliding_window_inference

    torch.set_num_threads(threads)
    dims, in_ch = (2, 3) if case == "2d" else (3, 1)
    net = make_net(dims, in_ch)

    def run() -> None:
        if case == "2d":
            import tifffile

            x = tifffile.imread(source).transpose(2, 0, 1).astype(np.float32) / 255
        else:
            import nibabel

            x = np.asarray(nibabel.load(str(source)).dataobj, dtype=np.float32)[None]
        with torch.no_grad():
            y = sliding_window_inference(torch.from_numpy(x)[None], (roi,) * dims, 1, net, overlap=overlap,
                                         mode="gaussian")
        zarr.save_array(str(out), y[0].numpy(), overwrite=True)

    run()  # warm-up
    t0 = time.perf_counter()
    _, peak = peak_of(run, [net], None)
    return {"s": time.perf_counter() - t0, "peak": peak}


def whole(case: str, x: np.ndarray) -> np.ndarray:
    net = make_net(2 if case == "2d" else 3, x.shape[0])
    with torch.no_grad():
        return net(torch.from_numpy(x)[None])[0].numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=512, help="2D slide side (default 512)")
    ap.add_argument("--depth", type=int, default=64, help="3D volume side (default 64)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks = CPU cores used by every row (default 2)")
    ap.add_argument("--roi", type=int, default=128, help="sliding window side in 2D; 3D uses half (default 128)")
    args = ap.parse_args()
    import zarr

    with tempfile.TemporaryDirectory(prefix="nowdl-bench-predict-") as tmp:
        d = Path(tmp)
        pixels = write_inputs(d, args.size, args.depth)
        for case, source, size, roi in (("2d", f"openslide:{d / 'slide.tif'}", args.size, args.roi),
                                        ("3d", f"nifti:{d / 'vol.nii.gz'}", args.depth, args.roi // 2)):
            ref = whole(case, pixels[case])
            rows: list[tuple[str, float, list[Any], float, str]] = []
            windowed = max(size // 2, 48) // 8 * 8  # a window must hold the receptive field (margin 20) twice
            for label, window in (("nowdl predict", None), ("nowdl predict, windows", windowed)):
                if window is not None and window >= size:
                    continue
                log(f"{case}: {label} on {args.ranks} ranks")
                out = str(d / f"{case}-{window}.zarr")
                res = run_workers(nowdl_worker, args.ranks, case, source, out, window, timeout_s=3000,
                                  env={"OMP_NUM_THREADS": "1"})
                got = np.asarray(zarr.open_array(out + "/0")[:])
                note = res[0]["line"].split(", ")[3].split(";")[0]
                rows.append((f"{label} ({note})", res[0]["s"], res[0]["peaks"], float(np.abs(got - ref).max()), ""))
                log(res[0]["line"])
            for overlap in (0.25, 0.5):
                log(f"{case}: sliding window {overlap} with {args.ranks} threads")
                out_p = d / f"{case}-swi-{overlap}.zarr"
                res_s = sliding(case, Path(source.partition(":")[2]), out_p, roi, overlap, args.ranks)
                got = np.asarray(zarr.open_array(str(out_p))[:])
                rows.append((f"sliding_window_inference {roi}^{2 if case == '2d' else 3}, overlap {overlap}, gaussian",
                             res_s["s"], [res_s["peak"]], float(np.abs(got - ref).max()), f"1 process, {args.ranks} threads"))
            base = next(r[1] for r in rows if "overlap 0.25" in r[0])
            shape = f"{size}²" if case == "2d" else f"{size}³"
            print(f"\n### {'2D pathology' if case == '2d' else '3D volume'}: MONAI UNet (8, 16, 32), {shape}, "
                  f"{args.ranks} CPU cores\n")
            print("| method | wall time | / sliding window 0.25 | peak memory per rank | max abs diff to whole-image forward |")
            print("|---|---:|---:|---|---:|")
            for label, secs, peaks, diff, how in rows:
                mem = ", ".join(format_bytes(p) if p is not None else "?" for p in peaks)
                print(f"| {label}{' (' + how + ')' if how else ''} | {secs:.2f} s | {secs / base:.2f}x | {mem} | "
                      f"{diff:.2e} |")


if __name__ == "__main__":
    main()
