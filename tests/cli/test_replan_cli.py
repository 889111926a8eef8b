"""A job that re-plans instead of dying ([Note: re-plan on memory], [Note: restart on memory]): with
``NOWDL_MEMORY_CAP`` below a plan's true peak, `nowdl run` re-plans once and ends with an uninterrupted
run's weights, bit for bit; an out-of-memory re-plans on the restart; what cannot fit stops in one
paragraph, once, with no loop; `nowdl predict` re-plans its windows and writes the same output."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.kill_matrix import run_in_shards
from helpers.predict_models import reference, seg_net, write_slide
from helpers.run_cli import STEP, step_losses

from nowdl.cli.commands import main
from nowdl.runtime.training.checkpoint import open_checkpoint

TINY = '{"depth": 8, "version": 1, "width": 4, "num_classes": 3, "conv_bias": false}'  # no bias before a norm
RUN = ["run", "resnet", "--model-args", TINY, "--input", "1x3x16x16", "--batch-size", "4", "--no-link-probe",
       "--workers", "0"]
REPLANNED = re.compile(r"^memory: rank (\d) used ([\d.]+) KiB in step 2, above its cap of ([\d.]+) KiB \(planned "
                       r"([\d.]+) KiB\)(, as did rank \d)?; re-planned for ([\d.]+) KiB per rank \(the cap x "
                       r"planned/measured\) and went on from step 3 with the same weights: plan: .*$", re.M)


def _tensors(ck: Path) -> dict[str, torch.Tensor]:
    c = open_checkpoint(ck)
    assert c is not None, ck
    return c.read({k: None for k in c.index() if not k.startswith("rng/")})


def _same(a: Path, b: Path) -> list[str]:
    """The keys (weights, buffers, optimizer state) where two checkpoints differ at all."""
    x, y = _tensors(a), _tensors(b)
    assert x.keys() == y.keys() and any(k.startswith("optim/") for k in x)
    return [k for k in x if not torch.equal(x[k], y[k])]


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
                "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "NOWDL_MEMORY_CAP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_one_process_re_plans_and_ends_with_the_same_weights(alone: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    assert main([*RUN, "--steps", "4", "--checkpoint", "whole", "--log-dir", "logs"]) == 0
    whole = capsys.readouterr().out
    lines = [json.loads(x) for x in (alone / "logs" / "metrics.jsonl").read_text().splitlines()[1:]]
    peak = lines[1]["ranks"][0]["peak_bytes"]  # step 2: the first step the CPU tracker measures
    monkeypatch.setenv("NOWDL_MEMORY_CAP", str(int(peak * 0.97)))  # below the true peak
    assert main([*RUN, "--steps", "4", "--checkpoint", "replanned"]) == 0
    out = capsys.readouterr().out
    said = REPLANNED.findall(out)
    assert len(said) == 1 and said[0][0] == "0", out  # one line, naming the rank
    assert float(said[0][1]) == round(peak / 1024, 1) and float(said[0][5]) < float(said[0][3]), out
    assert "memory:" not in whole
    assert step_losses(out) == step_losses(whole) and len(step_losses(out)) == 4
    assert _same(alone / "whole", alone / "replanned") == []


# ---- under torchelastic, 2 ranks ---------------------------------------------------------------------------
PIPE = [*RUN, "--stages", "2", "--dp", "1", "--steps", "5", "--timeout", "60"]
# on the nominal specs the tests plan with, the 2-stage plan's ranks peak at 83.4 and 96.6 KiB in step 2
# (planned 84.3 and 87.7): 90000 B re-plans into one that fits; 80000 B leaves nothing that fits
FITS, NOTHING = 90000, 80000


def _train(name: str, tmp: Path, cap: str, restarts: int = 0) -> dict[str, Any]:
    env = {"NOWDL_MEMORY_CAP": cap} if cap else {}
    return {"name": name, "world": 2, "restarts": restarts, "env": env, "argv": [*PIPE, "--checkpoint", str(tmp / name)]}


def _errors(logs: dict[str, str], attempt: int) -> list[str]:
    """The error paragraphs the ranks of ``attempt`` printed."""
    return [line for key, text in logs.items() if key.startswith(f"{attempt}/") for line in text.splitlines()
            if line.startswith("nowdl run: error: ")]


def test_torchrun_re_plan_ends_with_the_uninterrupted_weights(tmp_path: Path) -> None:
    res = run_in_shards([_train("whole", tmp_path, ""), _train("replan", tmp_path, str(FITS))], tmp_path, 2)
    for r in res.values():
        assert r["ok"], (r["name"], r["error"], r["logs"])
    ref = step_losses(res["whole"]["logs"]["0/0"])
    out = res["replan"]["logs"]["0/0"]
    assert len(ref) == 5 and "memory:" not in res["whole"]["logs"]["0/0"]
    # re-planned after step 2 in the process: one line, then the uninterrupted run's losses and weights
    assert len(REPLANNED.findall(out)) == 1 and step_losses(out) == ref, out
    assert _same(tmp_path / "whole", tmp_path / "replan") == []


@pytest.mark.slow
def test_torchrun_jobs_stop_once_restart_after_oom_and_predict(tmp_path: Path) -> None:
    pytest.importorskip("openslide")
    img = np.random.default_rng(0).integers(0, 255, (96, 128, 3), dtype=np.uint8)
    write_slide(tmp_path / "slide.tif", img)
    torch.save(seg_net(in_ch=3).state_dict(), tmp_path / "w.pt")
    plan = tmp_path / "two-stages.json"  # an inference plan that is not the leanest: predict re-plans it
    assert main(["plan", "helpers.predict_models:seg_net", "--model-args", '{"in_ch": 3}', "--input", "1x3x48x48",
                 "--gpus", "2", "--inference", "--stages", "2", "--spatial-parts", "1", "--micro-batches", "1",
                 "--dp", "1", "--replicas", "1", "--out", str(plan)]) == 0
    predict = ["predict", str(plan), "--checkpoint", str(tmp_path / "w.pt"), "--data", f"openslide:{tmp_path / 'slide.tif'}"]
    cases = [_train("whole", tmp_path, ""), _train("nothing fits", tmp_path, str(NOTHING), restarts=1),
             _train("oom", tmp_path, f"{FITS},oom", restarts=1),
             _train("oom twice", tmp_path, f"{NOTHING},oom", restarts=2),
             {"name": "predict whole", "world": 2, "restarts": 0, "argv": [*predict, "--out", str(tmp_path / "p0.zarr")]},
             {"name": "predict replan", "world": 2, "restarts": 0, "env": {"NOWDL_MEMORY_CAP": "200000"},
              "argv": [*predict, "--out", str(tmp_path / "p1.zarr")]}]
    res = run_in_shards(cases, tmp_path, 2)
    for name in ("whole", "oom", "predict whole", "predict replan"):
        assert res[name]["ok"], (name, res[name]["error"], res[name]["logs"])
    ref = step_losses(res["whole"]["logs"]["0/0"])
    assert len(ref) == 5

    # a re-plan that finds nothing stops in one paragraph; the restart stops at once, without a step
    r = res["nothing fits"]
    assert not r["ok"] and r["attempts"] == 2
    first, second = _errors(r["logs"], 0), _errors(r["logs"], 1)
    assert len(first) == 1 and "no plan fits" in first[0] and "the job stops (exit status 2)" in first[0], r["logs"]
    assert len(second) == 1 and second[0].endswith("a restart does not try again)"), r["logs"]
    assert not STEP.search(r["logs"]["1/0"])

    # out of memory in step 2: the restart re-plans and ends with the uninterrupted run's weights
    r = res["oom"]
    assert r["attempts"] == 2 and "ran out of memory in step 2" in _errors(r["logs"], 0)[0]
    assert re.search(r"^memory: rank \d ran out of memory in step 2 of an earlier attempt: .*; re-planned for .* "
                     r"and goes on from step 1 \(no checkpoint was saved\): plan: ", r["logs"]["1/0"], re.M)
    assert step_losses(r["logs"]["1/0"]) == ref
    assert _same(tmp_path / "whole", tmp_path / "oom") == []

    # out of memory again on the re-plan: the job stops, and its next attempt at once; no third plan
    r = res["oom twice"]
    assert not r["ok"] and r["attempts"] == 3
    assert "on a plan already re-planned" in _errors(r["logs"], 1)[0]
    assert _errors(r["logs"], 2)[0].endswith("a restart does not try again)") and not STEP.search(r["logs"]["2/0"])

    # predict: re-planned after the first window, the same output as the uninterrupted prediction
    out = res["predict replan"]["logs"]["0/0"]
    assert re.search(r"^memory: rank 1 used [\d.]+ KiB in window 1, above its cap of 195.3 KiB .* went on from "
                     r"window 2: inference plan: 1 stage\(s\) .*2 tiles", out, re.M), out
    import zarr

    got, whole = (np.asarray(zarr.open_group(str(tmp_path / p), mode="r")["0"][...]) for p in ("p1.zarr", "p0.zarr"))
    np.testing.assert_allclose(got, whole, atol=1e-5)
    pixels = np.asarray(__import__("tifffile").imread(tmp_path / "slide.tif"), dtype=np.float32).transpose(2, 0, 1) / 255
    np.testing.assert_allclose(got, reference(seg_net(in_ch=3), pixels), atol=1e-4)
