"""Small models shared by the profiler tests."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SmallNet", "TinyUNet", "block"]


def block(cin: int, cout: int) -> nn.Sequential:
    """conv-bn-relu twice."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
    )


class SmallNet(nn.Module):
    """conv / bn / relu / pool / linear on 32x32 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(x, 1))


class TinyUNet(nn.Module):
    """A UNet with ``depth`` levels, torch.cat skips and transposed-conv upsampling."""

    def __init__(self, depth: int = 2, base: int = 4, cin: int = 1, cout: int = 2) -> None:
        super().__init__()
        chans = [base * 2**i for i in range(depth + 1)]
        self.downs = nn.ModuleList()
        c = cin
        for ch in chans[:-1]:
            self.downs.append(block(c, ch))
            c = ch
        self.pool = nn.MaxPool2d(2)
        self.bottom = block(chans[-2], chans[-1])
        self.ups = nn.ModuleList()
        self.decs = nn.ModuleList()
        for i in range(depth - 1, -1, -1):
            self.ups.append(nn.ConvTranspose2d(chans[i + 1], chans[i], 2, stride=2))
            self.decs.append(block(2 * chans[i], chans[i]))
        self.head = nn.Conv2d(chans[0], cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for down in self.downs:
            x = down(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottom(x)
        for up, dec, skip in zip(self.ups, self.decs, reversed(skips), strict=True):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.head(x)
