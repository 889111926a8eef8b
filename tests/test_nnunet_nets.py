"""nnU-Net's own networks (dynamic_network_architectures): PlainConvUNet in 3D with InstanceNorm
trains exactly on sequential tiles, with the norms' statistics in passes and layer-wise from host
memory, against one process (float64, 3 Adam steps, every parameter and buffer to 1e-9).

The convs have no bias (``conv_bias=False``): nnU-Net's default bias before each InstanceNorm gets
a zero gradient up to rounding, which Adam turns into steps that differ with the summation order
(1e-9 after 3 steps) while changing nothing the net computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.reference import train_reference
from torch import nn

import nowdl

unet = pytest.importorskip("dynamic_network_architectures.architectures.unet")

STEPS = 3
ONE = {"stages": 1, "spatial_parts": 1, "micro_batches": 1, "dp": 1, "replicas": 1}


def _make() -> nn.Module:
    """nnU-Net's 3d_fullres PlainConvUNet, three stages of 4, 8, 16 features (conv-InstanceNorm-LeakyReLU)."""
    torch.manual_seed(0)
    return unet.PlainConvUNet(
        input_channels=1, n_stages=3, features_per_stage=(4, 8, 16), conv_op=nn.Conv3d, kernel_sizes=3,
        strides=(1, 2, 2), n_conv_per_stage=2, num_classes=2, n_conv_per_stage_decoder=2, conv_bias=False,
        norm_op=nn.InstanceNorm3d, norm_op_kwargs={"eps": 1e-5, "affine": True}, nonlin=nn.LeakyReLU,
        nonlin_kwargs={"inplace": True}).double()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return (torch.randn(1, 1, 16, 16, 16, generator=g, dtype=torch.float64),
            torch.randn(1, 2, 16, 16, 16, generator=g, dtype=torch.float64))


def _adam(params: object) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", ["passes", "layerwise"])
def test_plain_conv_unet_3d_on_sequential_tiles_is_exact(schedule: str, tmp_path: Path) -> None:
    cm = nowdl.compile(_make(), gpus=1, mode="estimate", optimizer=_adam, loss_fn=nn.MSELoss(), cache=False,
                       progress=False, **ONE)
    d = json.loads(cm.plan(*_data(0)[:1], target=_data(0)[1]).to_json())
    d["stages"][0].update(tiles_per_gpu=4, norm_schedule=schedule)
    (tmp_path / "plan.json").write_text(json.dumps(d))
    cm = nowdl.compile(_make(), plan=str(tmp_path / "plan.json"), mode="estimate", optimizer=_adam,
                       loss_fn=nn.MSELoss(), cache=False, progress=False)
    losses = [cm.train_step(*_data(step)) for step in range(STEPS)]
    (tiled,) = cm._trainer.engine.tiled.values()
    assert tiled.sequential is not None and len(tiled.sequential.norms) == 10  # every InstanceNorm on 4 sub-tiles
    assert (tiled.sequential.host_meter[1] > 0) == (schedule == "layerwise")  # the pinned schedule ran
    ref = _make()
    ref_losses, ref_sd = train_reference(ref, _adam(ref.parameters()), nn.MSELoss(), _data, 1, STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-9, atol=1e-12)
    sd = cm.state_dict()
    for k, v in ref_sd.items():
        torch.testing.assert_close(sd[k], v, rtol=1e-9, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")
