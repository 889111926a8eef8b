"""`nowdl show PLAN | head`: the reader closing the pipe early is no error."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers.run_cli import ROOT


def test_show_into_a_closed_pipe_exits_quietly() -> None:
    plan = ROOT / "experiments" / "amoebanet_2048_sp4.json"  # a long listing with --nodes --schedule
    proc = subprocess.Popen([sys.executable, "-m", "nowdl", "show", str(plan), "--nodes", "--schedule"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert first.startswith("nowdl plan v") and err == "", err
