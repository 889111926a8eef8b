"""Recompute and offload at runtime train exactly what one process trains (float64, 1e-9).

Each case trains 3 Adam steps on 2-4 gloo processes, with stages recomputed (the plan's
``recompute`` field, or ``activation_checkpointing``) or offloaded (the plan's ``offload`` field),
and compares the loss of every step and every parameter and buffer (running statistics and
``num_batches_tracked`` included) with one process running the same micro-batches. Under MASTER
and dp each copy of a stage sees its own micro-batches, so its running statistics are compared
with a twin run of the same plan without recompute, in the same processes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from helpers.distributed import run_workers
from helpers.monai_zoo import build, by_id
from helpers.reference import train_reference
from helpers.staging import staged_worker
from torch import nn

import nowdl

STEPS = 3
LR = 1e-2
SEED = 7  # the generators' state when training starts, in every process and in the reference


class NormNet(nn.Module):
    """Conv blocks with one kind of norm (no bias before a norm); dropout in the head only, so
    the one stage that draws random numbers draws them in the reference's order."""

    def __init__(self, norm: str, dropout: float = 0.0) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            n: nn.Module = {"batch": lambda: nn.BatchNorm2d(cout),
                            "instance": lambda: nn.InstanceNorm2d(cout, affine=True, track_running_stats=True),
                            "group": lambda: nn.GroupNorm(2, cout)}[norm]()
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), n, nn.ReLU())

        self.body = nn.Sequential(block(2, 4), block(4, 4), nn.MaxPool2d(2), block(4, 8), block(8, 8))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(8 * 8 * 8, 32), nn.Tanh(),
                                  nn.Dropout(dropout), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


_MONAI = {"AttentionUnet2d", "DenseNet2d"}


def _make(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name in _MONAI:
        return build(by_id(name)).double()
    if name == "resnet_bn":
        return nowdl.models.resnet(depth=8, version=1, num_classes=3, width=4, conv_bias=False).double()
    if name == "monai_unet":
        from monai.networks.nets import UNet

        return UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2),
                    num_res_units=1, bias=False).double()
    norm, _, extra = name.partition("+")
    net = NormNet(norm, 0.3 if extra == "dropout" else 0.0)
    return net if extra == "float32" else net.double()


def _image(name: str) -> bool:
    return name in ("monai_unet", "AttentionUnet2d")


def _data(name: str, total: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if name in _MONAI:
        shape: tuple[int, ...] = by_id(name).shape[1:]
    elif name == "monai_unet":
        shape = (1, 16, 16)
    elif name == "resnet_bn":
        shape = (3, 16, 16)
    else:
        shape = (2, 16, 16)
    x = torch.randn(total, *shape, generator=g, dtype=torch.float32 if name.endswith("float32") else torch.float64)
    if _image(name):
        return x, torch.randn(total, 2, *shape[1:], generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (total,), generator=g)


def _loss(name: str) -> nn.Module:
    return nn.MSELoss() if _image(name) else nn.CrossEntropyLoss()


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)


def _total(cfg: dict[str, Any]) -> int:
    return int(cfg["micro_batches"] * cfg.get("dp", 1) * cfg.get("replicas", 1))


@dataclasses.dataclass(frozen=True)
class Levers:
    """What a run recomputes and offloads: plan fields, and activation_checkpointing."""

    recompute: tuple[int, ...] = ()  # plan stages with recompute=True
    offload: tuple[int, ...] = ()  # plan stages with offload=True
    checkpointing: bool | tuple[int, ...] = False


_Run = tuple[list[float], dict[str, torch.Tensor], list[list[int]], list[tuple[int, bool, bool, list[int]]]]


