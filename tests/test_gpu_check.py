"""benchmarks/gpu_check.py in its CPU mode: the harvest runs end to end and writes records that hold together."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cpu_records(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("harvest") / "cpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--records", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_every_section_ran_and_the_records_hold_together(cpu_records: tuple[dict, str]) -> None:
    d, text = cpu_records
    assert d["format"] == "nowdl.gpu_records" and d["version"] == 1 and d["device"]["kind"] == "cpu"
    assert {s for s, v in d["sections"].items() if v["status"] != "ok"} == set(), d["sections"]
    for head in ("### Steps against their plans", "### Ranks on one device", "### One rank against eager", "### Ops"):
        assert head in text
    ops = d["ops"]
    assert len(ops) >= 5 and all(r["fwd_s"] > 0 and r["bwd_s"] > 0 and r["bytes"] > 0 for r in ops)
    assert next(r for r in ops if r["op"] == "conv2d")["flops"] == 2 * 8 * 8 * 9 * 32 * 32  # nowdl's own counter
    steps = {r["label"]: r for r in d["steps"]}
    for label in ("unet 1x3x64x64 train", "unet 1x3x128x128 inference", "unet 1x3x64x64 recompute",
                  "unet 1x3x64x64 seq_tiles T=4", "resnet110v2 1x3x32x32 train", "monai_unet 1x1x16x16x16 train"):
        r = steps[label]
        assert 0.7 < r["ratio"] < 1.4 and r["step_s"] > 0 and r["predicted_step_s"] > 0, r
        assert r["compile"]["gpus"] == 1 and r["compile"]["stages"] == 1  # the row can be planned again
    # the cpu spec has no host memory: the row says why; sequential tiles run instance norm
    assert "host memory" in steps["unet 1x3x64x64 offload"]["error"]
    r = steps["monai_unet 1x3x64x64 seq_tiles T=4"]
    assert "error" not in r and r["step_s"] > 0 and 0.5 < r["ratio"] < 2.0, r
    ranks = {r["config"]: r for r in d["ranks"]}
    for name in ("pipeline 2 stages", "spatial 2 tiles", "data parallel 2", "spatial 4 tiles"):
        r = ranks[name]
        assert r["ok"] and r["loss_diff"] < 1e-6 and r["weight_diff"] < 1e-5, r
        assert all(p["predicted_peak"] > 0 for p in r["per_rank"])
    eager = d["eager"][0]
    assert set(eager["step_s"]) == {"nowdl", "eager"} and eager["nowdl_over_eager"] > 0
    for p in d["profiles"]:
        assert p["out_bytes_differ"] == [] and len(p["nodes"]) > 10


@pytest.mark.slow
def test_report_reads_a_records_file(cpu_records: tuple[dict, str], tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(cpu_records[0]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--report", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "### Steps against their plans" in proc.stdout


def test_a_section_that_fails_is_recorded_and_the_rest_goes_on(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from harvest.records import Records

    recs = Records(tmp_path / "r.json", torch.device("cpu"), 60, "test")
    with recs.section("broken", need_s=0) as ok:
        assert ok
        recs.add("rows", {"a": 1})
        raise RuntimeError("boom")
    with recs.section("later", need_s=0) as ok:
        recs.add("rows", {"b": float("nan")})
    with recs.section("too long", need_s=1e6) as ok:
        assert not ok
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["sections"]["broken"]["status"] == "error" and "boom" in d["sections"]["broken"]["error"]
    assert d["sections"]["later"]["status"] == "ok" and d["sections"]["too long"]["status"] == "skipped"
    assert d["rows"] == [{"a": 1}, {"b": None}]  # kept as measured; NaN written as null


@pytest.mark.slow
def test_the_fit_reads_the_cpu_records(cpu_records: tuple[dict, str], tmp_path: Path) -> None:
    """benchmarks/fit_specs.py takes the samples of a `--cpu` records file and fits a time model to them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from fit_specs import time_samples

    from nowdl.profiler.calibrate.fit import fit_time, predict
    from nowdl.profiler.calibrate.records import load_records
    from nowdl.profiler.devices import get_device_spec

    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(cpu_records[0]))
    samples = time_samples([load_records(path, warn=False)], get_device_spec("cpu"))
    labels = [s.label for s in samples]
    assert any(label.endswith("unet 1x3x64x64 train step") for label in labels), labels
    assert all(s.ops and s.measured_s > 0 for s in samples)
    fit = fit_time(samples)
    worst = max(abs(math.log(predict(s, fit.top, fit.half, fit.floor_s) / s.measured_s)) for s in samples)
    assert fit.top > 0 and math.isfinite(worst) and fit.worst == pytest.approx(worst, rel=1e-6), (fit, worst)
