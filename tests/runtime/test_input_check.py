"""Every train_step checks its inputs against the set-up plan on every rank, before any
communication ([Note: input check]): a wrong shape, batch or dtype is refused in one paragraph
naming both shapes, and the ranks stay in step (a correct step afterwards trains)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers.distributed import run_workers
from helpers.exactness import adam, make_batch, make_loss, make_model

import nowdl
from nowdl.errors import NowdlError
from nowdl.runtime.training.input_check import check_step_inputs, input_spec


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    name = "monai_unet"
    cm = nowdl.compile(make_model(name), gpus=world, mode="estimate", optimizer=adam, loss_fn=make_loss(name),
                       cache=False, progress=False, timeout_s=30, **cfg)
    x, y = make_batch(name, 2, 0)
    out: dict[str, Any] = {"first": cm.train_step(x, y)}
    big = torch.randn(2, 1, 32, 32), torch.randn(2, 2, 32, 32)
    for key, (bx, by) in {"size": big, "batch": make_batch(name, 4, 1), "dtype": (x.double(), y),
                          "target": (x, y[:, :1])}.items():
        try:
            cm.train_step(bx, by)
            out[key] = "no error"
        except NowdlError as e:
            out[key] = str(e)
    out["after"] = cm.train_step(*make_batch(name, 2, 1))  # the ranks are still in step
    return out


@pytest.mark.parametrize("cfg", [
    {"stages": 2, "dp": 1, "replicas": 1, "micro_batches": 2, "spatial_parts": 1},
    {"stages": 1, "dp": 1, "replicas": 1, "micro_batches": 2, "spatial_parts": 2, "slice": "vertical"},
], ids=["pipeline", "spatial"])
def test_wrong_inputs_are_refused_on_every_rank(cfg: dict[str, Any]) -> None:
    res = run_workers(_worker, 2, cfg, timeout_s=120)
    for r in res:
        assert "2x1x32x32 (float32)" in r["size"] and "set up for 2x1x16x16 (float32)" in r["size"], r["size"]
        assert "crop or resize to 16x16" in r["size"] and "\n" not in r["size"]
        assert "4x1x16x16" in r["batch"] and "pass 2 samples per step" in r["batch"], r["batch"]
        assert "float64" in r["dtype"] and ".to(torch.float32)" in r["dtype"], r["dtype"]
        assert "the target y has shape 2x1x16x16" in r["target"] and "2x2x16x16" in r["target"], r["target"]
        assert math.isfinite(r["after"])  # the ranks did not fall out of step
    assert res[0]["after"] == res[1]["after"]


def test_check_step_inputs_without_processes() -> None:
    spec = input_spec([[1, 3, 8, 8], [1, 2]], 4, (torch.zeros(4, 3, 8, 8), torch.zeros(4, 2)), torch.zeros(4))
    check_step_inputs(spec, (torch.zeros(4, 3, 8, 8), torch.ones(4, 2)), torch.ones(4))
    check_step_inputs(spec, None, None)  # ranks without data pass None once set up
    with pytest.raises(NowdlError, match=r"input 1 has shape 4x3 \(float32\) but .* set up for 4x2"):
        check_step_inputs(spec, (torch.zeros(4, 3, 8, 8), torch.zeros(4, 3)), None)
    with pytest.raises(NowdlError, match="got 1 input tensor"):
        check_step_inputs(spec, torch.zeros(4, 3, 8, 8), None)
