"""Start-up of ``bench_predict.py``: one small image predicted by a fresh command, launch included.

Each row is a new process tree timed from launch to exit, as a user's shell runs it:

* ``nowdl predict`` under ``torchrun --nproc-per-node R``, and with ``--nproc R`` (the ranks forked
  after one import: [Note: local launcher]) (MONAI's UNet by ``monai.networks.nets:UNet``
  and ``--model-args``, weights from a state_dict file, OpenSlide in, OME-Zarr out), once with an
  empty cache folder (``NOWDL_CACHE_DIR``: the first prediction of this model at this shape traces,
  profiles, plans and propagates shapes) and once with the cache a first run left (a second one reads
  the profile and the network's reach back);
* MONAI's ``sliding_window_inference`` (256² windows, overlap 0.25, gaussian, R threads or 1; the
  faster is the peer: on a loaded machine R threads can be much slower than one) and a plain
  whole-image ``net(x)`` (R threads), each a ``python`` process that imports torch and MONAI, builds
  the same UNet, loads the same weights, reads the slide through OpenSlide and writes the same
  OME-Zarr with nowdl's writer.

The rows take turns (each repeat runs every row once) so the load of a shared machine falls on all
alike; the table gives the median and the range over the repeats.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["startup_table"]

UNET = {"spatial_dims": 2, "in_channels": 3, "out_channels": 2, "channels": [8, 16, 32], "strides": [2, 2],
        "num_res_units": 1}

#: the single-process rows: argv = [slide, weights, out, "swi"|"plain", roi, threads]
SCRIPT = """
import sys
import numpy as np
import openslide
import torch
from monai.inferers import sliding_window_inference
from monai.networks.nets import UNet
from nowdl.runtime.predict.writers import LevelStore, build_level, discard, ngff_attributes, pyramid_shapes
from pathlib import Path
slide, weights, out, how, roi, threads = sys.argv[1:]
torch.set_num_threads(int(threads))
net = UNet(**UNET).eval()
net.load_state_dict(torch.load(weights, weights_only=True))
s = openslide.OpenSlide(slide)
rgb = np.asarray(s.read_region((0, 0), 0, s.level_dimensions[0]))[:, :, :3]
x = torch.from_numpy(rgb.transpose(2, 0, 1).astype(np.float32) / 255)[None]
with torch.no_grad():
    y = (net(x) if how == "plain" else sliding_window_inference(x, (int(roi),) * 2, 1, net, overlap=0.25,
                                                                 mode="gaussian"))[0].numpy()
out = Path(out)
discard(out)
levels = pyramid_shapes(y.shape[1:])
for k, sp in enumerate(levels):
    LevelStore.create(out, k, (y.shape[0], *sp), np.float32, ngff_attributes(out.name, len(levels), 2) if k == 0 else None)
LevelStore(out, 0).write([(0, n) for n in y.shape[1:]], y)
for k in range(1, len(levels)):
    build_level(out, k, False, 0, 1)
""".replace("UNet(**UNET)", f"UNet(**{UNET!r})")


def _timed(cmd: list[str], env: dict[str, str], cwd: Path) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({p.returncode}): {p.stderr[-2000:]}")
    return time.perf_counter() - t0


def startup_table(d: Path, ranks: int, roi: int, repeats: int, size: int) -> None:
    """Time every row ``repeats`` times, interleaved, in ``d`` (holding ``slide.tif``); print the table."""
    import torch
    from bench_predict import make_net

    torch.save(make_net(2, 3).state_dict(), d / "sd.pt")
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    warm = d / "cache-warm"
    from helpers.run_cli import free_port

    def nowdl(out: str, forked: bool = False) -> list[str]:
        launch = ([sys.executable, "-m", "nowdl"] if forked else
                  [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
                   "127.0.0.1", "--master-port", str(free_port()), "-m", "nowdl"])
        return [*launch, "predict", "monai.networks.nets:UNet", "--model-args", json.dumps(UNET), "--checkpoint", "sd.pt",
                "--data", "openslide:slide.tif", "--overwrite", "--out", out, *(["--nproc", str(ranks)] if forked else [])]

    one = [sys.executable, "-c", SCRIPT, "slide.tif", "sd.pt"]
    rows = {f"nowdl predict, {ranks} ranks (torchrun), first run (empty cache)": lambda i: _timed(
                nowdl("a.zarr"), {**env, "NOWDL_CACHE_DIR": str(d / f"cache-cold-{i}")}, d),
            f"nowdl predict, {ranks} ranks (torchrun), second run (cache of a first)": lambda i: _timed(
                nowdl("b.zarr"), {**env, "NOWDL_CACHE_DIR": str(warm)}, d),
            f"nowdl predict --nproc {ranks} (forked ranks), first run (empty cache)": lambda i: _timed(
                nowdl("f.zarr", True), {**env, "NOWDL_CACHE_DIR": str(d / f"cache-cold-f{i}")}, d),
            f"nowdl predict --nproc {ranks} (forked ranks), second run (cache of a first)": lambda i: _timed(
                nowdl("g.zarr", True), {**env, "NOWDL_CACHE_DIR": str(warm)}, d),
            f"sliding_window_inference {roi}², overlap 0.25, gaussian, {ranks} threads": lambda i: _timed(
                [*one, "c.zarr", "swi", str(roi), str(ranks)], env, d),
            f"sliding_window_inference {roi}², overlap 0.25, gaussian, 1 thread": lambda i: _timed(
                [*one, "d.zarr", "swi", str(roi), "1"], env, d),
            f"plain net(x), whole image, {ranks} threads": lambda i: _timed([*one, "e.zarr", "plain", "0", str(ranks)],
                                                                           env, d)}
    _timed(nowdl("b.zarr"), {**env, "NOWDL_CACHE_DIR": str(warm)}, d)  # fills the warm cache
    times: dict[str, list[float]] = {k: [] for k in rows}
    for i in range(repeats):
        for label, run in rows.items():
            times[label].append(run(i))
            print(f"startup {label}: {times[label][-1]:.2f} s", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    swi = min(v for k, v in med.items() if k.startswith("sliding"))  # MONAI's faster form on these cores
    plain = next(v for k, v in med.items() if k.startswith("plain"))
    print(f"\n### Start-up: {size}² slide, a fresh command each, launch included, {ranks} cores, median of {repeats}\n")
    print("| command | wall, median (range) | / faster sliding window (the peer) | / plain net(x) (the limit) |")
    print("|---|---:|---:|---:|")
    for k, v in times.items():
        print(f"| {k} | {med[k]:.2f} s ({min(v):.2f}–{max(v):.2f}) | {med[k] / swi:.2f}x | {med[k] / plain:.2f}x |")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_predict import write_inputs

    with tempfile.TemporaryDirectory(prefix="nowdl-bench-startup-") as tmp:
        write_inputs(Path(tmp), int(sys.argv[1]) if len(sys.argv) > 1 else 1024, 16)
        startup_table(Path(tmp), 2, 256, int(sys.argv[2]) if len(sys.argv) > 2 else 3,
                      int(sys.argv[1]) if len(sys.argv) > 1 else 1024)
