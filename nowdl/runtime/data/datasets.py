"""Datasets for training on large images: seeded random crops of image files, with mask crops.

``CropDataset(images, masks, (C, H, W))[i]`` is crop ``i``: an image and an origin drawn from
``(seed, i)``, read from disk by region (only that crop), its pixels made the model's input by
[Note: input values] (``pixels``: dtype scaling, ``normalize``, nodata as 0 with the ignored
label ``IGNORE_INDEX``). Given a tile of the crop to read
(``lazy_batch``), a rank of a spatial stage reads only its tile: the batch is a
:class:`~nowdl.runtime.spatial.tiles.TiledInput` and the engine asks for this rank's window.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from nowdl.errors import NowdlError
from nowdl.models.resolve import import_callable
from nowdl.runtime.data.pixels import (
    IGNORE_INDEX,
    Normalize,
    invalid,
    labels,
    may_have_nodata,
    pixels,
)
from nowdl.runtime.data.readers import ImageArray, ReadCounter
from nowdl.runtime.spatial.tiles import TiledInput

__all__ = ["CropDataset", "check_masks", "check_sample", "dataset_from_callable", "label_loss"]


class CropDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Seeded random crops shaped ``sample_shape`` of large images (the whole image if it is that size).

    Args:
        images: the images (``nowdl.runtime.data.readers.open_images``).
        masks: one integer mask per image, of the image's spatial shape (None: no labels; ``y`` is 0).
        sample_shape: ``(C, *spatial)`` of one crop (the model's input without the batch).
        seed: crop origins are a function of ``(seed, index)``.
        crops: crops per image per epoch (default: as many as would tile the image).
        normalize: per-band mean and std applied to the scaled pixels (None: none).

    Raises:
        NowdlError: channels that differ from ``sample_shape`` (or ``normalize``'s bands), an image smaller than the crop, a mask
            whose shape differs from its image's, or a different number of masks and images.
    """

    def __init__(self, images: Sequence[ImageArray], masks: Sequence[ImageArray] | None,
                 sample_shape: Sequence[int], *, seed: int = 0, crops: int | None = None,
                 normalize: Normalize | None = None) -> None:
        self.images, self.masks = list(images), None if masks is None else list(masks)
        self.sample_shape = tuple(int(d) for d in sample_shape)
        self.seed = seed
        self.normalize = normalize
        if normalize is not None:
            normalize.check(self.sample_shape[0], f"the data ({self.images[0].path})")
        self.counter = ReadCounter()
        size = "x".join(map(str, self.sample_shape))
        for im in self.images:
            if im.shape[0] != self.sample_shape[0]:
                raise NowdlError(f"{im.path} has {im.shape[0]} channel(s) but the sample shape {size} (--input "
                                 f"without its batch) has {self.sample_shape[0]}: fix --input")
            if any(s < c for s, c in zip(im.spatial, self.sample_shape[1:], strict=True)):
                raise NowdlError(f"{im.path} is {'x'.join(map(str, im.spatial))}, smaller than the crop {size} (--input "
                                 "without its batch): "
                                 "use a smaller --input or a larger image (or a lower pyramid level)")
        if self.masks is not None:
            check_masks(self.images, self.masks, "--labels")
        if crops is None:
            big = max(math.prod(im.spatial) for im in self.images)
            crops = max(1, big // math.prod(self.sample_shape[1:]))
        self.crops = crops

    def __len__(self) -> int:
        return len(self.images) * self.crops

    def origin(self, index: int) -> tuple[int, tuple[int, ...]]:
        """(image, crop start per spatial dim) of crop ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"crop {index} of a dataset of {len(self)}")
        im = index % len(self.images)
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + index) % (2**63))
        starts = tuple(int(torch.randint(0, s - c + 1, (1,), generator=g))
                       for s, c in zip(self.images[im].spatial, self.sample_shape[1:], strict=True))
        return im, starts

    def _region(self, starts: Sequence[int], bounds: Sequence[tuple[int, int]] | None) -> list[tuple[int, int]]:
        b = bounds if bounds is not None else [(0, c) for c in self.sample_shape[1:]]
        return [(s + lo, s + hi) for s, (lo, hi) in zip(starts, b, strict=True)]

    def read(self, index: int, bounds: Sequence[tuple[int, int]] | None = None, *, mask: bool = False) -> torch.Tensor:
        """Crop ``index`` (or its window ``bounds``, relative to the crop): pixels ``(C, ...)`` or a mask ``(...)``."""
        im, starts = self.origin(index)
        region = self._region(starts, bounds)
        image = self.images[im]
        if mask:
            if self.masks is None:
                return torch.zeros([hi - lo for lo, hi in region], dtype=torch.long)
            bad = None
            if may_have_nodata(image.dtype, image.nodata):  # nodata pixels of the image: ignored labels
                bad = invalid(image.read(region, self.counter), image.nodata)
            return labels(self.masks[im].read(region, self.counter)[0], self.masks[im].nodata, bad)
        return pixels(image.read(region, self.counter), image.nodata, self.normalize)

    def band_stats(self, samples: int = 16) -> Normalize:
        """Per-band mean and std of the dtype-scaled pixels of ``samples`` crops spread evenly over
        the dataset (nodata pixels left out; float64 sums, so every rank gets the same values).

        Raises:
            NowdlError: every pixel of the sample is nodata.
        """
        n = min(samples, len(self))
        total = torch.zeros(self.sample_shape[0], dtype=torch.float64)
        squares, count = total.clone(), 0
        for i in sorted({k * len(self) // n for k in range(n)}):
            im, starts = self.origin(i)
            raw = self.images[im].read(self._region(starts, None), self.counter)
            x = pixels(raw).double().flatten(1)
            bad = invalid(raw, self.images[im].nodata) if may_have_nodata(raw.dtype, self.images[im].nodata) else None
            if bad is not None:
                x = x[:, ~torch.from_numpy(bad).flatten()]
            total, squares, count = total + x.sum(1), squares + (x * x).sum(1), count + x.shape[1]
        if count == 0:
            raise NowdlError(f"--normalize auto: every pixel of {n} crop(s) of {self.images[0].path} is nodata: give "
                             "--normalize mean=...,std=... or data with valid pixels")
        mean = total / count
        std = (squares / count - mean * mean).clamp_min(0).sqrt()
        return Normalize(tuple(float(m) for m in mean), tuple(float(v) if v > 0 else 1.0 for v in std))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read(index), self.read(index, mask=True)

    def describe(self, index: int) -> str:
        """Where crop ``index`` comes from: its image (and mask) file and region."""
        im, starts = self.origin(index)
        region = "[" + ", ".join(f"{lo}:{hi}" for lo, hi in self._region(starts, None)) + "]"
        mask = f", mask {self.masks[im].path}" if self.masks is not None else ""
        return f"{self.images[im].path}{mask}, region {region}"

    def lazy_batch(self, indices: Sequence[int]) -> tuple[TiledInput, TiledInput]:
        """The crops ``indices`` as ``(x, y)`` TiledInputs: nothing is read until a rank reads its window."""
        idx = list(indices)
        c, spatial = self.sample_shape[0], self.sample_shape[1:]

        def read_x(sl: tuple[slice, ...]) -> torch.Tensor:
            bounds = [(s.start, s.stop) for s in sl[2:]]
            return torch.stack([self.read(i, bounds) for i in idx[sl[0]]])[:, sl[1]]

        def read_y(sl: tuple[slice, ...]) -> torch.Tensor:
            bounds = [(s.start, s.stop) for s in sl[1:]]
            return torch.stack([self.read(i, bounds, mask=True) for i in idx[sl[0]]])

        x = TiledInput((len(idx), c, *spatial), read_x)
        y = _Labels((len(idx), *spatial), read_y)
        return x, y


class _Labels(TiledInput):
    """A lazy label batch ``(N, *spatial)`` (TiledInput wants (N, C, ...); labels have no C)."""

    def __init__(self, shape: Sequence[int], read: Any) -> None:
        self.shape = torch.Size(int(s) for s in shape)
        self._read = read
        self.dtype = torch.long
        self._rows = (0, self.shape[0])

    def rows(self, start: int, stop: int) -> _Labels:
        out = _Labels((stop - start, *self.shape[1:]), self._read)
        out._rows = (self._rows[0] + start, self._rows[0] + stop)
        return out

    def read(self, bounds: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
        sp = [(0, s) for s in self.shape[1:]] if bounds is None else list(bounds)
        return self._read((slice(*self._rows), *(slice(a, b) for a, b in sp)))


def check_masks(images: Sequence[Any], masks: Sequence[Any], flag: str) -> None:
    """Raise NowdlError unless ``masks`` (given by ``flag``) has one mask of its image's shape per image."""
    if len(masks) != len(images):
        raise NowdlError(f"{flag} gives {len(masks)} mask(s) for {len(images)} image(s): give one mask per image, "
                         "in the same order (same file names in a folder)")
    for im, mk in zip(images, masks, strict=True):
        if mk.spatial != im.spatial:
            raise NowdlError(f"the mask {mk.path} is {'x'.join(map(str, mk.spatial))} but its image {im.path} "
                             f"is {'x'.join(map(str, im.spatial))}: a mask must have its image's shape")


def label_loss(loss: nn.Module) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """``loss`` that first reads a lazy label batch (``lazy_batch``'s y), on the ranks that compute the loss."""
    def fn(out: torch.Tensor, y: Any) -> torch.Tensor:
        if isinstance(y, TiledInput):
            y = y.read().to(out.device)
        return loss(out, y)

    return fn


# ---- user datasets -------------------------------------------------------------------------------
def dataset_from_callable(spec: str, args_json: str | None) -> Any:
    """``package.module:callable`` called with ``args_json`` (keyword arguments), returning a Dataset.

    Raises:
        NowdlError: unimportable, not callable, it fails, or it does not return a sized Dataset.
    """
    try:
        kwargs = json.loads(args_json) if args_json else {}
    except json.JSONDecodeError as e:
        raise NowdlError(f"--data-args is not valid JSON ({e.msg} at column {e.colno}): write e.g. "
                         "'{\"root\": \"/data\"}'") from None
    if not isinstance(kwargs, dict):
        raise NowdlError(f"--data-args must be a JSON object of keyword arguments, got {type(kwargs).__name__}")
    fn = import_callable(spec, f"--data {spec}",
                         f"--data {spec} is not callable: name a function or class that returns a Dataset")
    try:
        ds = fn(**kwargs)
    except Exception as e:
        raise NowdlError(f"--data {spec}(**{kwargs}) failed: {type(e).__name__}: {e}. Check --data-args.") from None
    if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
        raise NowdlError(f"--data {spec} returned a {type(ds).__name__}, not a map-style torch Dataset "
                         "(with __getitem__ and __len__)")
    if len(ds) < 1:
        raise NowdlError(f"--data {spec} returned an empty dataset")
    return ds


def check_sample(item: Any, index: int | str, where: str, sample_shape: Sequence[int],
                 label_shape: Sequence[int] | None, classes: int | None = None) -> None:
    """Raise a NowdlError naming sample ``index`` of ``where`` unless it is ``(x, y)`` of the right shapes
    (and, given ``classes``, labels in ``0 .. classes - 1``).

    ``label_shape`` None: the labels are not checked (inference).
    """
    shape = "x".join(map(str, sample_shape))
    head = f"sample {index} of {where}"
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise NowdlError(f"{head} is a {type(item).__name__}: the Dataset must return (x, y), x a float tensor "
                         f"shaped {shape} (--input) and y its label")
    x, y = item
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        what = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
        raise NowdlError(f"{head}: x is {what}; return a float tensor shaped {shape} (e.g. torch.from_numpy(a).float())")
    if tuple(x.shape) != tuple(sample_shape):
        raise NowdlError(f"{head}: x has shape {tuple(x.shape)} but --input is {shape}: crop or resize the "
                         "samples, or fix --input")
    if label_shape is None:
        return
    if isinstance(y, (int, np.integer)) and not label_shape:
        _check_classes(torch.tensor(int(y)), head, classes)
        return
    if not isinstance(y, torch.Tensor) or y.is_floating_point() or tuple(y.shape) != tuple(label_shape):
        what = f"a {y.dtype} tensor of shape {tuple(y.shape)}" if isinstance(y, torch.Tensor) else f"a {type(y).__name__}"
        want = "an int class index" if not label_shape else f"an integer tensor shaped {tuple(label_shape)} (class per pixel)"
        raise NowdlError(f"{head}: y is {what}; the model's output needs {want}")
    _check_classes(y, head, classes)


def _check_classes(y: torch.Tensor, head: str, classes: int | None) -> None:
    """Refuse labels outside ``0 .. classes - 1`` but :data:`IGNORE_INDEX` (nodata; cross-entropy
    would fail on the rank computing the loss)."""
    if classes is not None and y.numel() and bool((y == IGNORE_INDEX).any()):
        y = y[y != IGNORE_INDEX]
    if classes is None or y.numel() == 0 or (int(y.min()) >= 0 and int(y.max()) < classes):
        return
    found = torch.unique(y).tolist()
    shown = ", ".join(map(str, found[:12])) + (", ..." if len(found) > 12 else "")
    raise NowdlError(f"{head} has label values {{{shown}}} but the model outputs {classes} class(es), so labels must be "
                     f"in 0..{classes - 1}: fix the labels, or build the model with more classes (e.g. --model-args "
                     f"'{{\"num_classes\": {max(found) + 1}}}' or out_channels)")
