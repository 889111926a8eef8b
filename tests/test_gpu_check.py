"""benchmarks/gpu_check.py in its CPU mode: the script runs end to end and its figures hold together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_cpu_mode(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    for head in ("### 1. Profiler, UNet", "### 1. Profiler, ResNet-110-v2", "### 2. Peak memory", "### 3. Recompute and offload",
                 "### 4. Two processes"):
        assert head in text
    d = json.loads(out.read_text())
    assert d["device"] == "cpu" and d["spec"] == "cpu"
    for p in d["profiler"]:
        assert p["out_bytes_differ"] == [] and len(p["nodes"]) > 10  # measure and estimate see the same shapes
        assert p["total"]["out_bytes"][0] == p["total"]["out_bytes"][1] > 0
        assert all(t > 0 for t in p["total"]["fwd_s"])
    assert len(d["profiler"][1]["nodes"]) > 300  # ResNet-110-v2's nodes
    for step in ("train", "inference"):
        m = d["memory"][step]
        assert 0.7 < m["measured"] / m["predicted"] < 1.4, (step, m)
    two = d["two_processes"]
    assert two["ok"] and two["loss_diff"] < 1e-6 and two["out_diff"] < 1e-5
    levers = {r["what"]: r for r in d["levers"]["rows"]}
    assert set(levers) == {"kept", "recomputed", "offloaded"}
    assert "host memory" in levers["offloaded"]["error"]  # the cpu spec has none: the row says so
    for what in ("kept", "recomputed"):  # the same weights, the same losses
        r = levers[what]
        assert r["loss"] == levers["kept"]["loss"] and 0.7 < r["measured"] / r["predicted"] < 1.4, r
