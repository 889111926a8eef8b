"""Exactness: distributed training equals single-process training on the same micro-batches.

Each case trains 3 Adam steps with 2-4 gloo processes started by the test, and compares the loss
of every step and every parameter with one process that runs the same micro-batches in the order
(dp copy, replica, micro-batch) with gradient accumulation. BatchNorm running statistics are
compared too when there is one copy of each stage (dp = replicas = 1); with several copies each
copy's running statistics see only its own micro-batches, as with DistributedDataParallel.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed import run_workers
from helpers.exactness import (
    LR,
    STEPS,
    adam,
    compare,
    make_batch,
    make_loss,
    make_model,
    train_worker,
)
from helpers.reference import train_reference
from helpers.staging import staged_worker
from torch import nn

import nowdl


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_pipeline_resnet_bn(schedule: str, m: int) -> None:
    compare("resnet_bn", 2, {"stages": 2, "dp": 1, "replicas": 1, "micro_batches": m, "schedule": schedule})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_monai_unet_long_skips(schedule: str) -> None:
    compare("monai_unet", 4, {"stages": 4, "dp": 1, "replicas": 1, "micro_batches": 4, "schedule": schedule})


@pytest.mark.parametrize(("name", "staged"), [("resnet_bn", True), ("monai_unet", False)])
def test_master(name: str, staged: bool) -> None:
    """resnet_bn with every exchange through host staging (activations, gradients, the weights'
    broadcast, the bucketed gradient all-reduce, the loss), as CUDA tensors on gloo go."""
    compare(name, 2, {"stages": 2, "dp": 1, "replicas": 2, "micro_batches": 2, "schedule": "1f1b"},
            worker=staged_worker(train_worker) if staged else train_worker)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet_bn", "monai_unet"])
def test_pipeline_times_dp(name: str) -> None:
    compare(name, 4, {"stages": 2, "dp": 2, "replicas": 1, "micro_batches": 2, "schedule": "1f1b"})


@pytest.mark.slow
def test_master_times_dp() -> None:
    compare("resnet_bn", 4, {"stages": 2, "dp": 2, "replicas": 2, "micro_batches": 2, "schedule": "1f1b"})


@pytest.mark.slow
def test_master_odd_stages() -> None:
    compare("resnet_bn", 3, {"stages": 3, "dp": 1, "replicas": 2, "micro_batches": 2, "schedule": "gpipe"})


def test_checkpoint_resume_is_exact(tmp_path: Path) -> None:
    compare("resnet_bn", 2, {"stages": 2, "dp": 1, "replicas": 1, "micro_batches": 2, "schedule": "1f1b"},
             ckpt=str(tmp_path / "ckpt"))


def _dies(rank: int, world: int, name: str) -> None:
    model = make_model(name)
    cm = nowdl.compile(model, gpus=2, stages=2, dp=1, replicas=1, spatial_parts=1, micro_batches=2, mode="estimate",
                       optimizer=adam, loss_fn=make_loss(name), cache=False, progress=False, timeout_s=5)
    x, y = make_batch(name, 2, 0)
    cm.train_step(x, y)
    if rank == 1:
        os._exit(3)  # a rank dies between steps
    cm.train_step(x, y)  # rank 0 must fail fast, naming rank 1


def test_killed_rank_fails_fast() -> None:
    with pytest.raises(AssertionError) as e:
        run_workers(_dies, 2, "resnet_bn", timeout_s=90)
    assert "rank 1" in str(e.value) or "peer 1" in str(e.value)


def _options_worker(rank: int, world: int, precision: str, ckpt: bool | list[int]) -> list[float]:
    model = make_model("resnet_bn")
    cm = nowdl.compile(model, gpus=2, stages=2, dp=1, replicas=1, spatial_parts=1, micro_batches=2, mode="estimate",
                       optimizer=adam, loss_fn=make_loss("resnet_bn"), cache=False, progress=False, timeout_s=60,
                       precision=precision, activation_checkpointing=ckpt)
    losses = []
    for step in range(STEPS):
        losses.append(cm.train_step(*make_batch("resnet_bn", 2, step)))
        if step == 0:
            assert cm.optimizer is not None
            sched = torch.optim.lr_scheduler.StepLR(cm.optimizer, step_size=1, gamma=0.5)
        sched.step()
    assert cm.optimizer.param_groups[0]["lr"] == LR * 0.5**STEPS
    return losses


def _reference_with_halving_lr() -> list[float]:
    model = make_model("resnet_bn").train()
    opt = adam(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    out = []
    for step in range(STEPS):
        x, y = make_batch("resnet_bn", 2, step)
        opt.zero_grad()
        acc = 0.0
        for xc, yc in zip(x.chunk(2), y.chunk(2), strict=True):
            loss = make_loss("resnet_bn")(model(xc), yc)
            (loss / 2).backward()
            acc += float(loss.detach())
        opt.step()
        sched.step()
        out.append(acc / 2)
    return out


@pytest.mark.parametrize("which", [True, [1]])
def test_activation_checkpointing_and_lr_scheduler_are_exact(which: bool | list[int]) -> None:
    losses = run_workers(_options_worker, 2, "fp32", which, timeout_s=240)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(_reference_with_halving_lr()), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_trains_close_to_fp32(precision: str) -> None:
    losses = run_workers(_options_worker, 2, precision, False, timeout_s=240)[0]
    ref = _reference_with_halving_lr()
    assert all(abs(a - b) <= 0.05 * abs(b) for a, b in zip(losses, ref, strict=True)), (losses, ref)


def test_bad_precision() -> None:
    with pytest.raises(nowdl.NowdlError, match="precision='fp8' is not one of fp32, bf16, fp16"):
        nowdl.compile(make_model("resnet_bn"), gpus=1, precision="fp8")


def test_pinned_micro_batches_of_several_samples() -> None:
    """A batch of 8 with m=2, dp=1, replicas=1 pinned plans micro-batches of 4 samples."""
    cfg = {"stages": 2, "dp": 1, "replicas": 1, "micro_batches": 2, "schedule": "1f1b"}
    results = run_workers(_worker_batch, 2, cfg, timeout_s=240)
    assert results[0][1] == [4, 3, 16, 16]
    ref_model = make_model("resnet_bn").train()
    opt = adam(ref_model.parameters())
    x, y = make_batch("resnet_bn", 8, 0)
    opt.zero_grad()
    acc = 0.0
    for xc, yc in zip(x.chunk(2), y.chunk(2), strict=True):
        loss = make_loss("resnet_bn")(ref_model(xc), yc)
        (loss / 2).backward()
        acc += float(loss.detach())
    assert abs(results[0][0] - acc / 2) <= 1e-5 * abs(acc / 2)


def _worker_batch(rank: int, world: int, cfg: dict[str, Any]) -> tuple[float, list[int]]:
    cm = nowdl.compile(make_model("resnet_bn"), gpus=2, spatial_parts=1, mode="estimate", optimizer=adam,
                       loss_fn=make_loss("resnet_bn"), cache=False, progress=False, timeout_s=60, **cfg)
    loss = cm.train_step(*make_batch("resnet_bn", 8, 0))
    assert cm._trainer.plan is not None
    return loss, cm._trainer.plan.model["inputs"][0]


def _load_worker(rank: int, world: int) -> dict[str, torch.Tensor]:
    cm = nowdl.compile(make_model("resnet_bn"), gpus=2, stages=2, dp=1, replicas=1, spatial_parts=1, micro_batches=2,
                       mode="estimate", optimizer=adam, loss_fn=make_loss("resnet_bn"), cache=False, progress=False)
    cm.train_step(*make_batch("resnet_bn", 2, 0))
    torch.manual_seed(123)
    other = nowdl.models.resnet(depth=8, version=1, num_classes=3, width=4, conv_bias=False).state_dict()
    cm.load_state_dict(other if rank == 0 else {})  # rank 0's dict is broadcast
    return cm.state_dict()


def test_load_state_dict_under_original_names() -> None:
    got = run_workers(_load_worker, 2, timeout_s=240)[0]
    torch.manual_seed(123)
    want = nowdl.models.resnet(depth=8, version=1, num_classes=3, width=4, conv_bias=False).state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


class _Twice(nn.Module):
    """Modules registered under two names (as MONAI's DynUNet ``skip_layers``) and a parameter the
    forward never uses: ``model.state_dict()`` holds all of them. A plain tensor attribute (a
    constant, like those torch.export lifts out of SwinUNETR's forward) is not state."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(2)
        self.skips = nn.ModuleList([self.conv, self.bn])
        self.unused = nn.Linear(2, 2)
        self.scale = torch.tensor(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.skips[1](self.skips[0](x)) * self.scale


def test_state_dict_has_the_models_keys_aliases_and_unused_parameters_included() -> None:
    torch.manual_seed(0)
    model = _Twice()
    cm = nowdl.compile(model, gpus=1, mode="estimate", optimizer=adam, loss_fn=nn.MSELoss(), cache=False,
                       progress=False)
    x, y = torch.randn(2, 1, 6, 6), torch.randn(2, 2, 6, 6)
    cm.train_step(x, y)
    sd = cm.state_dict()
    want = model.state_dict()
    assert list(sd) == list(want)  # same keys in the same order: loads with strict=True
    for k in want:
        assert torch.equal(sd[k], want[k]), k
    torch.manual_seed(1)
    other = _Twice().state_dict()
    cm.load_state_dict(other)
    after = cm.state_dict()
    for k in other:
        assert torch.equal(after[k], other[k]), k


class _TwoHeads(nn.Module):
    """Returns a dict holding a tensor and a list (deep supervision, as BasicUNetPlusPlus's list):
    the loss and eval_step must see that structure, not the flattened tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 2, 3, padding=1)
        self.aux = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        h = torch.relu(self.c1(x))
        return {"seg": self.c2(h), "aux": [self.aux(h)]}


def _two_heads_loss(out: dict[str, Any], y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out["seg"], y) + 0.5 * nn.functional.mse_loss(out["aux"][0], y)


def _two_heads_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(4, 1, 8, 8, generator=g, dtype=torch.float64),
            torch.randn(4, 2, 8, 8, generator=g, dtype=torch.float64))


def _two_heads_worker(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    torch.manual_seed(0)
    cm = nowdl.compile(_TwoHeads().double(), gpus=2, stages=2, dp=1, replicas=1, spatial_parts=1, micro_batches=2,
                       mode="estimate", optimizer=adam, loss_fn=_two_heads_loss, cache=False, progress=False,
                       timeout_s=60)
    losses = [cm.train_step(*_two_heads_data(step)) for step in range(STEPS)]
    return losses, cm.state_dict(), cm.eval_step(_two_heads_data(0)[0])


def test_loss_and_eval_step_see_the_models_output_structure() -> None:
    results = run_workers(_two_heads_worker, 2, timeout_s=240)
    torch.manual_seed(0)
    model = _TwoHeads().double()
    ref_losses, ref_sd = train_reference(model, adam(model.parameters()), _two_heads_loss, _two_heads_data, 2, STEPS)
    losses, sd, _ = results[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-12, atol=1e-12)
    for k, ref in ref_sd.items():
        torch.testing.assert_close(sd[k], ref, rtol=1e-9, atol=1e-12)
    out = results[0][2]  # gathered on rank 0, in batch order
    with torch.no_grad():
        want = model.eval()(_two_heads_data(0)[0])
    assert isinstance(out, dict) and set(out) == {"seg", "aux"} and isinstance(out["aux"], list)
    torch.testing.assert_close(out["seg"], want["seg"])
    torch.testing.assert_close(out["aux"][0], want["aux"][0])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_master_four_stages(schedule: str) -> None:
    """Regression: with a recycled receive-buffer pool, 4-stage MASTER under GPipe drifted from step 3
    on (a gradient stolen into .grad through a view shared the buffer the next receive reused)."""
    compare("resnet_bn", 4, {"stages": 4, "dp": 1, "replicas": 2, "micro_batches": 2, "schedule": schedule})


class _TwoImages(nn.Module):
    """A registration-style net: forward(moving, fixed) concatenates the two images, and uses
    ``moving`` again at the end (so a model input crosses stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.norm = nn.GroupNorm(2, 4)
        self.b = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.c = nn.Conv2d(5, 1, 3, padding=1)

    def forward(self, moving: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.a(torch.cat([moving, fixed], 1))))
        return self.c(torch.cat([torch.relu(self.b(h)), moving], 1))


def _two_images(step: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return ((torch.randn(2, 1, 16, 16, generator=g, dtype=torch.float64),
             torch.randn(2, 1, 16, 16, generator=g, dtype=torch.float64)),
            torch.randn(2, 1, 16, 16, generator=g, dtype=torch.float64))


class _TimeConditioned(nn.Module):
    """A diffusion-style net: forward(x, t) with integer time steps ``t`` (embedded twice, so the
    integer input is read by a later stage too)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.a = nn.Conv2d(1, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.emb2 = nn.Embedding(10, 4)
        self.c = nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x) + self.emb(t)[:, :, None, None])
        h = torch.relu(self.b(h))
        return self.c(h + self.emb2(t)[:, :, None, None])


def _time_conditioned(step: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return ((torch.randn(2, 1, 16, 16, generator=g, dtype=torch.float64), torch.randint(0, 10, (2,), generator=g)),
            torch.randn(2, 1, 16, 16, generator=g, dtype=torch.float64))


_MULTI_INPUT: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Any]]] = {
    "two_images": (_TwoImages, _two_images), "time_conditioned": (_TimeConditioned, _time_conditioned)}


def _multi_input_worker(rank: int, world: int, name: str, cfg: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    make, data = _MULTI_INPUT[name]
    torch.manual_seed(0)
    cm = nowdl.compile(make().double(), gpus=world, micro_batches=2, dp=1, replicas=1, mode="estimate",
                       optimizer=adam, loss_fn=nn.MSELoss(), cache=False, progress=False, timeout_s=60, **cfg)
    losses = [cm.train_step(*data(step)) for step in range(STEPS)]
    return losses, cm.state_dict()


@pytest.mark.parametrize(("name", "cfg", "world"), [
    ("two_images", {"stages": 2, "spatial_parts": 1, "schedule": "1f1b"}, 2),
    ("two_images", {"stages": 2, "spatial_parts": 2, "spatial_stages": 1}, 3),
    ("time_conditioned", {"stages": 2, "spatial_parts": 1, "schedule": "1f1b"}, 2),
], ids=["pipeline", "spatial-then-plain", "integer-time-steps"])
def test_model_with_two_inputs_trains_exactly(name: str, cfg: dict[str, Any], world: int) -> None:
    """train_step((a, b), y): every input is planned for, split into micro-batches (and tiles)
    and fed to its placeholder; an integer input (diffusion time steps) crosses stages without
    a gradient; the run equals one process's."""
    results = run_workers(_multi_input_worker, world, name, cfg, timeout_s=240)
    make, data = _MULTI_INPUT[name]
    torch.manual_seed(0)
    model = make().double()
    ref_losses: list[float] = []
    opt = adam(model.parameters())
    for step in range(STEPS):  # train_reference chunks one tensor; here two inputs
        inputs, y = data(step)
        opt.zero_grad(set_to_none=True)
        acc = 0.0
        for *parts, t in zip(*(i.chunk(2) for i in inputs), y.chunk(2), strict=True):
            loss = nn.functional.mse_loss(model(*parts), t)
            (loss / 2).backward()
            acc += float(loss.detach())
        opt.step()
        ref_losses.append(acc / 2)
    ref_sd = model.state_dict()
    for losses, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-12, atol=1e-12)
    sd = results[0][1]
    for k, ref in ref_sd.items():
        torch.testing.assert_close(sd[k], ref, rtol=1e-9, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")


class _DeepSupervision(nn.Module):
    """Returns an auxiliary head beside the main one in training only (MONAI's DynUNet with
    deep_supervision=True does this): planned and trained as training runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(4)
        self.b = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.head = nn.Conv2d(4, 2, 1)
        self.aux = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.a(x)))
        g = torch.relu(self.b(h))
        if self.training:
            return torch.stack([self.head(g), self.aux(h)], dim=1)
        return self.head(g)


def _deep_sup_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(2, 1, 8, 8, generator=g, dtype=torch.float64),
            torch.randn(2, 2, 2, 8, 8, generator=g, dtype=torch.float64))


def _deep_sup_worker(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cm = nowdl.compile(_DeepSupervision().double(), gpus=world, stages=2, micro_batches=2, dp=1, replicas=1,
                       spatial_parts=1, mode="estimate", optimizer=adam, loss_fn=nn.MSELoss(), cache=False,
                       progress=False, timeout_s=60)
    losses = [cm.train_step(*_deep_sup_data(step)) for step in range(STEPS)]
    return losses, cm.state_dict()


def test_training_only_outputs_train_exactly() -> None:
    results = run_workers(_deep_sup_worker, 2, timeout_s=240)
    torch.manual_seed(0)
    model = _DeepSupervision().double()
    ref_losses, ref_sd = train_reference(model, adam(model.parameters()), nn.MSELoss(), _deep_sup_data, 2, STEPS)
    for losses, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-12, atol=1e-12)
    sd = results[0][1]
    for k, ref in ref_sd.items():
        torch.testing.assert_close(sd[k], ref, rtol=1e-9, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")
