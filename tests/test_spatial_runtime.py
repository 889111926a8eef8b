"""Whole-model exactness of spatial stages: tiles across ranks train exactly what one device trains.

Each case trains 3 Adam steps with 2-6 gloo processes (one per rank of the plan) through
``nowdl.compile(...).train_step`` and compares the loss of every step and every parameter (and
BatchNorm running statistics when there is one copy of each stage) with one process running the
same micro-batches with gradient accumulation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from distributed import run_workers
from torch import nn

import nowdl

STEPS = 3
LR = 1e-2


class ConvNet(nn.Module):
    """No norms: runs of conv/ReLU/pool that halo fusion can fuse, then a classifier head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.a1 = nn.ReLU()
        self.c2 = nn.Conv2d(4, 4, 3, padding=2, dilation=2)
        self.a2 = nn.ReLU()
        self.p = nn.MaxPool2d(3, 2, 1)
        self.c3 = nn.Conv2d(4, 6, 3, stride=2, padding=1)
        # a heavy head: balancing memory keeps every conv in the spatial stage
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(96, 2048), nn.ReLU(),
                                  nn.Linear(2048, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.c3(self.p(self.a2(self.c2(self.a1(self.c1(x)))))))


def _make(name: str) -> nn.Module:
    """Models without a bias right before a norm (see tests/test_runtime.py: Adam amplifies the
    round-off of such zero-gradient biases)."""
    torch.manual_seed(0)
    if name == "monai_unet":
        from monai.networks.nets import UNet

        return UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1,
                    bias=False)
    if name == "monai_unet3d":
        from monai.networks.nets import UNet

        return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8), strides=(2,), num_res_units=0,
                    bias=False)
    if name == "resnet_bn":
        return nowdl.models.resnet(depth=8, version=1, num_classes=3, width=4, conv_bias=False)
    if name == "convnet":  # float64: fused runs recompute overlaps in another summation order, and Adam
        return ConvNet().double()  # turns float32 round-off on near-zero gradients into visible steps
    raise ValueError(name)


_SHAPES = {"monai_unet": (1, 16, 16), "monai_unet3d": (1, 8, 8, 8), "resnet_bn": (3, 17, 15), "convnet": (3, 15, 13)}


def _data(name: str, total: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(total, *_SHAPES[name], generator=g, dtype=torch.float64 if name == "convnet" else torch.float32)
    if name.startswith("monai"):
        return x, torch.randn(total, 2, *_SHAPES[name][1:], generator=g)
    return x, torch.randint(0, 3, (total,), generator=g)


def _loss(name: str) -> nn.Module:
    return nn.MSELoss() if name.startswith("monai") else nn.CrossEntropyLoss()


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)


def _total(cfg: dict[str, Any]) -> int:
    return int(cfg["micro_batches"] * cfg.get("dp", 1) * cfg.get("replicas", 1))


def _worker(rank: int, world: int, name: str, cfg: dict[str, Any], tiled_input: bool
            ) -> tuple[list[float], dict[str, torch.Tensor], list[tuple[int, list[int], int]]]:
    opts = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cm = nowdl.compile(_make(name), gpus=world, mode="estimate", optimizer=_adam, loss_fn=_loss(name), cache=False,
                       progress=False, timeout_s=90, **opts)
    losses = []
    for step in range(STEPS):
        x, y = _data(name, _total(cfg), step)
        if tiled_input:  # every rank reads only its tile, from an array on disk
            path = f"{cfg['_dir']}/x{step}.npy"
            if rank == 0:
                np.save(path, x.numpy())
            torch.distributed.barrier()
            tiles = nowdl.TiledInput.from_array(np.load(path, mmap_mode="r"), dtype=x.dtype)
            losses.append(cm.train_step(tiles, y))
        else:
            losses.append(cm.train_step(x, y))
    plan = cm._trainer.plan
    assert plan is not None
    return losses, cm.state_dict(), [(s.parts, s.grid, len(s.fused)) for s in plan.stages]


