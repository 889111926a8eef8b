"""Predict benchmark: nowdl predict against MONAI's sliding_window_inference, on the same model, image, cores and output.

What is measured
----------------
Two cases, each a MONAI UNet (instance norm, MONAI's default) with seeded weights:

* 2D pathology: a generated ``--size``² RGB slide (default 2048²), written as a pyramidal tiled
  TIFF (two levels, 256² tiles) and read through OpenSlide by both sides; UNet channels
  (8, 16, 32), strides (2, 2), one residual unit, 2 classes. Sliding windows of ``--roi``²
  (default 256², MONAI's usual pathology patch), which at overlap 0.25 compute 1.89x the pixels
  of a 2048² slide (11 x 11 windows of 256²).
* 3D radiology: a generated ``--depth``³ single-channel volume in a NIfTI file read with
  nibabel by both sides; the same UNet in 3D; windows of ``--roi3d``³.

Every row runs inside one job of ``--ranks`` gloo processes (one thread each), and the rows take
turns: each repeat runs every row once, in order, so the machine's load falls on all rows alike.
While rank 0 runs a MONAI row the other ranks wait in a barrier.

* ``nowdl predict``: one spatial stage of R tiles (``gpus=R, stages=1, spatial_parts=R``); the
  window is the whole image (it fits), so every pixel is exact, InstanceNorm included.
* ``nowdl predict, windows``: the same with windows of half the image side: the image streams
  in windows, and InstanceNorm's statistics are then taken over each window (the summary line
  says so), hence a difference.
* ``plain net(x)``: the limit, one whole-image forward of the same net on rank 0 with R threads,
  on the same read and write path (what nowdl's whole-image row computes, in one process).
* ``sliding_window_inference``: the peer, MONAI's, ``mode="gaussian"``, overlap 0.25 and 0.5, on
  rank 0 with R threads (the same cores) and with 1 thread (MONAI has no multi-process form).
* Start-up (``benchmarks/predict_startup.py``): a ``--startup-size``² slide (default 1024²)
  predicted by a fresh command each time, launch included: ``torchrun ... -m nowdl predict`` and
  ``nowdl predict --nproc R`` (ranks forked after one import), each with an empty cache and with
  the cache of a first run, against a ``python`` process running the sliding window or the
  plain ``net(x)``.

What each time includes, on both sides alike: reading the image (OpenSlide ``read_region`` of
level 0, or nibabel), the forward, and writing the same OME-Zarr: float32 logits at level 0 in
chunks of 256² (64³) plus the 2x pyramid down to 256 pixels (the MONAI rows write it with
nowdl's own writer, ``nowdl.runtime.predict.writers``, on one process). nowdl's time also
includes gathering the tiles' output, the ranks' agreement on every write and the final
rename; it excludes planning, tracing and building the stages (the first, untimed call).

Columns: wall time (median of ``--repeats`` and their range), CPU seconds of all ranks over the same interval
(``time.process_time``, median; the sleeping ranks of a MONAI row add next to nothing), the wall
time over the plain ``net(x)`` row (the limit) and over the faster of the two sliding window rows
at overlap 0.25 (the peer: R threads or 1; on a loaded
machine torch's R threads can be many times slower than one); peak memory per rank against the inference plan's prediction
(nowdl: the first call's measurement, weights plus the peak of live tensor storages; MONAI: the
same meter, ``peak_of``, in an untimed run; it has no plan); and the largest absolute difference
in the logits to a one-process whole-image forward.

How to run
----------
    .venv/bin/python benchmarks/bench_predict.py [--size 2048] [--roi 256] [--depth 128] [--roi3d 64] [--ranks 2] [--repeats 3]
    .venv/bin/python benchmarks/bench_predict.py --profile   # where nowdl's 2D time goes: cProfile of rank 0

Tables go to stdout as Markdown, progress to stderr. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.distributed import run_workers  # noqa: E402
from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402

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


def read_input(case: str, path: str) -> np.ndarray:
    """The image as the model sees it, read as nowdl's readers read it (OpenSlide level 0, or nibabel)."""
    if case == "2d":
        import openslide

        slide = openslide.OpenSlide(path)
        rgb = np.asarray(slide.read_region((0, 0), 0, slide.level_dimensions[0]))[:, :, :3]
        return rgb.transpose(2, 0, 1).astype(np.float32) / 255
    import nibabel

    return np.asarray(nibabel.load(path).dataobj, dtype=np.float32)[None]


