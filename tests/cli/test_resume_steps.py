"""``--steps`` is the run's total: the command a stopped run names finishes it, and a finished
run started again has nothing to train (nowdl.cli.resume)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.run_cli import step_losses

from nowdl.cli.commands import main
from nowdl.cli.resume import finished_text

TINY = '{"depth": 8, "version": 1, "width": 4, "num_classes": 3}'
RUN = ["run", "resnet", "--model-args", TINY, "--input", "1x3x16x16", "--batch-size", "2"]


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
                "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _files(root: Path) -> dict[str, int]:
    """Every file's modification time (folders left out: the output check before the first step
    writes and removes a probe file in the checkpoint folder)."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_steps_is_the_total_after_a_resume(alone: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*RUN, "--steps", "2", "--checkpoint", "ck"]) == 0
    first = capsys.readouterr().out
    assert sorted(step_losses(first)) == [1, 2] and "step 2/2" in first
    before = _files(alone)
    assert main([*RUN, "--steps", "2", "--checkpoint", "ck"]) == 0  # the same command again: done
    out = capsys.readouterr().out
    assert "nothing to train: ck is at step 2 and --steps 2 is the run's total" in out and not step_losses(out)
    assert _files(alone) == before  # no step ran, nothing was saved
    assert main([*RUN, "--steps", "3", "--checkpoint", "ck"]) == 0
    out = capsys.readouterr().out
    assert "resumed from ck at step 2" in out and sorted(step_losses(out)) == [3] and "step 3/3" in out


def test_finished_text() -> None:
    assert finished_text("ck", 79, 400) is None
    assert "at step 400 and --steps 400" in str(finished_text("ck", 400, 400))
