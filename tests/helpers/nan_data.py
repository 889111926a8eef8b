"""Test helper (not a test module): a seeded Dataset one of whose samples is NaN.

``nowdl run --data helpers.nan_data:nan_data --data-args '{"nan_index": 5}'``: sample 5's image
is all NaN (a raster's nodata read as NaN, say); the others are N(0, 1), labels seeded by index.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

__all__ = ["NanData", "nan_data"]


class NanData(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, n: int, shape: tuple[int, ...], classes: int, nan_index: int) -> None:
        self.n, self.shape, self.classes, self.nan_index = n, shape, classes, nan_index

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(1000 + index)
        x = torch.randn(self.shape, generator=g)
        if index == self.nan_index:
            x = torch.full_like(x, float("nan"))
        return x, int(torch.randint(self.classes, (1,), generator=g))

    def describe(self, index: int) -> str:
        return f"tile_{index}.tif, window 0:16 x 0:16"


def nan_data(n: int = 64, shape: tuple[int, ...] = (3, 16, 16), classes: int = 3, nan_index: int = -1) -> NanData:
    """The dataset of ``--data helpers.nan_data:nan_data``."""
    return NanData(n, tuple(shape), classes, nan_index)