def write_ome_zarr(out: Path, y: np.ndarray) -> None:
    """The OME-Zarr nowdl predict writes (level 0 and the 2x pyramid), on one process."""
    from nowdl.runtime.predict.writers import (
        LevelStore,
        build_level,
        discard,
        ngff_attributes,
        pyramid_shapes,
    )

    discard(out)
    levels = pyramid_shapes(y.shape[1:])
    for k, sp in enumerate(levels):
        LevelStore.create(out, k, (y.shape[0], *sp), np.float32,
                          ngff_attributes(out.name, len(levels), y.ndim - 1) if k == 0 else None)
    LevelStore(out, 0).write([(0, s) for s in y.shape[1:]], y)
    for k in range(1, len(levels)):
        build_level(out, k, False, 0, 1)


def sliding_row(case: str, path: str, out: Path, roi: int, overlap: float, net: torch.nn.Module
                ) -> Callable[[], None]:
    from monai.inferers import sliding_window_inference

    dims = 2 if case == "2d" else 3

    def run() -> None:
        x = torch.from_numpy(read_input(case, path))[None]
        with torch.no_grad():
            y = sliding_window_inference(x, (roi,) * dims, 1, net, overlap=overlap, mode="gaussian")
        write_ome_zarr(out, y[0].numpy())

    return run


def plain_row(case: str, path: str, out: Path, net: torch.nn.Module) -> Callable[[], None]:
    """The limit: one whole-image ``net(x)`` on the same read and write path as the other rows."""

    def run() -> None:
        x = torch.from_numpy(read_input(case, path))[None]
        with torch.no_grad():
            y = net(x)
        write_ome_zarr(out, y[0].numpy())

    return run


def _rank0_alone(rank: int, flag: Path, run: Callable[[], None]) -> None:
    """Rank 0 runs ``run`` while the other ranks sleep until it says it is done."""
    if rank == 0:
        run()
        flag.touch()
        return
    while not flag.exists():
        time.sleep(0.005)


def worker(rank: int, world: int, case: str, path: str, d: str, roi: int, window: int, repeats: int
           ) -> dict[str, Any]:
    """Every row, interleaved; returns per row this rank's wall and CPU seconds per repeat (and rank 0's extras)."""
    torch.set_num_threads(1)
    dims, in_ch = (2, 3) if case == "2d" else (3, 1)
    source = f"{'openslide' if case == '2d' else 'nifti'}:{path}"
    cm = nowdl.compile(make_net(dims, in_ch), gpus=world, stages=1, spatial_parts=world, micro_batches=1, dp=1,
                       replicas=1, mode="estimate", optimizer="sgd", progress=False, cache=False, timeout_s=1800)
    out = Path(d)
    rows: dict[str, dict[str, Any]] = {}
    for label, win in (("nowdl", None), ("nowdl-windows", (window,) * dims)):
        first = cm.predict(source, out / f"{case}-{label}.zarr", window=win, overwrite=True)  # plans, builds, measures
        rows[label] = {"line": first.line(), "peaks": first.peak_bytes, "plan": first.predicted_bytes,
                       "run": lambda w=win, lab=label: cm.predict(source, out / f"{case}-{lab}.zarr", window=w,
                                                                   overwrite=True, measure_memory=False)}
    net = make_net(dims, in_ch)
    peak: int | None = None
    run = plain_row(case, path, out / f"{case}-plain.zarr", net)
    if rank == 0:
        _, peak = peak_of(run, [net], None)
    rows["plain"] = {"threads": world, "peaks": [peak if rank == 0 else None], "run": run}
    for overlap in (0.25, 0.5):
        for threads in sorted({world, 1}, reverse=True):
            label = f"swi-{overlap}-{threads}"
            run = sliding_row(case, path, out / f"{case}-{label}.zarr", roi, overlap, net)
            if rank == 0 and threads == world:
                _, peak = peak_of(run, [net], None)  # untimed: the meter slows a run many times over
            rows[label] = {"threads": threads, "peaks": [peak if rank == 0 else None], "run": run}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in rows}
    for _ in range(repeats):
        for label, row in rows.items():
            threads = row.get("threads")
            if threads is not None:
                torch.set_num_threads(threads)
            torch.distributed.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if threads is None:
                row["run"]()
            else:  # the others sleep (a gloo barrier may spin on a core MONAI's threads need)
                _rank0_alone(rank, Path(d) / f".done-{case}-{label}-{len(times[label])}", row["run"])
            torch.distributed.barrier()
            times[label].append((time.perf_counter() - t0, time.process_time() - c0))
            torch.set_num_threads(1)
    return {"times": times, "rows": {k: {n: v for n, v in r.items() if n != "run"} for k, r in rows.items()}}


