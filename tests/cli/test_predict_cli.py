"""`nowdl predict`: a prediction from a state_dict, a checkpoint or a plan, and every bad input
(one paragraph, exit 2, nothing under --out)."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.predict_models import reference, seg_net, write_slide

import nowdl
from nowdl.cli.commands import main

zarr = pytest.importorskip("zarr")
pytest.importorskip("openslide")

MODEL = "helpers.predict_models:seg_net"
ARGS = '{"in_ch": 3}'


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    img = np.random.default_rng(0).integers(0, 255, (96, 128, 3), dtype=np.uint8)
    write_slide(tmp_path / "slide.tif", img)
    torch.save(seg_net(in_ch=3).state_dict(), tmp_path / "w.pt")
    torch.save(seg_net(in_ch=3, classes=2).state_dict(), tmp_path / "other.pt")
    return {"slide": tmp_path / "slide.tif", "w": tmp_path / "w.pt", "other": tmp_path / "other.pt", "dir": tmp_path}


def _predict(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["predict", *args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _refused(capsys: pytest.CaptureFixture[str], out: Path, match: str, *args: str) -> None:
    rc, _, err = _predict(capsys, *args, "--out", str(out))
    assert rc == 2, err
    assert err.startswith("nowdl predict: error: ") and err.count("\n") == 1, err
    assert match in err, err
    assert not out.exists() or out.name == "taken.zarr"
    assert not [p for p in out.parent.iterdir() if ".nowdl-" in p.name]


def test_predict_a_slide_from_a_state_dict(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    out = files["dir"] / "pred.zarr"
    rc, text, err = _predict(capsys, MODEL, "--model-args", ARGS, "--checkpoint", str(files["w"]),
                             "--data", f"openslide:{files['slide']}", "--out", str(out), "--window", "64")
    assert rc == 0, err
    assert "predicted 1 image(s)" in text and "window(s), exact" in text and "(plan " in text
    img = np.asarray(zarr.open_array(str(files["slide"].parent / "pred.zarr" / "0"))[:])
    pixels = np.asarray(__import__("tifffile").imread(files["slide"]), dtype=np.float32).transpose(2, 0, 1) / 255
    np.testing.assert_allclose(img, reference(seg_net(in_ch=3), pixels), atol=1e-5)


def test_predict_with_a_plan_and_a_checkpoint(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    d = files["dir"]
    plan, trained = d / "plan.json", d / "train.json"
    for path, more in ((plan, ["--inference"]), (trained, [])):
        assert main(["plan", MODEL, "--model-args", ARGS, "--input", "1x3x64x64", "--gpus", "1", *more,
                     "--out", str(path)]) == 0
    cm = nowdl.compile(seg_net(in_ch=3), gpus=1, progress=False, loss_fn=torch.nn.CrossEntropyLoss())
    cm.train_step(torch.rand(1, 3, 32, 32), torch.randint(0, 3, (1, 32, 32)))
    cm.save_checkpoint(d / "ck")
    capsys.readouterr()
    rc, text, err = _predict(capsys, str(plan), "--checkpoint", str(d / "ck"), "--data", f"openslide:{files['slide']}",
                             "--out", str(d / "p.tif"), "--output", "argmax")
    assert rc == 0, err
    assert "6 window(s)" in text  # the plan's 64x64 windows over 96x128: 2 x 3
    _refused(capsys, d / "t.tif", "is a training plan", str(trained), "--checkpoint", str(d / "ck"),
             "--data", f"openslide:{files['slide']}")
    rc = main(["run", str(plan), "--steps", "1", "--log-dir", str(d / "log")])  # training refuses the inference plan
    err = capsys.readouterr().err
    assert rc == 2 and "is an inference plan" in err and "cannot train" in err and not (d / "log").exists()
    other = nowdl.compile(seg_net(in_ch=3, classes=2), gpus=1, progress=False, loss_fn=torch.nn.CrossEntropyLoss())
    other.train_step(torch.rand(1, 3, 32, 32), torch.randint(0, 2, (1, 32, 32)))
    other.save_checkpoint(d / "ck2")
    _refused(capsys, d / "q.zarr", "saved from another model configuration", MODEL, "--model-args", ARGS,
             "--checkpoint", str(d / "ck2"), "--data", f"openslide:{files['slide']}")


def test_bad_inputs(files: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    d, slide = files["dir"], f"openslide:{files['slide']}"
    base = [MODEL, "--model-args", ARGS, "--checkpoint", str(files["w"])]
    _refused(capsys, d / "a.zarr", "holds the weights of another model configuration", MODEL, "--model-args", ARGS,
             "--checkpoint", str(files["other"]), "--data", slide)
    _refused(capsys, d / "a.zarr", "does not exist", *base, "--data", f"openslide:{d / 'missing.svs'}")
    _refused(capsys, d / "a.zarr", "asks for level 4: use level=0..1", *base, "--data", slide, "--level", "4")
    _refused(capsys, d / "a.zarr", "--checkpoint", MODEL, "--model-args", ARGS, "--checkpoint", str(d / "nope"),
             "--data", slide)
    (d / "taken.zarr").mkdir()
    _refused(capsys, d / "taken.zarr", "already exists: pass --overwrite", *base, "--data", slide)
    from nowdl.runtime.predict import writers

    def full(self: object, bounds: object, values: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writers.LevelStore, "write", full)
    _refused(capsys, d / "a.tif", "the disk is full", *base, "--data", slide)
    _refused(capsys, d / "taken.zarr", "the disk is full", *base, "--data", slide, "--overwrite")
    assert (d / "taken.zarr").is_dir()  # the old output stays when the new one fails


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "nproc"])
def test_predict_under_torchrun(files: dict[str, Path], launcher: str) -> None:
    """Two ranks under torchrun, or forked by ``--nproc 2`` ([Note: local launcher]): the same exact prediction."""
    import os
    import subprocess
    import sys

    from helpers.run_cli import ROOT, free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(NOWDL_BACKEND="gloo", OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    out = files["dir"] / "p.tif"
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "-m", "nowdl"] if launcher == "torchrun" else
              [sys.executable, "-m", "nowdl"])
    cmd = [*launch, "predict", MODEL, "--model-args", ARGS,
           "--checkpoint", str(files["w"]), "--data", f"openslide:{files['slide']}", "--out", str(out),
           "--stages", "1", "--spatial-parts", "2", "--window", "64", *(["--nproc", "2"] if launcher == "nproc" else [])]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("predicted 1 image(s)") == 1 and res.stdout.count("(plan ") == 2
    pixels = np.asarray(__import__("tifffile").imread(files["slide"]), dtype=np.float32).transpose(2, 0, 1) / 255
    got = __import__("tifffile").imread(out)
    np.testing.assert_allclose(got, reference(seg_net(in_ch=3), pixels), atol=1e-4)
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode != 0 and res.stderr.count("already exists: pass --overwrite") == 1


@pytest.mark.slow
def test_nowdl_run_trains_on_nifti_volumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nibabel = pytest.importorskip("nibabel")
    (tmp_path / "masks").mkdir()
    for i in range(2):
        v = np.random.default_rng(i).random((16, 16, 16)).astype(np.float32)
        nibabel.save(nibabel.Nifti1Image(v, np.eye(4)), str(tmp_path / f"v{i}.nii.gz"))
        nibabel.save(nibabel.Nifti1Image((v > 0.5).astype(np.uint8), np.eye(4)), str(tmp_path / "masks" / f"v{i}.nii.gz"))
    rc = main(["run", "unet3d", "--model-args", '{"in_channels": 1, "out_channels": 2, "depth": 1, "base_width": 4}',
               "--input", "1x1x8x8x8", "--batch-size", "1", "--steps", "2", "--data", f"nifti:{tmp_path}",
               "--labels", f"nifti:{tmp_path / 'masks'}"])
    out = capsys.readouterr().out
    assert rc == 0 and "nifti (2 images" in out and "step 2/2  loss" in out
