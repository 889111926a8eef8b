"""A NowdlError raised through the Python API under torchrun prints one paragraph for the job
([Note: API errors under a launcher]), not a traceback per rank."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from helpers.run_cli import ROOT, free_port
from torch import nn

import nowdl
from nowdl.runtime.training.report_once import should_print

SCRIPT = """
import sys, torch, nowdl
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 3))
cm = nowdl.compile(model, plan=sys.argv[1], loss_fn=nn.CrossEntropyLoss(), progress=False, timeout_s=30)
cm.train_step(torch.randn(2, 3, 8, 8), torch.zeros(2, dtype=torch.long))
"""


def _torchrun(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(NOWDL_BACKEND="gloo", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_plan_of_another_model_prints_one_paragraph(tmp_path: Path) -> None:
    other = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 3))
    plan = nowdl.compile(other, gpus=2, stages=2, micro_batches=2, dp=1, replicas=1, mode="estimate", cache=False, progress=False).plan(
        torch.empty(1, 3, 8, 8, device="meta"))
    plan.save(tmp_path / "other.json")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    res = _torchrun(script, str(tmp_path / "other.json"))
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if "nowdl: error:" in ln]
    assert len(lines) == 1, res.stderr
    assert "made for another model" in lines[0] and "rank 1:" not in lines[0], lines
    # no rank printed a traceback (torchrun's agent prints its own summary, with one of its own)
    assert 'train.py", line' not in res.stderr and res.stderr.count("Traceback") <= 1, res.stderr


def test_should_print_alone_and_without_a_group() -> None:
    assert should_print("x", 0, 1)
    assert should_print("x", 0, 4) and not should_print("x", 2, 4)  # no store: rank 0 speaks
