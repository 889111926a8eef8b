"""The pipeline exactness harness: two small models, their seeded data, loss and Adam, the worker
that trains them with nowdl, the one-process reference and the comparison of the two.

``compare(name, gpus, cfg)`` trains ``STEPS`` Adam steps of model ``name`` ("resnet_bn" or
"monai_unet") on ``gpus`` gloo processes with ``nowdl.compile(..., **cfg)`` and asserts the
losses and parameters equal one process running the same micro-batches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import nowdl
from helpers.distributed import run_workers
from helpers.reference import train_reference

__all__ = ["LR", "STEPS", "adam", "compare", "make_batch", "make_loss", "make_model", "reference_run", "train_worker"]

STEPS = 3
LR = 1e-2


def make_model(name: str) -> nn.Module:
    """Test models without a bias directly before a norm layer: such a bias has a true gradient of
    zero, so it only sees float round-off (~1e-9), which Adam's g / (sqrt(v) + eps) turns into
    steps of about the learning rate: any two correct summation orders then disagree."""
    torch.manual_seed(0)
    if name == "monai_unet":
        from monai.networks.nets import UNet

        return UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1,
                    bias=False)
    if name == "resnet_bn":
        return nowdl.models.resnet(depth=8, version=1, num_classes=3, width=4, conv_bias=False)
    raise ValueError(name)


def make_batch(name: str, total: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``total`` seeded samples and targets of ``step`` for model ``name``."""
    g = torch.Generator().manual_seed(100 + step)
    if name == "monai_unet":
        return torch.randn(total, 1, 16, 16, generator=g), torch.randn(total, 2, 16, 16, generator=g)
    return torch.randn(total, 3, 16, 16, generator=g), torch.randint(0, 3, (total,), generator=g)


def make_loss(name: str) -> nn.Module:
    """The loss of model ``name``."""
    return nn.MSELoss() if name == "monai_unet" else nn.CrossEntropyLoss()


def adam(params: Any) -> torch.optim.Optimizer:
    """Adam at ``LR``."""
    return torch.optim.Adam(params, lr=LR)


def train_worker(rank: int, world: int, name: str, gpus: int, cfg: dict[str, Any], ckpt: str | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One rank: ``STEPS`` steps of ``name`` under ``nowdl.compile(**cfg)``; with ``ckpt``, also a
    resume from step 1 that must repeat the run. Returns the losses and the final state dict."""
    model = make_model(name)
    cm = nowdl.compile(model, gpus=gpus, spatial_parts=1, mode="estimate", optimizer=adam, loss_fn=make_loss(name),
                       cache=False, progress=False, timeout_s=60, **cfg)
    total = cfg["micro_batches"] * cfg.get("dp", 1) * cfg.get("replicas", 1)
    losses = []
    for step in range(STEPS):
        x, y = make_batch(name, total, step)
        losses.append(cm.train_step(x, y))
        if ckpt is not None and step == 0:
            cm.save_checkpoint(ckpt)
    if ckpt is not None:  # resume from step 1 and redo steps 1..: must give the same run
        cm2 = nowdl.compile(make_model(name), gpus=gpus, spatial_parts=1, mode="estimate", optimizer=adam,
                            loss_fn=make_loss(name), cache=False, progress=False, timeout_s=60, **cfg)
        cm2.load_checkpoint(ckpt, make_batch(name, total, 0)[0])
        again = [cm2.train_step(*make_batch(name, total, step)) for step in range(1, STEPS)]
        assert again == losses[1:], (again, losses[1:])
        sd2 = cm2.state_dict()
        sd1 = cm.state_dict()
        for k in sd1:
            assert torch.equal(sd1[k], sd2[k]), k
    return losses, cm.state_dict()


def reference_run(name: str, total: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same ``STEPS`` steps on one process (``train_reference``)."""
    model = make_model(name)
    return train_reference(model, adam(model.parameters()), make_loss(name), lambda step: make_batch(name, total, step), total,
                           STEPS)


def compare(name: str, gpus: int, cfg: dict[str, Any], *, ckpt: str | None = None, worker: Any = train_worker) -> None:
    """Train ``name`` on ``gpus`` processes with ``worker`` and assert losses and weights equal
    ``reference_run``'s (running statistics only when each stage has one copy)."""
    total = cfg["micro_batches"] * cfg.get("dp", 1) * cfg.get("replicas", 1)
    results = run_workers(worker, gpus, name, gpus, cfg, ckpt, timeout_s=240)
    ref_losses, ref_sd = reference_run(name, total)
    losses, sd = results[0]
    for r, (other_losses, _) in enumerate(results):
        assert other_losses == losses, f"rank {r} reports another loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    one_copy = cfg.get("dp", 1) == 1 and cfg.get("replicas", 1) == 1
    assert set(sd) == set(ref_sd)
    for k, ref in ref_sd.items():
        if not ref.is_floating_point() or (not one_copy and ("running" in k)):
            continue
        torch.testing.assert_close(sd[k], ref, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
