"""The command line: plan, profile, show, and its errors (one paragraph, nothing written)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nowdl.cli.commands import main

MONAI_ARGS = '{"spatial_dims": 2, "in_channels": 1, "out_channels": 2, "channels": [8, 16, 32], "strides": [2, 2]}'


def test_plan_show_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    rc = main(["plan", "unet", "--model-args", '{"depth": 2, "base_width": 8}', "--input", "1x3x64x64",
               "--gpus", "4", "--stages", "4", "--dp", "1", "--replicas", "1", "--mip-gap", "0", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and out.exists()
    assert "stage" in text and "predicted" in text
    assert main(["show", str(out), "--nodes"]) == 0
    shown = capsys.readouterr().out
    assert "stage 3:" in shown
    assert main(["profile", "unet", "--model-args", '{"depth": 2, "base_width": 8}', "--input", "1x3x64x64",
                 "--top", "5", "--sort", "flops"]) == 0
    prof = capsys.readouterr().out
    assert "GFLOP" in prof and "total" in prof


def test_plan_monai_from_shell(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("monai")
    rc = main(["plan", "monai.networks.nets:UNet", "--model-args", MONAI_ARGS, "--input", "1x1x64x64", "--gpus", "2"])
    assert rc == 0
    assert "UNet" in capsys.readouterr().out


def test_plan_model_with_two_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    # VoxelMorph.forward(moving, fixed) concatenates its two images before the first conv: one
    # --input per argument; one --input alone names the missing argument
    pytest.importorskip("monai")
    argv = ["plan", "monai.networks.nets:VoxelMorph", "--model-args", '{"spatial_dims": 2, "integration_steps": 1}',
            "--input", "1x1x32x32", "--gpus", "2", "--stages", "2"]
    assert main(argv) == 2
    assert "VoxelMorph.forward takes 2 inputs (moving, fixed), 1 given" in capsys.readouterr().err
    assert main([*argv, "--input", "1x1x32x32"]) == 0
    assert "inputs 1x1x32x32 + 1x1x32x32" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "nosuchmodel", "--gpus", "2"], "unknown model"),
        (["plan", "nosuchpkg.mod:Net", "--input", "1x3x8x8", "--gpus", "2"], "cannot import"),
        (["plan", "torch.nn:NoSuchNet", "--input", "1x3x8x8", "--gpus", "2"], "no attribute"),
        (["plan", "unet", "--model-args", "{depth: 2}", "--gpus", "2"], "not valid JSON"),
        (["plan", "unet", "--model-args", '{"depht": 2}', "--gpus", "2"], "depht"),
        (["plan", "unet", "--input", "1x3xbig", "--gpus", "2"], "as a shape"),
        (["plan", "unet", "--input", "1x3x64", "--gpus", "2"], "rank 3"),
        (["plan", "unet", "--input", "3x64x64", "--gpus", "2"], "--input 3x64x64 has no batch dimension: give the whole "
         "input, batch first, e.g. --input 1x3x64x64"),
        (["profile", "monai.networks.nets:UNet", "--model-args", MONAI_ARGS, "--input", "1x64x64"],
         "--input 1x64x64 has no batch dimension"),
        (["plan", "unet", "--input", "1x3x64x64", "--input", "1x3x64x64", "--gpus", "2"], "at most 1 input (x), 2 given"),
        (["plan", "unet", "--input", "1x3x64x64", "--gpus", "0"], "positive integer"),
        (["plan", "unet", "--input", "1x3x64x64", "--gpus", "2", "--gpu-memory", "huge"], "memory size"),
        (["plan", "monai.networks.nets:UNet", "--gpus", "2", "--model-args", MONAI_ARGS], "give --input"),
        (["plan", "unet", "--input", "1x3x64x64", "--gpus", "2", "--mip-gap", "2"], "mip_gap must be"),
        (["show", "/nonexistent/plan.json"], "does not exist"),
        (["plan", "unet", "--input", "1x3x64x64", "--gpus", "2", "--tiles-per-gpu", "3"],
         "tiles_per_gpu=3 cannot cut the 64x64 input into tiles"),
        (["plan", "unet", "--input", "1x3x64x64", "--gpus", "2", "--tiles-per-gpu", "lots"],
         "tiles_per_gpu='lots' is neither 'auto' nor a positive integer"),
        (["plan", "unet", "--input", "1x3x64x64", "--gpus", "2", "--batch-size", "0"], "global_batch must be a positive"),
        (["plan", "unet", "--input", "1x3x64x64", "--gpus", "4", "--dp", "4", "--batch-size", "6"],
         "the global batch"),
    ],
)
def test_cli_errors(argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never.json"
    rc = main([*argv, "--out", str(out)] if argv[0] == "plan" else argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in err, err
    assert err.count("\n") <= 2, "one paragraph"
    assert not out.exists(), "nothing written on error"


def test_plan_batch_size_and_tiles_per_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    rc = main(["plan", "unet", "--model-args", '{"depth": 2, "base_width": 8}', "--input", "1x3x256x256",
               "--gpus", "2", "--batch-size", "8", "--tiles-per-gpu", "4", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    import nowdl

    plan = nowdl.Plan.load(out)
    c = plan.config
    assert c["global_batch"] == 8 and c["micro_batches"] * c["replicas"] * c["dp"] * c["micro_batch_size"] == 8
    assert any(s.tiles_per_gpu == 4 for s in plan.stages)
    assert "batch: global batch 8 as given" in text and "4 tiles per GPU" in text
    assert plan.model["inputs"][0][0] == c["micro_batch_size"]


def test_infeasible_cap_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never.json"
    rc = main(["plan", "unet", "--model-args", '{"depth": 2, "base_width": 8}', "--input", "1x3x256x256",
               "--gpus", "2", "--gpu-memory", "1KiB", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "nothing fits" in err and not out.exists()


def test_help_is_clear(capsys: pytest.CaptureFixture[str]) -> None:
    for sub in ("plan", "profile", "show"):
        with pytest.raises(SystemExit):
            main([sub, "--help"])
        assert "usage: nowdl " + sub in capsys.readouterr().out


def test_plan_with_per_stage_spatial_parts_and_fusion(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "unet", "--input", "1x3x128x128", "--gpus", "6", "--stages", "2", "--spatial-parts", "4,2",
               "--dp", "1", "--replicas", "1", "--halo-fusion", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "spatial stages [0, 1] x 4/2 parts (square)" in out
    assert "spatial stage 0: 4 tiles (square, grid 2x2)" in out and "halo fusion:" in out
    with pytest.raises(SystemExit) as e:  # argparse: usage error
        main(["plan", "unet", "--input", "1x3x128x128", "--gpus", "6", "--spatial-parts", "4,x"])
    assert e.value.code == 2
    assert "invalid parse_parts value: '4,x'" in capsys.readouterr().err


def test_untraceable_model_one_paragraph_dump_only_with_verbose(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "nowdl_badnet.py").write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class Branchy(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.c = nn.Conv2d(3, 4, 3)\n\n"
        "    def forward(self, x):\n        if x.sum() > 0:\n            return self.c(x)\n        return self.c(x) * 2\n\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.body = Branchy()\n\n"
        "    def forward(self, x):\n        return self.body(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "never.json"
    argv = ["plan", "nowdl_badnet:Net", "--input", "1x3x16x16", "--gpus", "2", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "module 'body' (Branchy)" in err and "nowdl_badnet.py:11" in err and "if x.sum() > 0" in err
    assert "def forward" not in err and not out.exists()
    assert main([*argv, "-v"]) == 2
    verbose = capsys.readouterr().err
    assert "Traceback" in verbose and verbose.count("\n") > 5


def test_status_line_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from nowdl.progress import status

    with status("tracing Net", enabled=True):
        pass
    assert capsys.readouterr().err == ""  # not a terminal: nothing
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with status("tracing Net", enabled=True):
        assert capsys.readouterr().err == "nowdl: tracing Net ...\r"
    assert capsys.readouterr().err.strip() == ""  # erased once done
    with status("tracing Net", enabled=False):
        pass
    assert capsys.readouterr().err == ""


def test_plan_exact_flag(tmp_path: Path) -> None:
    """A graph too wide for the exact DP: the default plan is the anytime split (no MILP, its LP
    bound's gap); ``--exact`` asks the MILP for a proof within ``--mip-gap``."""
    import json

    common = ["plan", "nowdl.models:amoebanetd", "--model-args", '{"num_layers": 3, "num_filters": 8}', "--input", "1x3x128x128",
              "--gpus", "4", "--stages", "4", "--micro-batches", "4", "--dp", "1", "--replicas", "1"]
    quick, proof = tmp_path / "quick.json", tmp_path / "proof.json"
    assert main([*common, "--out", str(quick)]) == 0
    assert main([*common, "--exact", "--time-limit", "60", "--out", str(proof)]) == 0
    fast, exact = json.loads(quick.read_text())["solver"], json.loads(proof.read_text())["solver"]
    assert fast["name"] not in ("highs", "cbc") and fast["status"] in ("feasible", "optimal")
    assert exact["name"] in ("highs", "cbc", "ideals") and exact["status"] == "optimal"
    assert exact["gap"] <= 0.01 + 1e-9
