"""Elastic restarts: torchrun --max-restarts restarts a job whose rank was SIGKILLed mid-run, and it
resumes from its latest complete checkpoint, names the lost rank, and ends with an uninterrupted run's weights."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.run_cli import ROOT, free_port, step_losses

from nowdl.runtime.launch.attempt import attempt_prefix, restart_count
from nowdl.runtime.training.checkpoint import open_checkpoint

TINY = '{"depth": 8, "version": 1, "width": 4, "num_classes": 3}'
RUN = ["resnet", "--model-args", TINY, "--input", "2x3x16x16", "--batch-size", "4", "--stages", "2",
       "--micro-batches", "2", "--dp", "1", "--replicas", "1", "--no-link-probe", "--workers", "0",
       "--data", "helpers.dying_data:dying", "--steps", "8", "--save-every", "2", "--timeout", "60"]


def _torchrun(*args: str, restarts: int = 0, data_args: str = "{}") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT") and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    env.update(NOWDL_BACKEND="gloo", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", str(restarts),
           "--monitor-interval", "0.1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "nowdl", "run", *RUN, "--data-args", data_args, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    ck = open_checkpoint(ckpt)
    assert ck is not None
    keys = {k: None for k in ck.index() if not k.startswith("rng/")}
    return ck.read(keys)


def test_attempts_have_their_own_store_keys() -> None:
    first = {"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert restart_count(first) == 0 and restart_count({}) == 0
    assert restart_count({**first, "TORCHELASTIC_RESTART_COUNT": "2", "SLURM_RESTART_COUNT": "1"}) == 3
    keys = {attempt_prefix(first), attempt_prefix({**first, "TORCHELASTIC_RESTART_COUNT": "1"}),
            attempt_prefix({"SLURM_JOB_ID": "42"}), attempt_prefix({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"})}
    assert len(keys) == 4 and all(k.startswith("nowdl/") for k in keys)


@pytest.mark.slow
def test_sigkilled_rank_restarts_and_ends_with_uninterrupted_weights(tmp_path: Path) -> None:
    whole = _torchrun("--checkpoint", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    # rank 1 dies at its 23rd read: sample 0 (the data check), then 4 per step: loading step 6
    killed = _torchrun("--checkpoint", str(tmp_path / "killed"), restarts=1,
                       data_args='{"kill_rank": 1, "kill_at": 23}')
    assert killed.returncode == 0, killed.stderr[-3000:]
    out, err = killed.stdout, killed.stderr
    # the survivor names the lost rank, its host, and where it was; no "unexpected"
    assert re.search(r"nowdl run: error: rank 1 \(host [^)]+\) stopped answering while rank 0 \(host [^)]+\) was at "
                     r"step \d+", err), err[-3000:]
    assert "unexpected" not in err and "please report" not in err
    assert err.count("stopped answering") == 1, err[-3000:]
    # the restart resumed from the latest complete checkpoint and finished the run (8 steps, not 8 more)
    assert f"resumed from {tmp_path / 'killed'} at step 4" in out, out
    assert re.search(r"^step 8/8 ", out, re.M) and not re.search(r"^step 9/", out, re.M), out
    losses, ref = step_losses(out), step_losses(whole.stdout)
    assert set(losses) == set(range(1, 9)) and all(losses[s] == ref[s] for s in losses), (losses, ref)
    record = json.loads((tmp_path / "killed" / "step-00000008" / "nowdl.json").read_text())
    assert record["run"]["total"] == 8
    a, b = _tensors(tmp_path / "whole"), _tensors(tmp_path / "killed")
    assert a.keys() == b.keys() and any(k.startswith("optim/") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