def _train(world: int, name: str, cfg: dict[str, Any], lv: Levers) -> _Run:
    cm = nowdl.compile(_make(name), gpus=world, mode="estimate", optimizer=_adam, loss_fn=_loss(name), cache=False,
                       progress=False, timeout_s=90, activation_checkpointing=list(lv.checkpointing)
                       if isinstance(lv.checkpointing, tuple) else lv.checkpointing, **cfg)
    x0, y0 = _data(name, _total(cfg), 0)
    plan = cm.plan(x0[:1], target=y0[:1])  # the plan train_step uses (cached by input shape)
    for s in plan.stages:
        s.recompute, s.offload = s.index in lv.recompute, s.index in lv.offload
    torch.manual_seed(SEED)
    losses, offloaded = [], []  # bytes offloaded in each step
    for step in range(STEPS):
        losses.append(cm.train_step(*_data(name, _total(cfg), step)))
        eng = cm._trainer.engine
        offloaded.append(int(eng.offload.step_bytes) if hasattr(eng, "offload") else 0)
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, offloaded)
    return losses, cm.state_dict(), gathered, [(s.parts, s.recompute, s.offload, s.ranks) for s in plan.stages]


def _worker(rank: int, world: int, name: str, cfg: dict[str, Any], lv: Levers, twin: bool
            ) -> tuple[_Run, _Run | None]:
    run = _train(world, name, cfg, lv)
    return run, _train(world, name, cfg, Levers()) if twin else None


def _reference(name: str, total: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _make(name)
    torch.manual_seed(SEED)
    return train_reference(model, _adam(model.parameters()), _loss(name), lambda step: _data(name, total, step), total,
                           STEPS)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, keys: Any = None) -> None:
    assert list(got) == list(want), set(got) ^ set(want)
    for k in keys if keys is not None else want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{what}: {k}: {m}")


def compare(name: str, world: int, cfg: dict[str, Any], lv: Levers, *, twin: bool = False, one: bool = True,
            staged: bool = False) -> _Run:
    """Train with ``lv`` on ``world`` ranks; assert losses, parameters and buffers equal one process
    (``one``; buffers of several copies: equal the ``twin`` run without recompute and offload);
    ``staged``: every exchange through host staging."""
    results = run_workers(staged_worker(_worker) if staged else _worker, world, name, cfg, lv, twin, timeout_s=400)
    (losses, sd, offloaded, layout), other = results[0]
    for r, res in enumerate(results):
        assert res[0][0] == losses, f"rank {r} reports another loss"
    if one:
        ref_losses, ref_sd = _reference(name, _total(cfg))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-9, atol=1e-12)
        one_copy = cfg.get("dp", 1) == 1 and cfg.get("replicas", 1) == 1
        params = {n for n, _ in _make(name).named_parameters()}
        _close(sd, ref_sd, "against one process", None if one_copy else [k for k in ref_sd if k in params])
    if other is not None:
        _close(sd, other[1], "against the same plan without recompute or offload")
        assert other[0] == losses
    assert [lay[1:3] for lay in layout] == [(s in lv.recompute, s in lv.offload) for s in range(len(layout))]
    for _, rc, off, ranks in layout:  # the counter sees what an offloaded (not recomputed) stage saves each step
        assert all(offloaded[r][0] > 0 and len(set(offloaded[r])) == 1 for r in ranks) if off and not rc else True, (
            ranks, offloaded)
    return losses, sd, offloaded, layout


_PIPE2 = {"stages": 2, "spatial_parts": 1, "dp": 1, "replicas": 1, "micro_batches": 2, "schedule": "1f1b"}


def test_batchnorm_running_statistics_update_once_under_activation_checkpointing() -> None:
    """The case torch.utils.checkpoint got wrong: running statistics updated in the forward and again
    in the recompute."""
    compare("resnet_bn", 2, _PIPE2, Levers(checkpointing=True))


@pytest.mark.slow
def test_zero_bubble_defers_only_the_kept_stage() -> None:
    """zb: stage 1 recomputed (its W is empty), stage 0 offloaded with its weight gradients deferred."""
    compare("batch", 2, {**_PIPE2, "micro_batches": 3, "schedule": "zb"}, Levers(recompute=(1,), offload=(0,)))


