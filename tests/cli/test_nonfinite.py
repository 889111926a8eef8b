"""[Note: non-finite steps]: a NaN input stops `nowdl run` at once, naming the step, the rank and the
sample, with no new checkpoint and the weights of the step before; --skip-nonfinite skips and counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.run_cli import step_losses

from nowdl.cli.commands import main
from nowdl.runtime.data.loader import StepSampler
from nowdl.runtime.training.checkpoint import open_checkpoint

TINY = '{"depth": 8, "version": 1, "width": 4, "num_classes": 3}'
BATCH = 4
NAN = 59  # the NaN sample: in step 4 (seed 0)


def _run(capsys: pytest.CaptureFixture[str], ck: Path, *extra: str) -> tuple[int, str, str]:
    rc = main(["run", "resnet", "--model-args", TINY, "--input", "1x3x16x16", "--batch-size", str(BATCH),
               "--no-link-probe", "--workers", "0", "--data", "helpers.nan_data:nan_data",
               "--data-args", f'{{"nan_index": {NAN}}}', "--steps", "6", "--checkpoint", str(ck), "--save-every", "1",
               "--device-spec", "cpu", *extra])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_nan_input_stops_the_run_naming_step_rank_and_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = next(s for s in range(6) if NAN in StepSampler(64, BATCH).indices(s)) + 1  # the step that reads it
    assert bad > 1
    rc, out, err = _run(capsys, tmp_path / "ck")
    assert rc == 2, err
    assert err.startswith(f"nowdl run: error: step {bad}: the loss or a gradient is NaN or infinite on 1 rank(s) "
                          "(rank 0: its loss is not finite); the optimizer did not step"), err
    assert f"sample {NAN} of " in err and "tile_59.tif, window 0:16 x 0:16" in err and err.count("\n") == 1
    ck = open_checkpoint(tmp_path / "ck")
    assert ck is not None and ck.step == bad - 1  # the last good step's checkpoint, none for the bad one
    assert set(step_losses(out)) == set(range(1, bad))


def test_skip_nonfinite_skips_the_step_and_counts_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = next(s for s in range(6) if NAN in StepSampler(64, BATCH).indices(s)) + 1
    rc, out, err = _run(capsys, tmp_path / "ck", "--skip-nonfinite")
    assert rc == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith(f"step {bad}/6"))
    assert "skipped: not finite (1 so far)" in line and "loss nan" in line
    assert sum("skipped" in ln for ln in out.splitlines()) == 1
    ck = open_checkpoint(tmp_path / "ck")
    assert ck is not None and ck.step == 6
    weights = ck.read({k: None for k in ck.index() if k.startswith("model/")})
    assert all(torch.isfinite(t).all() for t in weights.values())  # the skipped step changed nothing
