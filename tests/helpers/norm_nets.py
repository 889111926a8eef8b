"""Test helper (not a test module): nets whose ops depend on the whole image, for the statistics-pass tests.

Each is seeded and in eval mode; ``reference`` in ``helpers.predict_models`` gives its
one-process whole-image forward.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NormNet", "GroupNet", "SENet", "FunctionalBN", "AlignedUp", "monai_unet", "norm_net", "stream_worker"]


class NormNet(nn.Module):
    """Three norms of one kind in a chain at two resolutions, one fed by a skip around another:
    forward levels 1, 2, 3 and backward levels 3, 2, 1 ([Note: sequential norms])."""

    def __init__(self, kind: str) -> None:
        super().__init__()

        def norm(c: int) -> nn.Module:
            if kind == "bn":
                return nn.BatchNorm2d(c)
            if kind == "in":
                return nn.InstanceNorm2d(c, affine=True, track_running_stats=True)
            return nn.GroupNorm(2, c)

        self.c1, self.n1 = nn.Conv2d(1, 4, 3, padding=1, bias=False), norm(4)  # a bias before a norm: no gradient
        self.c2, self.n2 = nn.Conv2d(4, 4, 3, stride=2, padding=1, bias=False), norm(4)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.c3, self.n3 = nn.Conv2d(8, 4, 3, padding=1, bias=False), norm(4)
        self.head = nn.Conv2d(4, 2, 1)
        for m in (self.n1, self.n2, self.n3):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.n1(self.c1(x)))
        b = torch.relu(self.n2(self.c2(a)))
        return self.head(torch.relu(self.n3(self.c3(torch.cat([a, self.up(b)], 1)))))


class GroupNet(nn.Module):
    """Two GroupNorms in a chain around a pooling and an upsampling: two statistics passes."""

    def __init__(self, in_ch: int = 1, classes: int = 2) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(in_ch, 8, 3, padding=1)
        self.n1 = nn.GroupNorm(2, 8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.n2 = nn.GroupNorm(4, 8, affine=False)
        self.c3 = nn.Conv2d(16, classes, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.n1(self.c1(x)))
        b = F.relu(self.n2(self.c2(F.max_pool2d(a, 2))))
        return self.c3(torch.cat([a, F.interpolate(b, scale_factor=2.0)], 1))


class SENet(nn.Module):
    """A conv, a squeeze-and-excitation gate (adaptive average pooling), a 3x2 adaptive average
    (or max: not on tiles) pooling's spatial mean and an InstanceNorm after them: pools in pass 1,
    the norm in pass 2."""

    def __init__(self, in_ch: int = 1, classes: int = 2, grid: str = "avg") -> None:
        super().__init__()
        self.c1 = nn.Conv2d(in_ch, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1)
        self.grid = nn.AdaptiveAvgPool2d((3, 2)) if grid == "avg" else nn.AdaptiveMaxPool2d((3, 2))
        self.norm = nn.InstanceNorm2d(8, affine=True)
        self.c2 = nn.Conv2d(8, classes, 3, padding=1)
        nn.init.uniform_(self.norm.weight, 0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.c1(x))
        gate = torch.sigmoid(self.fc2(F.relu(self.fc1(self.pool(a)))))
        g = self.grid(a).mean((2, 3), keepdim=True)
        return self.c2(F.relu(self.norm(a * gate + g)))


class FunctionalBN(nn.Module):
    """BatchNorm in eval mode written as ``F.batch_norm(training=False)``: per-channel affine, exact."""

    def __init__(self, in_ch: int = 1, classes: int = 2) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(in_ch, 8, 3, padding=1)
        self.register_buffer("mean", torch.linspace(-0.2, 0.2, 8))
        self.register_buffer("var", torch.linspace(0.5, 1.5, 8))
        self.c2 = nn.Conv2d(8, classes, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(F.relu(F.batch_norm(self.c1(x), self.mean, self.var, training=False)))


class AlignedUp(nn.Module):
    """A UNet level whose upsampling has ``align_corners=True``: it maps pixels by the window's
    extent, which no statistics pass can fix (and a GroupNorm, which one can)."""

    def __init__(self, in_ch: int = 1, classes: int = 2) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(in_ch, 8, 3, padding=1)
        self.n1 = nn.GroupNorm(2, 8)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.c2 = nn.Conv2d(16, classes, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.n1(self.c1(x)))
        return self.c2(torch.cat([a, self.up(F.avg_pool2d(a, 2))], 1))


def monai_unet(dims: int = 2, in_ch: int = 1) -> nn.Module:
    """MONAI's UNet (8, 16, 32), strides 2, 2, one residual unit: InstanceNorm as MONAI sets it."""
    from monai.networks.nets import UNet

    return UNet(spatial_dims=dims, in_channels=in_ch, out_channels=2, channels=(8, 16, 32), strides=(2, 2),
                num_res_units=1)


_NETS: dict[str, Any] = {"group": GroupNet, "se": SENet, "se-max": lambda: SENet(grid="max"), "fbn": FunctionalBN,
                         "aligned": AlignedUp, "monai": monai_unet}


def norm_net(name: str, seed: int = 0) -> nn.Module:
    """The seeded net ``name`` (group, se, se-max, fbn, aligned, monai) in eval mode."""
    torch.manual_seed(seed)
    return _NETS[name]().eval()  # type: ignore[no-any-return]


def stream_worker(rank: int, world: int, names: list[str], source: str, out: str, pins: dict[str, Any],
                  window: tuple[int, ...]) -> list[tuple[str, np.ndarray | None]]:
    """Compile each net of ``names`` on ``world`` ranks with ``pins`` and predict ``source`` in
    windows of ``window`` into ``out/<name>.zarr``: rank 0's summary line and output (None
    elsewhere), per net."""
    import zarr

    import nowdl

    got = []
    for name in names:
        cm = nowdl.compile(norm_net(name), gpus=world, progress=False, cache=False, **pins)
        line = cm.predict(source, f"{out}/{name}.zarr", window=window).line()
        got.append((line, np.asarray(zarr.open_array(f"{out}/{name}.zarr/0")[:]) if rank == 0 else None))
    return got
