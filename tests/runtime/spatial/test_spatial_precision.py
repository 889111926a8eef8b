"""bf16 and fp16 autocast on spatial stages: tiles train what one process trains under the same autocast.

Each case trains 2 Adam steps on 2 gloo ranks (the stage cut into 2 tiles) with ``precision=`` bf16
or fp16 and compares the losses with one process running the same micro-batches under
``torch.autocast`` of that dtype (the loss on the float32 output, as the engine computes it).
Tolerance: relative 2e-2 on every loss. Tiles compute each output pixel from the same inputs as
the unsplit op, but convolutions on a window sum in another order, and a reduced-precision
result is rounded to 8 (bf16) or 11 (fp16) mantissa bits, so a pixel may differ by one unit in
the last place (2**-8 = 0.4% relative for bf16). Measured: MONAI's 3D UNet 1.6e-3 (bf16) and
1.8e-3 (fp16), the others 0 to 1.2e-4. float32 runs stay exact (the exactness tests in
tests/runtime/test_spatial_runtime.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.distributed import run_workers
from torch import nn

import nowdl

STEPS = 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PlainNet(nn.Module):
    """No norms: conv, max pool, avg pool, bilinear upsample, transposed conv, channel cat."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        conv, convt = (nn.Conv2d, nn.ConvTranspose2d) if dims == 2 else (nn.Conv3d, nn.ConvTranspose3d)
        mp, ap = (nn.MaxPool2d, nn.AvgPool2d) if dims == 2 else (nn.MaxPool3d, nn.AvgPool3d)
        self.c1, self.c2 = conv(1, 4, 3, padding=1), conv(4, 4, 3, padding=1)
        self.mp, self.ap = mp(2), ap(3, 1, 1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear" if dims == 2 else "trilinear")
        self.ct = convt(4, 4, 2, stride=2)
        self.c3 = conv(12, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.c1(x))
        b = self.ap(self.c2(self.mp(a)))
        return self.c3(torch.cat([a, self.up(b), self.ct(b)], dim=1))


class NormNet(nn.Module):
    """BatchNorm, GroupNorm and InstanceNorm between convs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                                  nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.GroupNorm(2, 4), nn.ReLU(),
                                  nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.InstanceNorm2d(4, affine=True),
                                  nn.ReLU(), nn.Conv2d(4, 2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _make(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    torch.manual_seed(0)
    if name == "plain2d":
        return PlainNet(2), (1, 16, 12)
    if name == "plain3d":
        return PlainNet(3), (1, 8, 8, 6)
    if name == "norms2d":
        return NormNet(), (1, 16, 12)
    if name == "monai_unet3d":  # InstanceNorm (MONAI's default) in 3D
        from monai.networks.nets import UNet

        return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8), strides=(2,), num_res_units=1,
                    bias=False), (1, 8, 8, 8)
    if name == "unet":  # the built-in UNet, no norms
        return nowdl.models.unet(1, 2, depth=2, base_width=4), (1, 16, 16)
    raise ValueError(name)


def _data(name: str, total: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = _make(name)[1]
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(total, *shape, generator=g), torch.randn(total, 2, *shape[1:], generator=g)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def _worker(rank: int, world: int, name: str, precision: str, slice_: str) -> list[float]:
    model, _ = _make(name)
    cm = nowdl.compile(model, gpus=world, mode="estimate", optimizer=_adam, loss_fn=nn.MSELoss(), cache=False,
                       progress=False, timeout_s=90, precision=precision, stages=1, spatial_parts=world,
                       slice=slice_, micro_batches=2, dp=1, replicas=1, schedule="gpipe")
    losses = [cm.train_step(*_data(name, 2, step)) for step in range(STEPS)]
    plan = cm._trainer.plan
    assert plan is not None and plan.stages[0].parts == world, [s.parts for s in plan.stages]
    return losses


def _reference(name: str, precision: str) -> list[float]:
    model, _ = _make(name)
    opt = _adam(model.parameters())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        for step in range(STEPS):
            x, y = _data(name, 2, step)
            opt.zero_grad()
            acc = 0.0
            for xc, yc in zip(x.chunk(2), y.chunk(2), strict=True):
                with torch.autocast("cpu", dtype=DTYPES[precision]):
                    pred = model(xc)
                loss = nn.MSELoss()(pred.float(), yc)
                (loss / 2).backward()
                acc += float(loss.detach())
            opt.step()
            out.append(acc / 2)
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize(("name", "slice_"), [("plain2d", "vertical"), ("plain3d", "depth"), ("norms2d", "horizontal"),
                                               ("monai_unet3d", "depth"), ("unet", "vertical")])
def test_reduced_precision_on_tiles_matches_one_process(name: str, slice_: str, precision: str) -> None:
    losses = run_workers(_worker, 2, name, precision, slice_, timeout_s=240)
    assert losses[0] == losses[1], "the ranks report different losses"
    ref = _reference(name, precision)
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref), rtol=2e-2, atol=0.0)
