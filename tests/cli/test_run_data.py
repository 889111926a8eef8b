"""`nowdl run` on large-image files and Datasets: --data/--labels/--workers/--log-dir, bad input, exactness, read bound."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.distributed import run_workers
from helpers.image_files import make_files, write_tiff
from helpers.run_cli import run_ranks, step_losses

import nowdl
from nowdl.cli.commands import main

UNET = ["unet", "--model-args", '{"depth": 2, "base_width": 4, "out_channels": 2}', "--input", "1x3x32x32"]
PINS = ["--micro-batches", "2", "--dp", "1", "--replicas", "1"]


class ToyDataset(torch.utils.data.Dataset[Any]):
    """Seeded (x, y) pairs for the Dataset-callable path; ``bad``: the index that returns the wrong shape."""

    def __init__(self, n: int = 6, bad: int = -1, kind: str = "shape") -> None:
        self.n, self.bad, self.kind = n, bad, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(3, 32, 32, generator=g), torch.randint(0, 2, (32, 32), generator=g)
        if i == self.bad:
            return x.numpy() if self.kind == "type" else (x[:, :16], y)
        return x, y


def make_dataset(n: int = 6, bad: int = -1, kind: str = "shape") -> ToyDataset:
    return ToyDataset(n, bad, kind)


@pytest.fixture
def files(tmp_path: Path) -> Path:
    make_files(tmp_path)
    return tmp_path


@pytest.fixture(autouse=True)
def _single(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = main(["run", *argv])
    cap = capsys.readouterr()
    assert rc == 0, cap
    return cap.out


def test_tiff_with_metrics(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = files / "log"
    out = _run([*UNET, "--batch-size", "2", "--steps", "3", "--data", f"tiff:{files}/img.tif", "--labels",
                f"tiff:{files}/mask.tif", "--workers", "2", "--log-dir", str(log)], capsys)
    assert "tiff (1 image, 4 crops/epoch) data" in out and sorted(step_losses(out)) == [1, 2, 3]
    lines = [json.loads(s) for s in (log / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["meta"]["model"] == "unet" and lines[0]["meta"]["world"] == 1
    assert lines[0]["meta"]["config"]["micro_batches"] == 2
    assert [r["step"] for r in lines[1:]] == [1, 2, 3]
    for r in lines[1:]:
        assert set(r) == {"step", "time", "loss", "images_per_s", "step_s", "data_wait_s", "ranks"}
        assert f"{r['loss']:.4f}" == step_losses(out)[r["step"]]
        assert r["step_s"] > 0 and r["images_per_s"] > 0 and r["data_wait_s"] >= 0
        (rk,) = r["ranks"]
        assert rk["rank"] == 0 and rk["peak_bytes"] > 0 and rk["predicted_bytes"] > 0
    assert 0.5 < lines[2]["ranks"][0]["peak_bytes"] / lines[2]["ranks"][0]["predicted_bytes"] < 2
    assert list(log.glob("events.out.tfevents.*"))  # tensorboard is a dev dependency


def test_zarr_h5_level_and_eval(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [*UNET, "--batch-size", "2", "--steps", "2", "--workers", "0"]
    z = step_losses(_run([*base, "--data", f"zarr:{files}/img.zarr:x", "--labels", f"zarr:{files}/img.zarr:y"], capsys))
    h = step_losses(_run([*base, "--data", f"h5:{files}/img.h5:x", "--labels", f"h5:{files}/img.h5:y"], capsys))
    t = step_losses(_run([*base, "--data", f"tiff:{files}/img.tif", "--labels", f"tiff:{files}/mask.tif"], capsys))
    assert z == h == t  # the same pixels through three readers
    out = _run([*base, "--data", f"tiff:{files}/img.tif:level=1", "--eval"], capsys)  # 32x32: the whole level
    assert "tiff (1 image, 1 crops/epoch) data" in out and re.search(r"^step 2/2  [\d.]+ s", out, re.M)


def test_dataset_callable(capsys: pytest.CaptureFixture[str]) -> None:
    base = [*UNET, "--batch-size", "2", "--steps", "2", "--data", "test_run_data:make_dataset"]
    w0 = step_losses(_run([*base, "--data-args", '{"n": 5}', "--workers", "0"], capsys))
    w2 = step_losses(_run([*base, "--data-args", '{"n": 5}', "--workers", "2"], capsys))
    assert sorted(w0) == [1, 2] and w0 == w2


def _err(argv: list[str], capsys: pytest.CaptureFixture[str], tmp: Path) -> str:
    log, ckpt = tmp / "log-bad", tmp / "ckpt-bad"
    rc = main(["run", *argv, "--log-dir", str(log), "--checkpoint", str(ckpt)])
    cap = capsys.readouterr()
    assert rc == 2, cap
    assert cap.err.startswith("nowdl run: error: ") and cap.err.count("\n") == 1, cap.err
    assert not log.exists() and not ckpt.exists()  # nothing written
    return cap.err


def test_bad_input(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [*UNET, "--batch-size", "2", "--steps", "1", "--workers", "0"]
    mask = ["--labels", f"tiff:{files}/mask.tif"]
    assert f"{files}/nope.tif does not exist" in _err([*base, "--data", f"tiff:{files}/nope.tif", *mask], capsys, files)
    (files / "junk.tif").write_bytes(b"junk")
    assert f"cannot read {files}/junk.tif" in _err([*base, "--data", f"tiff:{files}/junk.tif", *mask], capsys, files)
    err = _err([*base, "--data", f"tiff:{files}/img.tif:level=3", *mask], capsys, files)
    assert f"{files}/img.tif has 2 pyramid level(s)" in err and "level=0..1" in err
    err = _err([*base, "--data", f"h5:{files}/img.h5:nope", "--labels", f"h5:{files}/img.h5:y"], capsys, files)
    assert f"{files}/img.h5 has no dataset 'nope'" in err and "x, y" in err
    err = _err([*base, "--data", f"tiff:{files}/img.tif", "--labels", f"tiff:{files}/img.tif:level=1"], capsys, files)
    assert f"{files}/img.tif level 1 has shape (32, 32, 3)" in err and "one integer class per pixel" in err
    write_tiff(files / "half.tif", np.zeros((32, 64), np.uint8), pyramid=False)
    err = _err([*base, "--data", f"tiff:{files}/img.tif", "--labels", f"tiff:{files}/half.tif"], capsys, files)
    assert f"the mask {files}/half.tif is 32x64 but its image {files}/img.tif is 64x64" in err
    err = _err([*base, "--data", f"tiff:{files}/img.tif"], capsys, files)
    assert "training needs masks: --labels tiff:MASK" in err
    err = _err([*base, "--data", "test_run_data:make_dataset", "--data-args", '{"bad": 0}'], capsys, files)
    assert "sample 0 of --data test_run_data:make_dataset: x has shape (3, 16, 32)" in err
    err = _err([*base, "--data", "test_run_data:make_dataset", "--data-args", '{"bad": 0, "kind": "type"}'],
               capsys, files)
    assert "sample 0 of --data test_run_data:make_dataset is a ndarray" in err
    assert "has no attribute 'nope'" in _err([*base, "--data", "test_run_data:nope"], capsys, files)
    assert "--data nope: use synthetic" in _err([*base, "--data", "nope"], capsys, files)


def test_bad_sample_mid_run(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", *UNET, "--batch-size", "2", "--steps", "3", "--workers", "1", "--data",
               "test_run_data:make_dataset", "--data-args", '{"n": 4, "bad": 2}'])
    cap = capsys.readouterr()
    assert rc == 2 and cap.err.count("\n") == 1, cap.err
    assert "sample 2 of --data test_run_data:make_dataset: x has shape (3, 16, 32)" in cap.err


@pytest.mark.slow
def test_torchrun_tiff_matches_one_process(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """2 ranks (2 pipeline stages; a 2-tile spatial stage reading tiles lazily) train the losses of one process."""
    argv = [*UNET, "--batch-size", "2", "--steps", "3", "--data", f"tiff:{files}/img.tif", "--labels",
            f"tiff:{files}/mask.tif", *PINS]
    one = step_losses(_run([*argv, "--stages", "1"], capsys))
    pipe = run_ranks(*argv, "--stages", "2", "--workers", "1")
    assert pipe.returncode == 0, pipe.stderr
    assert step_losses(pipe.stdout) == one, (pipe.stdout, one)
    log = files / "log"
    tiles = run_ranks(*argv, "--stages", "1", "--spatial-parts", "2", "--spatial-stages", "1", "--slice", "vertical",
                      "--log-dir", str(log))
    assert tiles.returncode == 0, tiles.stderr
    assert "spatial stage 0: 2 tiles" in tiles.stdout and step_losses(tiles.stdout) == one
    last = json.loads((log / "metrics.jsonl").read_text().splitlines()[-1])
    assert [r["rank"] for r in last["ranks"]] == [0, 1]
    bad = run_ranks(*argv, "--stages", "2", "--data", f"tiff:{files}/nope.tif")  # every rank fails the same way
    assert bad.returncode != 0 and bad.stderr.count(f"nowdl run: error: {files}/nope.tif does not exist") == 1, \
        bad.stderr  # printed once, by rank 0


def _read_worker(rank: int, world: int, root: str, steps: int) -> dict[str, int]:
    torch.manual_seed(0)
    model = nowdl.models.unet(depth=2, base_width=4, out_channels=2)
    cm = nowdl.compile(model, gpus=world, stages=1, micro_batches=2, dp=1, replicas=1, spatial_parts=world,
                       spatial_stages=1, slice="vertical", mode="estimate", progress=False, cache=False,
                       loss_fn=nowdl.data.label_loss(torch.nn.CrossEntropyLoss()),
                       optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    ds = nowdl.data.crops(f"tiff:{root}/img.tif", (3, 64, 64), labels=f"tiff:{root}/mask.tif")
    for x, y in nowdl.data.tile_batches(ds, 2, steps=steps):  # read one step ahead
        cm.train_step(x, y)
    return dict(ds.counter.pixels)


@pytest.mark.slow
def test_each_rank_reads_its_tile(files: Path) -> None:
    """A 2-tile spatial stage: each rank reads half of each image (its tile; halos come from the peer)."""
    steps = 2
    counts = run_workers(_read_worker, 2, str(files), steps, init_group=False, timeout_s=240)
    image = steps * 2 * 3 * 64 * 64  # steps x batch x C x H x W
    for rank, c in enumerate(counts):
        assert c[f"{files}/img.tif"] == image // 2, (rank, c)
        assert c[f"{files}/mask.tif"] == image // 3  # the loss's ranks read the whole mask crop
    assert math.isclose(sum(c[f"{files}/img.tif"] for c in counts), image)
    assert np.all(np.asarray([c[f"{files}/img.tif"] for c in counts]) <= image / 2)
