"""Dictionary samples (MONAI's ``{"image": ..., "label": ...}``) as the ``(x, y)`` pairs nowdl feeds.

``nowdl run --data package.module:callable --keys image,label``: the Dataset's samples are
dictionaries (MONAI's ``Dataset``/``CacheDataset`` with dictionary transforms return them; a
list of one dictionary, as ``RandCropByPosNegLabeld`` returns, takes its first). ``x`` is the
image as a float tensor (MONAI's ``MetaTensor`` as a plain tensor), ``y`` the label as an
integer tensor without its channel dim (``(1, *spatial)`` becomes ``(*spatial)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from nowdl.errors import NowdlError

__all__ = ["KeyedDataset", "parse_keys"]


def parse_keys(text: str) -> tuple[str, str]:
    """``"image,label"`` -> ``("image", "label")``.

    Raises:
        NowdlError: not two non-empty names.
    """
    keys = [k.strip() for k in str(text).split(",")]
    if len(keys) != 2 or not all(keys):
        raise NowdlError(f"--keys {text}: give the image key and the label key of the dictionary samples, "
                         "e.g. --keys image,label")
    return keys[0], keys[1]


def _plain(v: Any, what: str, where: str) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.as_subclass(torch.Tensor) if type(v) is not torch.Tensor else v
    if isinstance(v, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(v))
    raise NowdlError(f"{where}: the {what} is a {type(v).__name__}, not a tensor or array: end the transforms "
                     "with EnsureTyped (or ToTensord)")


class KeyedDataset(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``dataset``'s dictionary samples as ``(image, label)`` pairs (see the module docstring)."""

    def __init__(self, dataset: Any, keys: Sequence[str], name: str = "--data") -> None:
        self.dataset, self.keys, self.name = dataset, tuple(keys), name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        item = self.dataset[index]
        if isinstance(item, (list, tuple)) and item and isinstance(item[0], dict):
            item = item[0]
        where = f"sample {index} of {self.name}"
        if not isinstance(item, dict):
            raise NowdlError(f"{where} is a {type(item).__name__}, not a dictionary: drop --keys (the Dataset "
                             "returns (x, y) pairs) or return dictionaries")
        image_key, label_key = self.keys
        missing = [k for k in self.keys if k not in item]
        if missing:
            raise NowdlError(f"{where} has no key {missing[0]!r} (its keys: {', '.join(map(str, item))}): fix --keys")
        x = _plain(item[image_key], f"image {image_key!r}", where).float()
        y = _plain(item[label_key], f"label {label_key!r}", where)
        if y.dim() == x.dim() and y.shape[0] == 1:
            y = y[0]
        if y.is_floating_point():
            y = y.round()
        return x, y.long()