#: (part, file, function) whose cumulative time ``--profile`` reports, per call of cm.predict on rank 0.
PARTS = (("read the rank's tile", "tiles.py", "read"), ("network reach", "windows.py", "network_reach"),
         ("forward (stage, halo exchange)", "runner.py", "_run_stage"),
         ("gather the output to the writers", "runner.py", "_send_output"),
         ("write level 0 (main thread)", "runner.py", "_write_share"),
         ("wait for background writes", "agreement.py", "wait"), ("pyramid levels", "writers.py", "build_level"))


def profile_worker(rank: int, world: int, path: str, d: str, repeats: int) -> list[tuple[float, float, dict[str, float]]]:
    """cProfile of cm.predict (2D, whole image) after a warm call: wall, CPU and each part of PARTS, per repeat."""
    import cProfile
    import pstats

    torch.set_num_threads(1)
    cm = nowdl.compile(make_net(2, 3), gpus=world, stages=1, spatial_parts=world, micro_batches=1, dp=1, replicas=1,
                       mode="estimate", optimizer="sgd", progress=False, cache=False, timeout_s=1800)
    source, out = f"openslide:{path}", Path(d) / "profile.zarr"
    cm.predict(source, out)
    rows = []
    for _ in range(repeats):
        torch.distributed.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        prof = cProfile.Profile()
        prof.enable()
        cm.predict(source, out, overwrite=True, measure_memory=False)
        prof.disable()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        st = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        rows.append((wall, cpu, {label: max((v[3] for (f, _, fn), v in st.items() if f.endswith(file) and fn == func),
                                            default=0.0) for label, file, func in PARTS}))
    return rows


def whole(case: str, x: np.ndarray) -> np.ndarray:
    net = make_net(2 if case == "2d" else 3, x.shape[0])
    with torch.no_grad():
        return net(torch.from_numpy(x)[None])[0].numpy()