def _reference(name: str, total: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _make(name).train()
    opt = _adam(model.parameters())
    loss_fn = _loss(name)
    losses = []
    for step in range(STEPS):
        x, y = _data(name, total, step)
        opt.zero_grad(set_to_none=True)
        acc = 0.0
        for xc, yc in zip(x.chunk(total), y.chunk(total), strict=True):
            loss = loss_fn(model(xc), yc)
            (loss / total).backward()
            acc += float(loss.detach())
        opt.step()
        losses.append(acc / total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _compare(name: str, world: int, cfg: dict[str, Any], *, tiled_input: bool = False
             ) -> list[tuple[int, list[int], int]]:
    results = run_workers(_worker, world, name, cfg, tiled_input, timeout_s=300)
    ref_losses, ref_sd = _reference(name, _total(cfg))
    losses, sd, layout = results[0]
    for r, res in enumerate(results):
        assert res[0] == losses, f"rank {r} reports another loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    one_copy = cfg.get("dp", 1) == 1 and cfg.get("replicas", 1) == 1
    assert set(sd) == set(ref_sd)
    for k, ref in ref_sd.items():
        if not ref.is_floating_point() or (not one_copy and "running" in k):
            continue
        torch.testing.assert_close(sd[k], ref, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert any(p > 1 for p, _, _ in layout), f"the plan has no spatial stage: {layout}"
    return layout


def test_resnet_spatial_stem_then_pipeline_uneven_tiles() -> None:
    """A 17x15 image cut 2x1 (uneven tiles: 9 + 8 rows), BatchNorm statistics over both tiles."""
    layout = _compare("resnet_bn", 3, {"stages": 2, "spatial_parts": 2, "spatial_stages": 1, "slice": "horizontal",
                                       "micro_batches": 2, "dp": 1, "replicas": 1, "schedule": "1f1b"})
    assert [(p, g) for p, g, _ in layout] == [(2, [2, 1]), (1, [])]


def test_monai_unet_spatial_encoder_and_decoder_with_tiled_skips() -> None:
    """Encoder and mirrored decoder spatial (2 tiles each), the bottom a pipeline stage."""
    layout = _compare("monai_unet", 5, {"stages": 3, "spatial_parts": 2, "spatial_stages": 1, "slice": "vertical",
                                        "micro_batches": 2, "dp": 1, "replicas": 1, "schedule": "1f1b"})
    assert [p for p, _, _ in layout] == [2, 1, 2]


def test_monai_unet_fully_spatial_square() -> None:
    """The whole UNet on 2x2 tiles; the loss is computed on the gathered output."""
    layout = _compare("monai_unet", 4, {"stages": 1, "spatial_parts": 4, "slice": "square", "micro_batches": 2,
                                        "dp": 1, "replicas": 1, "schedule": "gpipe"})
    assert [(p, g) for p, g, _ in layout] == [(4, [2, 2])]


def test_spatial_with_master() -> None:
    _compare("resnet_bn", 4, {"stages": 2, "spatial_parts": 2, "spatial_stages": 1, "slice": "vertical",
                              "micro_batches": 2, "dp": 1, "replicas": 2, "schedule": "1f1b"})


def test_halo_fusion_forced_through_the_engine_and_tiled_input(tmp_path: Any) -> None:
    """Forced fusion (the seeds' --fused-layers) of conv-relu-conv-relu-pool-conv, fed from disk tiles."""
    layout = _compare("convnet", 3, {"stages": 2, "spatial_parts": 2, "spatial_stages": 1, "slice": "square",
                                     "micro_batches": 2, "dp": 1, "replicas": 1, "schedule": "1f1b",
                                     "halo_fusion": 4, "_dir": str(tmp_path)}, tiled_input=True)
    assert layout[0][2] >= 1, f"no fused chain in the spatial stage: {layout}"


def test_3d_volume_depth_slices() -> None:
    _compare("monai_unet3d", 2, {"stages": 1, "spatial_parts": 2, "slice": "depth", "micro_batches": 1, "dp": 1,
                                 "replicas": 1, "schedule": "gpipe"})


@pytest.mark.slow
def test_spatial_times_data_parallel() -> None:
    _compare("resnet_bn", 6, {"stages": 2, "spatial_parts": 2, "spatial_stages": 1, "slice": "square",
                              "micro_batches": 2, "dp": 2, "replicas": 1, "schedule": "1f1b"})


@pytest.mark.slow
def test_different_parts_for_successive_spatial_stages() -> None:
    """Stage 0 on 3 tiles, stage 1 on 2 (tiles re-cut between them), then a plain stage."""
    layout = _compare("resnet_bn", 6, {"stages": 3, "spatial_parts": [3, 2], "slice": "vertical", "micro_batches": 2,
                                       "dp": 1, "replicas": 1, "schedule": "1f1b"})
    assert [p for p, _, _ in layout] == [3, 2, 1]
