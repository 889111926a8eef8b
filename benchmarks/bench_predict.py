"""Predict benchmark: nowdl predict against MONAI's sliding_window_inference, on the same model, image and cores.

What is measured
----------------
Two cases, each a MONAI UNet (instance norm, MONAI's default) with seeded weights:

* 2D pathology: a generated ``--size``² RGB slide, written as a pyramidal tiled TIFF (two
  levels, 256² tiles) and read through OpenSlide (``openslide:``); UNet channels (8, 16, 32),
  strides (2, 2), one residual unit, 2 classes.
* 3D radiology: a generated ``--depth``³ single-channel volume in a NIfTI file (``nifti:``);
  the same UNet in 3D.

Rows, per case:

* ``nowdl predict, R ranks``: R = ``--ranks`` gloo processes, one thread each, one spatial stage
  of R tiles (``gpus=R, stages=1, spatial_parts=R``); the window is the whole image (it fits),
  so every pixel is exact, InstanceNorm included. Timed: ``cm.predict`` after a first call that
  plans, traces, builds the stages and measures the memory; it reads the slide or volume and
  writes OME-Zarr with its pyramid.
* ``nowdl predict, 1 rank``: the same on one process (``gpus=1``).
* ``nowdl predict, R ranks, windows``: R ranks with windows of half the image side (at least
  48), so the image streams in windows; InstanceNorm's statistics are then taken over each
  window (the summary line says so), hence a difference.
* ``sliding_window_inference``: MONAI's, with ``--roi`` windows (3D: a quarter of it),
  ``mode="gaussian"``, overlap 0.25 and 0.5, in one process (MONAI has no multi-process form)
  with 1 thread and with R threads, timed from reading the image to writing the output with
  ``zarr.save_array``.

Columns: wall time (the fastest of ``--repeats`` runs: the machine is shared), the time over the
sliding window's at overlap 0.25 on one core, peak memory per rank (weights plus the peak of live
tensor storages, ``nowdl.runtime.training.metrics.peak_of``, the same meter for every row, run
untimed: it slows a run many times over), and the largest absolute difference in the logits to a
one-process whole-image forward.

How to run
----------
    .venv/bin/python benchmarks/bench_predict.py [--size 512] [--depth 64] [--ranks 2] [--roi 128] [--repeats 3]

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


def nowdl_worker(rank: int, world: int, case: str, source: str, out: str, window: int | None, repeats: int
                 ) -> dict[str, Any]:
    torch.set_num_threads(1)
    dims, in_ch = (2, 3) if case == "2d" else (3, 1)
    cm = nowdl.compile(make_net(dims, in_ch), gpus=world, stages=1, spatial_parts=world, micro_batches=1, dp=1,
                       replicas=1, mode="estimate", optimizer="sgd", progress=False, cache=False, timeout_s=1800)
    win = None if window is None else (window,) * dims
    first = cm.predict(source, out + ".warm.zarr", window=win)  # plans, traces, builds the stages; measures memory
    times = []
    for _ in range(repeats):
        if world > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        cm.predict(source, out, window=win, overwrite=True, measure_memory=False)
        if world > 1:
            torch.distributed.barrier()
        times.append(time.perf_counter() - t0)
    return {"s": min(times), "line": first.line(), "peaks": first.peak_bytes}


def sliding(case: str, source: Path, out: Path, roi: int, overlap: float, threads: int, repeats: int
            ) -> dict[str, Any]:
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

    _, peak = peak_of(run, [net], None)  # warm-up, and the memory (the meter slows a run many times over)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return {"s": min(times), "peak": peak}


def whole(case: str, x: np.ndarray) -> np.ndarray:
    net = make_net(2 if case == "2d" else 3, x.shape[0])
    with torch.no_grad():
        return net(torch.from_numpy(x)[None])[0].numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=512, help="2D slide side (default 512)")
    ap.add_argument("--depth", type=int, default=64, help="3D volume side (default 64)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks = CPU cores used by every row (default 2)")
    ap.add_argument("--roi", type=int, default=128, help="sliding window side in 2D; 3D uses a quarter (default 128)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row; the fastest is shown (default 3)")
    args = ap.parse_args()
    import zarr

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="nowdl-bench-predict-") as tmp:
        d = Path(tmp)
        pixels = write_inputs(d, args.size, args.depth)
        for case, source, size, roi in (("2d", f"openslide:{d / 'slide.tif'}", args.size, args.roi),
                                        ("3d", f"nifti:{d / 'vol.nii.gz'}", args.depth, args.roi // 4)):
            ref = whole(case, pixels[case])
            rows: list[tuple[str, float, list[Any], float]] = []
            windowed = max(size // 2, 48) // 8 * 8  # a window must hold the receptive field (margin 20) twice
            for label, ranks, window in ((f"nowdl predict, {args.ranks} ranks", args.ranks, None),
                                         ("nowdl predict, 1 rank", 1, None),
                                         (f"nowdl predict, {args.ranks} ranks, windows of {windowed}", args.ranks,
                                          windowed)):
                if window is not None and window >= size:
                    continue
                log(f"{case}: {label}")
                out = str(d / f"{case}-{ranks}-{window}.zarr")
                res = run_workers(nowdl_worker, ranks, case, source, out, window, args.repeats, timeout_s=3000,
                                  env={"OMP_NUM_THREADS": "1"})
                got = np.asarray(zarr.open_array(out + "/0")[:])
                note = res[0]["line"].split(", ")[3].split(";")[0]
                rows.append((f"{label}: {note}", res[0]["s"], res[0]["peaks"], float(np.abs(got - ref).max())))
                log(res[0]["line"])
            for overlap in (0.25, 0.5):
                for threads in sorted({1, args.ranks}):
                    log(f"{case}: sliding window {overlap}, {threads} thread(s)")
                    out_p = d / f"{case}-swi-{overlap}-{threads}.zarr"
                    res_s = sliding(case, Path(source.partition(":")[2]), out_p, roi, overlap, threads, args.repeats)
                    got = np.asarray(zarr.open_array(str(out_p))[:])
                    rows.append((f"sliding_window_inference {roi}{'²' if case == '2d' else '³'}, overlap {overlap}, "
                                 f"gaussian: 1 process, {threads} thread(s)", res_s["s"], [res_s["peak"]],
                                 float(np.abs(got - ref).max())))
            base = next(r[1] for r in rows if "overlap 0.25" in r[0] and "1 thread(s)" in r[0])
            shape = f"{size}²" if case == "2d" else f"{size}³"
            print(f"\n### {'2D pathology slide' if case == '2d' else '3D volume'}: MONAI UNet (8, 16, 32), {shape}\n")
            print("| method | wall time (best of " + str(args.repeats) + ") | / sliding window 0.25 on 1 core | "
                  "peak memory per rank | max abs diff to whole-image forward |")
            print("|---|---:|---:|---|---:|")
            for label, secs, peaks, diff in rows:
                mem = ", ".join(format_bytes(p) if p is not None else "?" for p in peaks)
                print(f"| {label} | {secs:.2f} s | {secs / base:.2f}x | {mem} | {diff:.2e} |")


if __name__ == "__main__":
    main()
