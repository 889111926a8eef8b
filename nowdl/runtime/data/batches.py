"""Global batches for ``nowdl run``: seeded synthetic data and image folders."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nowdl.errors import NowdlError

__all__ = ["SyntheticData", "ImageFolderData"]

_IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".tif", ".tiff")
_ARRAY_EXTS = (".npy",)


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))


@dataclass
class SyntheticData:
    """Seeded random images (standard normal) and integer labels, a function of (seed, step).

    ``label_shape`` is ``()`` for classification, the output's spatial shape for segmentation.
    """

    sample_shape: tuple[int, ...]
    label_shape: tuple[int, ...]
    num_classes: int
    seed: int = 0

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(self.seed, step)
        x = torch.randn((batch_size, *self.sample_shape), generator=g)
        y = torch.randint(0, self.num_classes, (batch_size, *self.label_shape), generator=g)
        return x, y


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        return None
    return Image


class ImageFolderData:
    """``root/<class>/<file>`` samples with the class index as label, resized to ``sample_shape``.

    Raises:
        NowdlError: the folder is missing or has no class subfolders or no samples, a sample has
            the wrong channel count, or image files need Pillow and it is not installed.
    """

    def __init__(self, root: str | os.PathLike[str], sample_shape: Sequence[int], seed: int = 0) -> None:
        self.root = Path(root)
        self.sample_shape = tuple(int(d) for d in sample_shape)
        self.seed = seed
        layout = f"lay it out as {self.root}/<class name>/<sample> (one subfolder per class)"
        if not self.root.exists():
            raise NowdlError(f"--data imagefolder:{self.root}: the folder does not exist; {layout}")
        if not self.root.is_dir():
            raise NowdlError(f"--data imagefolder:{self.root} is not a folder; {layout}")
        self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if not self.classes:
            raise NowdlError(f"--data imagefolder:{self.root} has no class subfolders; {layout}")
        exts = _IMAGE_EXTS + _ARRAY_EXTS
        self.samples: list[tuple[Path, int]] = []
        for label, name in enumerate(self.classes):
            files = sorted(f for f in (self.root / name).rglob("*")
                           if f.is_file() and f.suffix.lower() in exts and not f.name.startswith("."))
            self.samples.extend((f, label) for f in files)
        if not self.samples:
            raise NowdlError(f"--data imagefolder:{self.root}: no {'/'.join(exts)} files in its class subfolders "
                             f"({', '.join(self.classes[:5])}{', ...' if len(self.classes) > 5 else ''}); {layout}")
        images = [f for f, _ in self.samples if f.suffix.lower() in _IMAGE_EXTS]
        if images and _pil() is None:
            raise NowdlError(
                f"--data imagefolder:{self.root} holds image files (e.g. {images[0]}) but Pillow is not "
                "installed: `pip install pillow` (nowdl does not depend on it), or convert the images "
                "to .npy arrays shaped (C, H, W)"
            )
        if images and len(self.sample_shape) != 3:
            raise NowdlError(f"image files are 2D but the sample shape {'x'.join(map(str, self.sample_shape))} "
                             "(--input without its batch) is not CxHxW: use .npy arrays (C, D, H, W) for 3D models")
        self.sample(0)  # fail now, not mid-run, on a sample of the wrong shape

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """``(sample, class index)``: a map-style Dataset for ``nowdl.runtime.data.loader``."""
        return self.sample(index), self.samples[index][1]

    def sample(self, index: int) -> torch.Tensor:
        """Sample ``index`` as a float tensor shaped ``sample_shape`` in ``[0, 1]`` (uint8 inputs)."""
        path, _ = self.samples[index]
        t = _load_array(path) if path.suffix.lower() in _ARRAY_EXTS else _load_image(path, self.sample_shape[0])
        c, spatial = self.sample_shape[0], self.sample_shape[1:]
        if t.ndim == len(spatial):
            t = t.unsqueeze(0)
        if t.ndim != len(self.sample_shape) or t.shape[0] != c:
            raise NowdlError(f"{path} has shape {tuple(t.shape)} but --input is {'x'.join(map(str, self.sample_shape))} "
                             f"(channels first): store samples as ({c}, {', '.join('..' for _ in spatial)})")
        return _fit(t, spatial)

    def _order(self, epoch: int) -> list[int]:
        return torch.randperm(len(self.samples), generator=_generator(self.seed, -1 - epoch)).tolist()

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.samples)
        xs, ys = [], []
        orders: dict[int, list[int]] = {}
        for k in range(step * batch_size, (step + 1) * batch_size):
            epoch, pos = divmod(k, n)
            if epoch not in orders:
                orders[epoch] = self._order(epoch)
            idx = orders[epoch][pos]
            xs.append(self.sample(idx))
            ys.append(self.samples[idx][1])
        return torch.stack(xs), torch.tensor(ys, dtype=torch.long)


def _scaled(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t.float() / 255.0
    if t.dtype == torch.bool:
        return t.float()
    return t.float()


def _load_array(path: Path) -> torch.Tensor:
    import numpy as np

    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise NowdlError(f"cannot read {path} as a .npy array: {e}") from None
    return _scaled(torch.from_numpy(np.ascontiguousarray(arr)))


def _load_image(path: Path, channels: int) -> torch.Tensor:
    import numpy as np

    image_mod = _pil()
    modes = {1: "L", 3: "RGB", 4: "RGBA"}
    if channels not in modes:
        raise NowdlError(f"{path}: images give 1, 3 or 4 channels but --input has {channels}: use .npy arrays")
    try:
        with image_mod.open(path) as img:
            arr = np.asarray(img.convert(modes[channels]))
    except OSError as e:
        raise NowdlError(f"cannot read {path} as an image: {e}") from None
    t = torch.from_numpy(np.ascontiguousarray(arr))
    t = t.unsqueeze(0) if t.ndim == 2 else t.permute(2, 0, 1)
    return _scaled(t)


def _fit(t: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """Resize ``t`` (C, *spatial) so it covers ``size`` keeping its aspect, then centre-crop to it."""
    have = tuple(t.shape[1:])
    if have != tuple(size):
        scale = max(s / h for s, h in zip(size, have, strict=True))
        new = [max(s, round(h * scale)) for s, h in zip(size, have, strict=True)]
        if new != list(have):
            mode = {1: "linear", 2: "bilinear", 3: "trilinear"}.get(len(size), "nearest")
            kw: dict[str, Any] = {} if mode == "nearest" else {"align_corners": False}
            t = nn.functional.interpolate(t.unsqueeze(0), size=new, mode=mode, **kw).squeeze(0)
        starts = [(n - s) // 2 for n, s in zip(t.shape[1:], size, strict=True)]
        t = t[(slice(None), *(slice(a, a + s) for a, s in zip(starts, size, strict=True)))]
    return t.contiguous()