def table(case: str, size: int, roi: int, window: int, ranks: int, repeats: int, res: list[dict[str, Any]],
          diffs: dict[str, float]) -> None:
    rows0 = res[0]["rows"]
    walls = {k: [t[0] for t in v] for k, v in res[0]["times"].items()}
    wall = {k: statistics.median(v) for k, v in walls.items()}
    cpu = {k: statistics.median(sum(r["times"][k][i][1] for r in res) for i in range(repeats)) for k in wall}
    sq = "²" if case == "2d" else "³"
    labels = {"nowdl": f"nowdl predict, {ranks} ranks, whole image: " + _how(rows0["nowdl"]["line"]),
              "nowdl-windows": f"nowdl predict, {ranks} ranks, windows of {window}{sq}: "
                               + _how(rows0["nowdl-windows"]["line"]),
              "plain": f"plain net(x), whole image: rank 0, {ranks} thread(s) (the limit)"}
    for k in rows0:
        if k.startswith("swi-"):
            _, ov, th = k.split("-")
            labels[k] = f"sliding_window_inference {roi}{sq}, overlap {ov}, gaussian: rank 0, {th} thread(s)"
    best = min(wall[f"swi-0.25-{ranks}"], wall["swi-0.25-1"])  # MONAI's faster form on these cores: the peer
    name = "2D pathology slide" if case == "2d" else "3D volume"
    print(f"\n### {name}: MONAI UNet (8, 16, 32), {size}{sq}, {ranks} ranks, median of {repeats}\n")
    print("| method | wall, median (range) | CPU s, all ranks | / plain net(x) | / fastest SWI 0.25 | "
          "peak memory per rank / plan | max abs diff to whole-image forward |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for k, lab in labels.items():
        peaks = rows0[k]["peaks"]
        plan = rows0[k].get("plan") or [None] * len(peaks)
        mem = ", ".join((format_bytes(p) if p is not None else "?") + (f" / plan {format_bytes(q)}" if q else "")
                        for p, q in zip(peaks, plan, strict=True))
        print(f"| {lab} | {wall[k]:.2f} s ({min(walls[k]):.2f}–{max(walls[k]):.2f}) | {cpu[k]:.2f} | "
              f"{wall[k] / wall['plain']:.2f}x | {wall[k] / best:.2f}x | {mem} | {diffs[k]:.2e} |")


def _how(line: str) -> str:
    return line.split(", ")[3].split(";")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--size", type=int, default=2048, help="2D slide side (default 2048)")
    ap.add_argument("--roi", type=int, default=256, help="2D sliding window side (default 256)")
    ap.add_argument("--depth", type=int, default=128, help="3D volume side (default 128)")
    ap.add_argument("--roi3d", type=int, default=64, help="3D sliding window side (default 64)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks = CPU cores used by every row (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row, interleaved (default 3)")
    ap.add_argument("--cases", default="2d,3d,startup", help="which cases (default 2d,3d,startup)")
    ap.add_argument("--startup-size", type=int, default=1024, help="slide side of the start-up table (default 1024)")
    ap.add_argument("--profile", action="store_true", help="instead: where nowdl's 2D time goes (cProfile, rank 0)")
    args = ap.parse_args()
    import zarr

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="nowdl-bench-predict-") as tmp:
        d = Path(tmp)
        pixels = write_inputs(d, args.size, args.depth)
        if args.profile:
            prof = run_workers(profile_worker, args.ranks, str(d / "slide.tif"), str(d), args.repeats, timeout_s=3000,
                               env={"OMP_NUM_THREADS": "1"})[0]
            print(f"\n| part (rank 0 of {args.ranks}, {args.size}², median of {args.repeats}) | seconds |")
            print("|---|---:|")
            print(f"| wall (CPU) | {statistics.median(r[0] for r in prof):.2f} s "
                  f"({statistics.median(r[1] for r in prof):.2f} s) |")
            for label, _, _ in PARTS:
                print(f"| {label} | {statistics.median(r[2][label] for r in prof):.2f} |")
            return
        if "startup" in args.cases.split(","):
            from predict_startup import startup_table

            small = d / "startup"
            small.mkdir()
            write_inputs(small, args.startup_size, 16)
            startup_table(small, args.ranks, args.roi, args.repeats, args.startup_size)
        for case, path, size, roi in (("2d", d / "slide.tif", args.size, args.roi),
                                      ("3d", d / "vol.nii.gz", args.depth, args.roi3d)):
            if case not in args.cases.split(","):
                continue
            window = max(size // 2, 48) // 8 * 8  # a window must hold the receptive field (margin 20) twice
            log(f"{case}: {args.ranks} ranks, {args.repeats} repeats")
            res = run_workers(worker, args.ranks, case, str(path), str(d), roi, window, args.repeats, timeout_s=5400,
                              env={"OMP_NUM_THREADS": "1"})
            ref = whole(case, pixels[case])
            diffs = {k: float(np.abs(np.asarray(zarr.open_array(str(d / f"{case}-{k}.zarr" / "0"))[:]) - ref).max())
                     for k in res[0]["rows"]}
            for k in ("nowdl", "nowdl-windows"):
                log(res[0]["rows"][k]["line"])
            table(case, size, roi, window, args.ranks, args.repeats, res, diffs)


if __name__ == "__main__":
    with recorded("bench_predict", "--results" in sys.argv):
        main()