@pytest.mark.parametrize("norm", [pytest.param("instance", marks=pytest.mark.slow), "group"])
def test_plan_recompute_pipeline(norm: str) -> None:
    compare(norm, 2, _PIPE2, Levers(recompute=(0, 1)))


def test_dropout_replays_its_masks() -> None:
    """Dropout in the last stage: the recompute draws the forward's masks and the generator advances
    once, so the run equals the same plan without recompute (each rank draws its own numbers, so a
    run with dropout is compared with its twin, not with one process)."""
    compare("batch+dropout", 2, {**_PIPE2, "schedule": "gpipe"}, Levers(recompute=(1,)), twin=True, one=False)


@pytest.mark.slow
def test_bf16_recompute_and_offload_equal_keeping() -> None:
    """Under autocast the recompute runs in the same autocast: the run equals the same plan in bf16
    without recompute or offload (autocast casts float32 models only; bf16 is not compared with
    one process)."""
    compare("batch+float32", 2, {**_PIPE2, "precision": "bf16"}, Levers(recompute=(0,), offload=(1,)), twin=True, one=False)


def test_offload_round_trips_exactly() -> None:
    """Both stages offloaded, the messages between them host staged."""
    compare("batch", 2, _PIPE2, Levers(offload=(0, 1)), staged=True)


@pytest.mark.slow
def test_recompute_one_stage_offload_the_other() -> None:
    compare("group", 2, _PIPE2, Levers(recompute=(1,), offload=(0,)))


def test_spatial_stage_recompute_with_halo_exchange() -> None:
    """The whole UNet on 2 tiles, InstanceNorm statistics over both: the recompute repeats the halo
    exchanges and the statistics' reductions on both tiles in the same order."""
    compare("monai_unet", 2, {"stages": 1, "spatial_parts": 2, "slice": "vertical", "micro_batches": 2, "dp": 1,
                              "replicas": 1, "schedule": "gpipe"}, Levers(recompute=(0,)))


@pytest.mark.slow
def test_spatial_batchnorm_stem_recompute_and_offload() -> None:
    """A BatchNorm stem on 2 tiles (statistics over both), recomputed; the pipeline stage after it offloaded."""
    compare("resnet_bn", 3, {"stages": 2, "spatial_parts": 2, "spatial_stages": 1, "slice": "horizontal",
                             "micro_batches": 2, "dp": 1, "replicas": 1, "schedule": "1f1b"},
            Levers(recompute=(0,), offload=(1,)))


@pytest.mark.slow
@pytest.mark.parametrize(("norm", "lv"), [("group", Levers(recompute=(0,))), ("instance", Levers(offload=(0,)))],
                         ids=["group-recompute", "instance-offload"])
def test_spatial_norm_stage(norm: str, lv: Levers) -> None:
    """GroupNorm recomputed, InstanceNorm offloaded, on 2 tiles (statistics over both)."""
    *_, layout = compare(norm, 3, {"stages": 2, "spatial_parts": 2, "spatial_stages": 1, "slice": "square",
                                   "micro_batches": 2, "dp": 1, "replicas": 1, "schedule": "1f1b"}, lv)
    assert layout[0][0] == 2, layout


def test_master_replicas_recompute() -> None:
    compare("batch", 2, {**_PIPE2, "replicas": 2, "schedule": "1f1b"}, Levers(recompute=(0, 1)), twin=True)


@pytest.mark.slow
def test_dp_recompute_and_offload() -> None:
    compare("batch", 4, {**_PIPE2, "dp": 2}, Levers(recompute=(0,), offload=(1,)), twin=True)


@pytest.mark.parametrize("net", [pytest.param(n, marks=pytest.mark.slow) for n in ("AttentionUnet2d", "DenseNet2d")])
def test_monai_activation_checkpointing_is_exact(net: str) -> None:
    """The nets that ended 0.55 (AttentionUnet) and 0.37 (DenseNet) relative away with
    activation_checkpointing=True on 2 ranks."""
    compare(net, 2, _PIPE2, Levers(checkpointing=True))
