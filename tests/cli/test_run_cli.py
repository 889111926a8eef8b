"""`nowdl run`: real torchrun launches (2 gloo ranks), single-process runs, resume, and its errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers.run_cli import STEP, run_ranks
from helpers.run_cli import run_under_torchrun as _torchrun
from helpers.run_cli import step_losses as _steps

import nowdl
from nowdl.cli.commands import main

TINY = '{"depth": 8, "version": 1, "width": 4, "num_classes": 3}'
PIPE = ["resnet", "--model-args", TINY, "--input", "2x3x16x16", "--batch-size", "4", "--stages", "2",
        "--micro-batches", "2", "--dp", "1", "--replicas", "1"]
MEAN = re.compile(r"^mean: [\d.]+ images/s over steps (\d+)\.\.(\d+) \(first step excluded", re.M)


def _ckpt_step(ckpt: Path) -> int:
    record = json.loads((ckpt / (ckpt / "latest").read_text() / "nowdl.json").read_text())
    assert record["run"]["step"] == record["step"]
    return int(record["step"])


@pytest.fixture
def single(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process alone (no launcher variables), as `nowdl run` without torchrun."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "MV2_COMM_WORLD_RANK",
                "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_torchrun_train_and_resume(tmp_path: Path) -> None:
    plain = _torchrun(*PIPE, "--steps", "3")
    assert plain.returncode == 0, plain.stderr
    losses = _steps(plain.stdout)
    assert sorted(losses) == [1, 2, 3], plain.stdout  # rank 0 only: one line per step
    assert len(STEP.findall(plain.stdout)) == 3
    mean = MEAN.search(plain.stdout)
    assert mean is not None and mean.groups() == ("2", "3"), plain.stdout
    assert "plan: 2 stage(s) x 2 micro-batch(es)" in plain.stdout
    assert re.search(r"^links: point-to-point [\d.]+ GB/s \+ \d+ us, all-reduce", plain.stdout, re.M), plain.stdout

    ckpt = tmp_path / "ckpt"
    first = run_ranks(*PIPE, "--steps", "2", "--checkpoint", str(ckpt))  # forked by --nproc 2: the same job
    assert first.returncode == 0, first.stderr
    assert "resumed" not in first.stdout and f"saved checkpoint at step 2 to {ckpt}" in first.stdout
    assert _ckpt_step(ckpt) == 2
    assert (ckpt / "plan.json").exists() and (ckpt / "step-00000002" / ".metadata").exists()

    second = run_ranks(*PIPE, "--steps", "3", "--checkpoint", str(ckpt))  # --steps: the run's total
    assert second.returncode == 0, second.stderr
    assert f"resumed from {ckpt} at step 2" in second.stdout
    resumed = _steps(second.stdout)
    assert list(resumed) == [3], second.stdout
    assert re.search(r"^step 3/3 ", second.stdout, re.M)
    # weights, Adam state and data stream all resume: the same loss as the uninterrupted run
    assert resumed[3] == losses[3], (second.stdout, plain.stdout)
    assert _ckpt_step(ckpt) == 3
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "plan.json", "step-00000003"]  # the old step went


def test_torchrun_impossible_pins_fail_on_every_rank() -> None:
    argv = list(PIPE)
    argv[argv.index("--stages") + 1] = "3"  # 3 stages x dp 1 cannot fill 2 ranks
    res = _torchrun(*argv, "--steps", "1")
    assert res.returncode != 0
    assert "nowdl run: error: no configuration of 2 GPUs matches the pinned settings" in res.stderr  # rank 0
    assert res.stderr.count("nowdl run: error:") == 1, res.stderr  # rank 1 prints nothing of it
    assert "nowdl/cli/commands.py" not in res.stderr and "nowdl/runtime" not in res.stderr  # no worker traceback
    assert res.stderr.count("exitcode  : 2") >= 1  # the ranks exit 2, torchrun's summary reports it
    assert not STEP.search(res.stdout)


def test_single_process(single: None, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(["run", "resnet", "--model-args", TINY, "--input", "1x3x16x16", "--steps", "2", "--batch-size", "2",
               "--optimizer", "sgd", "--lr", "0.01"])
    out = capsys.readouterr().out
    assert rc == 0
    assert sorted(_steps(out)) == [1, 2] and "1 rank," in out
    assert MEAN.search(out)
    # inference on a dense (segmentation) model
    rc = main(["run", "unet", "--model-args", '{"depth": 2, "base_width": 4}', "--input", "1x3x16x16",
               "--steps", "2", "--batch-size", "2", "--eval"])
    out = capsys.readouterr().out
    assert rc == 0 and re.search(r"^step 2/2  [\d.]+ s  [\d.]+ images/s$", out, re.M), out
    # segmentation training: label maps of the output's spatial shape
    rc = main(["run", "unet", "--model-args", '{"depth": 2, "base_width": 4}', "--input", "1x3x16x16",
               "--steps", "1", "--batch-size", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "over step 1 (the only step" in out, out


def test_imagefolder_npy(single: None, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (tmp_path / "data" / cls).mkdir(parents=True)
        for i in range(3):  # not the input's size: resized and centre-cropped
            np.save(tmp_path / "data" / cls / f"{i}.npy", rng.integers(0, 255, (3, 20, 24), dtype=np.uint8))
    rc = main(["run", "resnet", "--model-args", '{"depth": 8, "version": 1, "width": 4}', "--num-classes", "2",
               "--input", "1x3x16x16", "--steps", "2", "--batch-size", "4", "--data", f"imagefolder:{tmp_path / 'data'}"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert sorted(_steps(out)) == [1, 2] and "imagefolder data" in out


def _err(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = main(argv)
    cap = capsys.readouterr()
    assert rc == 2, cap
    assert not STEP.search(cap.out)
    assert cap.err.startswith("nowdl run: error: ") and cap.err.count("\n") == 1, cap.err
    return cap.err


def test_errors(single: None, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    base = ["run", "resnet", "--model-args", TINY, "--input", "1x3x16x16", "--steps", "1"]
    err = _err([*base, "--batch-size", "2", "--stages", "3", "--dp", "1"], capsys)
    assert "no configuration of 1 GPUs" in err
    err = _err([*base, "--batch-size", "2", "--data", f"imagefolder:{tmp_path / 'nope'}"], capsys)
    assert "does not exist" in err and "<class name>" in err
    (tmp_path / "imgs" / "cls").mkdir(parents=True)
    err = _err([*base, "--batch-size", "2", "--data", f"imagefolder:{tmp_path / 'imgs'}"], capsys)
    assert "no .png" in err
    (tmp_path / "imgs" / "cls" / "x.png").write_bytes(b"\x89PNG")
    try:
        import PIL  # noqa: F401
    except ImportError:
        err = _err([*base, "--batch-size", "2", "--data", f"imagefolder:{tmp_path / 'imgs'}"], capsys)
        assert "pip install pillow" in err
    err = _err([*base, "--batch-size", "3", "--micro-batches", "2", "--dp", "1", "--replicas", "1"], capsys)
    assert "--batch-size 3 but --input 1x3x16x16 (micro-batches of 1) x micro-batches 2 x replicas 1 x dp 1 makes 2" \
        " samples per step: give --batch-size 2" in err
    no_input = [*base[:4], *base[6:]]
    err = _err([*no_input, "--batch-size", "3", "--micro-batches", "2", "--dp", "1", "--replicas", "1"], capsys)
    assert "multiple of 2" in err
    err = _err([*base, "--batch-size", "3", "--input", "2x3x16x16"], capsys)
    assert "--batch-size 3 is not a multiple of --input 2x3x16x16's batch dimension 2" in err
    err = _err([*base, "--batch-size", "2", "--num-classes", "7"], capsys)
    assert "outputs 3 classes" in err
    bare = tmp_path / "bare.json"
    assert main(["plan", "resnet", "--model-args", TINY, "--input", "1x3x16x16", "--gpus", "1", "--stages", "1",
                 "--micro-batches", "2", "--out", str(bare)]) == 0
    capsys.readouterr()
    d = json.loads(bare.read_text())
    del d["model"]["source"]
    bare.write_text(json.dumps(d))
    err = _err(["run", str(bare), "--steps", "1"], capsys)
    assert "does not record how to build its model" in err
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "nowdl-checkpoint.json").write_text("{}")
    err = _err([*base, "--batch-size", "2", "--checkpoint", str(tmp_path / "ck")], capsys)
    assert "no 'latest' pointer" in err and str(tmp_path / "ck") in err


def test_precision(single: None, capsys: pytest.CaptureFixture[str]) -> None:
    import inspect

    argv = ["run", "resnet", "--model-args", TINY, "--input", "1x3x16x16", "--steps", "1", "--batch-size", "2",
            "--precision", "fp16"]
    if "precision" not in inspect.signature(nowdl.compile).parameters:
        assert "not supported yet" in _err(argv, capsys)
        return
    argv[-1] = "bf16"  # nowdl.compile takes precision=: passed through
    assert main(argv) == 0
    assert sorted(_steps(capsys.readouterr().out)) == [1]


def test_plan_file_runs(single: None, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plan = tmp_path / "p.json"
    assert main(["plan", "resnet", "--model-args", TINY, "--input", "1x3x16x16", "--gpus", "1", "--stages", "1",
                 "--micro-batches", "2", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), "--steps", "1"]) == 0  # model, input and batch from the plan
    out = capsys.readouterr().out
    assert "global batch 2 of 3x16x16" in out and sorted(_steps(out)) == [1]
    assert "takes 2 samples per step" in _err(["run", str(plan), "--steps", "1", "--batch-size", "4"], capsys)
    assert "--stages 2 but the plan" in _err(["run", str(plan), "--steps", "1", "--stages", "2"], capsys)


def test_input_is_the_whole_micro_batch(single: None, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--input is read as `nowdl plan` reads it: the whole input of one micro-batch, batch first."""
    assert main(["run", "resnet", "--model-args", TINY, "--input", "2x3x16x16", "--batch-size", "4", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "global batch 4 of 3x16x16" in out and "plan: 1 stage(s) x 2 micro-batch(es)" in out, out
    fix = "--input 3x16x16 has no batch dimension: give the whole input, batch first, e.g. --input 1x3x16x16"
    # the form without the batch: refused by the built-in model's default input, by the first layer of a
    # model without one, and by a plan's input
    assert _err(["run", "resnet", "--model-args", TINY, "--input", "3x16x16", "--batch-size", "2", "--steps", "1"],
                capsys).startswith(f"nowdl run: error: {fix}")
    conv = ["run", "torch.nn:Conv2d", "--model-args", '{"in_channels": 3, "out_channels": 2, "kernel_size": 3}']
    assert _err([*conv, "--input", "3x16x16", "--batch-size", "2", "--steps", "1"], capsys).startswith(
        f"nowdl run: error: {fix}")
    assert main([*conv, "--input", "1x3x16x16", "--batch-size", "2", "--steps", "1"]) == 0
    capsys.readouterr()
    plan = tmp_path / "p.json"
    assert main(["plan", "resnet", "--model-args", TINY, "--input", "1x3x16x16", "--gpus", "1", "--stages", "1",
                 "--micro-batches", "2", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert _err(["run", str(plan), "--input", "3x16x16", "--steps", "1"], capsys).startswith(f"nowdl run: error: {fix}")
    assert "--input 2x3x16x16 differs from the plan's input 1x3x16x16" in _err(
        ["run", str(plan), "--input", "2x3x16x16", "--steps", "1"], capsys)
    assert main(["run", str(plan), "--input", "1x3x16x16", "--steps", "1"]) == 0
    assert "global batch 2 of 3x16x16" in capsys.readouterr().out


def test_torchrun_spatial_stem_matches_the_plain_pipeline() -> None:
    """`nowdl run` with a 2-tile spatial first stage (3 ranks) trains the same losses as 2 plain stages."""
    plain = run_ranks(*PIPE, "--steps", "2")
    spatial = run_ranks(*PIPE, "--spatial-parts", "2", "--spatial-stages", "1", "--slice", "vertical", "--steps", "2",
                        n=3)
    assert plain.returncode == 0, plain.stderr
    assert spatial.returncode == 0, spatial.stderr
    assert "spatial stage 0: 2 tiles (vertical, grid 1x2)" in spatial.stdout, spatial.stdout
    assert _steps(spatial.stdout) == _steps(plain.stdout), (spatial.stdout, plain.stdout)
