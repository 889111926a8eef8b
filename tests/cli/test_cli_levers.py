"""``--recompute`` and ``--offload``: what the plan prints and saves, and bad values (exit 2, nothing written)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from nowdl.cli.commands import main
from nowdl.profiler.devices import BUILTIN_SPECS

BASE = ["plan", "unet", "--model-args", '{"depth": 2, "base_width": 8}', "--input", "1x3x64x64", "--gpus", "2",
        "--mode", "estimate", "--no-cache"]
PIPE = ["--stages", "2", "--micro-batches", "4", "--spatial-parts", "1", "--replicas", "1", "--dp", "1"]


def _exit(argv: list[str]) -> int:
    """main's exit status, also when argparse exits (a bad flag value)."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def test_plan_prints_and_saves_the_levers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert main([*BASE, *PIPE, "--recompute", "0", "--offload", "off", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "levers (recompute [0], offload off" in text
    assert "stage 0: recompute (+" in text and "/step of its work, saves" in text
    saved = json.loads(out.read_text())
    assert [s["recompute"] for s in saved["stages"]] == [True, False]
    assert saved["stages"][0]["predicted"]["recompute_s"] > 0
    assert main(["show", str(out)]) == 0
    assert "stage 0: recompute (+" in capsys.readouterr().out
    assert main([*BASE, *PIPE, "--offload", "1", "--recompute", "off"]) == 0
    assert "stage 1: offload (+" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "needle"), [
    (["--recompute", "sometimes"], "argument --recompute: 'sometimes' is not auto, on, off or a list of stage indices"),
    (["--offload", "0,x"], "argument --offload: '0,x' is not auto, on, off"),
    (["--recompute", "0,5", "--stages", "2"], "recompute=[0, 5] names stage(s) [5], but the plan is pinned to 2 stages"),
    (["--offload", "2"], "offload=[2] names stage(s) [2], but 2 GPUs hold at most 2 stages"),
    (["--recompute", "on", "--offload", "on"], "both name stage(s) [0, 1]"),
])
def test_bad_lever_flags(flags: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert _exit([*BASE, *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_offload_without_host_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "nohost.json"
    d = dataclasses.replace(BUILTIN_SPECS["h100"], name="nohost", host_memory=None, host_link_bw=None).to_dict()
    spec.write_text(json.dumps(d))
    out = tmp_path / "p.json"
    assert main([*BASE, *PIPE, "--offload", "on", "--device-spec", str(spec), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "offload='on' needs host memory, but the device spec has none" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    zero = tmp_path / "zerohost.json"  # host_memory 0: no host memory, as absent
    zero.write_text(json.dumps({**d, "name": "zerohost", "host_memory": 0, "host_link_bw": 1e9}))
    assert main([*BASE, *PIPE, "--offload", "on", "--device-spec", str(zero), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "offload='on' needs host memory, but the device spec has none (host_memory 0 or absent" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    assert main([*BASE, *PIPE, "--offload", "off", "--device-spec", str(zero), "--out", str(out)]) == 0
    capsys.readouterr()
    out.unlink()
    small = tmp_path / "small.json"
    small.write_text(json.dumps({**d, "name": "smallhost", "host_memory": 4096, "host_link_bw": 1e9}))
    assert main([*BASE, *PIPE, "--offload", "on", "--device-spec", str(small), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: host memory: offloading the saved activations of stage(s) [0, 1] needs " in err, err
    assert "per GPU the device spec leaves for offload" in err and "host_memory at least " in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_run_flags_against_a_saved_plan() -> None:
    """``nowdl run PLAN.json --recompute ...``: a setting the plan was not made with is a pin conflict."""
    import argparse

    from nowdl.cli.runspec import pin_conflicts

    def ns(**kw: object) -> argparse.Namespace:
        base: dict[str, object] = dict(stages=None, micro_batches=None, dp=None, replicas=None, schedule=None,
                                       recompute="auto", offload="auto")
        return argparse.Namespace(**{**base, **kw})

    config = {"stages": 2, "recompute": [0], "offload": "auto"}
    assert pin_conflicts(ns(), config) == []
    assert pin_conflicts(ns(recompute=(0,)), config) == []
    assert pin_conflicts(ns(recompute="off", offload="on"), config) == [("--recompute", "off", [0]),
                                                                        ("--offload", "on", "auto")]
    assert pin_conflicts(ns(offload="off"), {"stages": 2}) == [("--offload", "off", "auto")]


def test_plan_norm_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--norm-schedule layerwise`` on a spec whose host memory cannot hold it: exit 2, one line
    naming the norm and the bytes, nothing written; on a spec that can, the stage's line says so."""
    norm = ["plan", "unet", "--model-args", '{"depth": 2, "base_width": 8, "norm": true}', "--input", "1x3x64x64",
            "--gpus", "1", "--mode", "estimate", "--no-cache", "--tiles-per-gpu", "4", "--norm-schedule", "layerwise"]
    d = BUILTIN_SPECS["h100"].to_dict()
    small, big, out = tmp_path / "small.json", tmp_path / "big.json", tmp_path / "p.json"
    small.write_text(json.dumps({**d, "name": "smallhost", "host_memory": 4096, "host_link_bw": 1e9}))
    assert main([*norm, "--device-spec", str(small), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "stage 0's norms run layer-wise keep " in err and "per GPU in host memory" in err and "node '" in err, err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    big.write_text(json.dumps({**d, "name": "bighost", "host_memory": 2**40, "host_link_bw": 1e12}))
    assert main([*norm, "--device-spec", str(big), "--out", str(out)]) == 0
    assert "norms layer-wise: +" in capsys.readouterr().out and out.exists()
    assert _exit([*norm[:-1], "sometimes"]) == 2
