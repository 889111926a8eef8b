"""`nowdl run` fails early: output folders it cannot write and labels the model cannot take are refused
before the first step, naming the folder, or the sample, its file and the label values; a restarted job
ends where its first attempt aimed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.image_files import write_tiff

from nowdl.cli.commands import main
from nowdl.cli.runguard import run_end

TINY = ["resnet", "--model-args", '{"depth": 8, "version": 1, "width": 4, "num_classes": 3}', "--input", "1x3x16x16",
        "--batch-size", "2", "--steps", "2"]


@pytest.fixture(autouse=True)
def _single(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    rc = main(["run", *argv])
    cap = capsys.readouterr()
    assert rc == 2, cap
    assert cap.err.count("nowdl run: error:") == 1 and "unexpected" not in cap.err, cap.err
    return cap.out, cap.err


@pytest.mark.parametrize("option", ["--checkpoint", "--log-dir"])
def test_an_output_folder_that_cannot_be_written_is_refused_before_training(
        option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out, err = _fails([*TINY, option, str(blocker / "out")], capsys)
    assert f"nowdl run: error: {option} {blocker / 'out'} cannot be written (Not a directory): nothing was trained" \
           in err, err
    assert "step 1" not in out and "nowdl run: resnet" not in out  # refused before planning, let alone a step
    out, err = _fails([*TINY, option, str(blocker)], capsys)  # the folder is a file
    assert f"{option} {blocker} cannot be written ({blocker} is a file)" in err, err


def test_a_metrics_file_that_is_a_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "log" / "metrics.jsonl").mkdir(parents=True)
    _, err = _fails([*TINY, "--log-dir", str(tmp_path / "log")], capsys)
    assert "metrics.jsonl exists and cannot be written" in err, err


def test_labels_beyond_the_class_count_name_the_sample_file_and_values(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    write_tiff(tmp_path / "img.tif", rng.integers(0, 255, (32, 32, 3), dtype=np.uint8), pyramid=False)
    mask = rng.choice(np.array([0, 1, 2, 4], dtype=np.uint8), (32, 32))
    write_tiff(tmp_path / "mask.tif", mask, pyramid=False)
    unet = ["unet", "--model-args", '{"depth": 2, "base_width": 4, "out_channels": 2}', "--input", "1x3x32x32",
            "--batch-size", "1", "--steps", "1", "--workers", "0"]
    out, err = _fails([*unet, "--data", f"tiff:{tmp_path}/img.tif", "--labels", f"tiff:{tmp_path}/mask.tif"], capsys)
    assert (f"sample 0 ({tmp_path}/img.tif, mask {tmp_path}/mask.tif, region [0:32, 0:32]) of tiff:{tmp_path}/img.tif "
            "has label values {0, 1, 2, 4} but the model outputs 2 class(es), so labels must be in 0..1") in err, err
    assert "IndexError" not in err and "step 1" not in out


def test_label_values_of_a_dataset_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*TINY, "--data", "helpers.dying_data:dying", "--data-args", '{"classes": 5}', "--workers", "0"]
    _, err = _fails(argv, capsys)
    assert "of --data helpers.dying_data:dying has label values {" in err and "outputs 3 class(es)" in err, err
    assert "'{\"num_classes\": " in err  # the fix, with the count the labels need


def test_a_restart_ends_where_the_first_attempt_aimed(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = {"total": 12, "step": 4}
    assert run_end(saved, 4, 12) == 12  # a new run: --steps is the run's total
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert run_end(saved, 4, 12) == 12  # torchrun restarted it: finish the run it restarts
    assert run_end(saved, 12, 12) == 12  # it had finished: nothing left
    assert run_end(None, 0, 12) == 12 and run_end({"step": 4}, 4, 12) == 12  # no checkpoint / an older one
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert run_end(saved, 4, 100) == 12  # a Slurm requeue alike
