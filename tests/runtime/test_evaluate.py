"""eval_step on inference plans: any batch, any image size, outputs gathered in batch order."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers.distributed import run_workers
from helpers.exactness import adam
from torch import nn

import nowdl
from nowdl.errors import NowdlError, PlanError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nowdl.models.unet(2, 3, depth=2, base_width=4, norm=True).double()


def _data(n: int, side: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 2, side, side, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n, side, side), generator=g))


def _worker(rank: int, world: int, pins: dict[str, Any]) -> dict[str, Any]:
    cm = nowdl.compile(_model(), gpus=world, mode="estimate", optimizer=adam, loss_fn=nn.CrossEntropyLoss(),
                       cache=False, progress=False, timeout_s=60, **pins)
    for step in range(2):  # train on 16x16 crops, 2 samples a step
        cm.train_step(*_data(2, 16, step))
    big, yb = _data(3, 32, 9)  # another size, a batch the training plan does not take
    out0 = cm.eval_step(big)
    out_all, loss = cm.evaluate(big, yb, gather="all")
    plan = cm._train()._evaluator.plan_for(big)
    return {"out0": out0, "all": out_all, "loss": loss, "sd": cm.state_dict(), "plan": plan.config}


@pytest.mark.slow
@pytest.mark.parametrize("pins", [
    {"stages": 2, "dp": 1, "spatial_parts": 1},  # a pipeline: rank 0 used to get None
    {"stages": 1, "dp": 2, "spatial_parts": 1},  # dp: each rank used to get its share
    {"stages": 1, "dp": 1, "spatial_parts": 2},  # spatial tiles
], ids=["pipeline", "dp", "spatial"])
def test_eval_step_any_batch_and_size_gathered(pins: dict[str, Any]) -> None:
    res = run_workers(_worker, 2, pins, timeout_s=240)
    ref = _model()
    ref.load_state_dict(res[0]["sd"])  # the trained weights: loads with strict=True
    big, yb = _data(3, 32, 9)
    with torch.no_grad():
        want = ref.eval()(big)
    assert res[1]["out0"] is None
    torch.testing.assert_close(res[0]["out0"], want, rtol=1e-9, atol=1e-10)
    for r in res:
        torch.testing.assert_close(r["all"], want, rtol=1e-9, atol=1e-10)
        assert r["plan"]["inference"] is True and r["plan"]["schedule"] == "forward"
        assert math.isclose(r["loss"], float(nn.CrossEntropyLoss()(want, yb)), rel_tol=1e-9)


@pytest.mark.slow
def test_eval_step_one_process_other_size_after_training() -> None:
    cm = nowdl.compile(_model(), gpus=1, mode="estimate", optimizer=adam, loss_fn=nn.CrossEntropyLoss(),
                       cache=False, progress=False)
    cm.train_step(*_data(2, 16, 0))
    ref = _model()
    ref.load_state_dict(cm.state_dict())
    for n, side in ((1, 32), (5, 16), (2, 48)):
        x, _ = _data(n, side, 3)
        with torch.no_grad():
            want = ref.eval()(x)
        got = cm.eval_step(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    with pytest.raises(NowdlError, match="gather="):
        cm.eval_step(x, gather="rank1")


def test_training_refuses_an_inference_plan(tmp_path: Any) -> None:
    x, y = _data(1, 16, 0)
    inf = nowdl.compile(_model(), gpus=1, mode="estimate", cache=False, progress=False)
    plan = inf.plan(torch.empty(1, 2, 16, 16, dtype=torch.float64, device="meta"), train=False)
    assert plan.config["inference"] is True
    path = tmp_path / "inference.json"
    plan.save(path)
    cm = nowdl.compile(_model(), plan=path, loss_fn=nn.CrossEntropyLoss(), optimizer=adam, progress=False)
    with pytest.raises(PlanError, match="is an inference plan"):
        cm.train_step(x, y)
    # the same file evaluates, on any batch of its shape
    with torch.no_grad():
        want = _model().eval()(torch.cat([x, x, x]))
    got = nowdl.compile(_model(), plan=path, progress=False).eval_step(torch.cat([x, x, x]))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
