"""Data for training with nowdl: a seeded DataLoader every rank agrees on, and large-image crops.

Every rank builds the same loader and gets the same global batch at each step, which
``CompiledModel.train_step(x, y)`` takes as it is::

    ds = nowdl.data.crops("tiff:slide.tif", (3, 1024, 1024), labels="tiff:mask.tif")
    for x, y in nowdl.data.loader(ds, batch_size=8, seed=0, workers=4, steps=100):
        cm.train_step(x, y)

Any map-style ``torch.utils.data.Dataset`` of ``(x, y)`` works with ``loader``. With a spatial
plan, ``tile_batches`` hands lazy batches instead, of which each rank reads only the tile it
runs (one step ahead); the loss then takes ``label_loss(...)``::

    cm = nowdl.compile(model, plan="plan.json", loss_fn=nowdl.data.label_loss(nn.CrossEntropyLoss()), ...)
    for x, y in nowdl.data.tile_batches(ds, batch_size=8, seed=0, steps=100):
        cm.train_step(x, y)

Pixels become inputs by one rule for every reader: integers divided by their type's maximum,
floats as they are, then ``normalize`` per band; nodata pixels (a raster's nodata value, NaN)
are a zero input and the label ``IGNORE_INDEX`` (-100, which ``nn.CrossEntropyLoss`` ignores)::

    ds = nowdl.data.crops("geotiff:scene.tif", (13, 512, 512), labels="geotiff:classes.tif",
                          normalize="auto")          # or nowdl.data.Normalize(mean=(...), std=(...))
    print(ds.normalize.text())                       # mean=...,std=... : give it to predict

The large-image readers need ``pip install 'nowdl[data]'`` (tifffile, zarr, h5py, rasterio).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from nowdl.runtime.data.datasets import CropDataset, label_loss
from nowdl.runtime.data.loader import StepSampler, default_workers, loader
from nowdl.runtime.data.pixels import IGNORE_INDEX, Normalize, parse_normalize
from nowdl.runtime.data.prefetch import TileReadAhead
from nowdl.runtime.data.readers import ImageArray, open_images
from nowdl.runtime.spatial.tiles import TiledInput

__all__ = ["loader", "crops", "tile_batches", "label_loss", "CropDataset", "StepSampler", "ImageArray",
           "open_images", "default_workers", "Normalize", "IGNORE_INDEX"]


def crops(spec: str, sample_shape: Sequence[int], *, labels: str | None = None, seed: int = 0,
          per_image: int | None = None, normalize: Normalize | str | None = None) -> CropDataset:
    """Seeded random crops of ``sample_shape`` (C, *spatial) from the images of ``spec``.

    Args:
        spec: ``zarr:PATH[:ARRAY]``, ``tiff:PATH[:level=N]`` (a file or a folder), ``h5:PATH:DATASET``,
            ``geotiff:PATH`` (any GDAL raster, with its nodata value) or another reader spec.
        sample_shape: one crop's shape, channels first (the model's input without the batch).
        labels: masks of the same layout and shape, one per image (a spec as ``spec``).
        seed: crop origins are a function of ``(seed, index)``.
        per_image: crops per image per epoch (default: as many as would tile it).
        normalize: per-band ``Normalize``, its text ``"mean=...,std=..."``, or ``"auto"``: the
            mean and std of 16 crops spread over the data (``ds.normalize`` holds them).

    Raises:
        NowdlError: a missing or unreadable file, level or dataset; a mask whose shape differs; a
            ``normalize`` whose bands differ from the images'.
    """
    shape = tuple(int(d) for d in sample_shape)
    images = open_images(spec, shape[0], len(shape) - 1)
    masks = None if labels is None else open_images(labels, 1, len(shape) - 1, label=True,
                                                stacked=any(im.index is not None for im in images))
    norm = parse_normalize(normalize) if isinstance(normalize, str) else normalize
    ds = CropDataset(images, masks, shape, seed=seed, crops=per_image,
                     normalize=norm if isinstance(norm, Normalize) else None)
    if norm == "auto":
        ds.normalize = ds.band_stats()
    return ds


def tile_batches(dataset: CropDataset, batch_size: int, *, seed: int = 0, start_step: int = 0,
                 steps: int | None = None) -> Iterator[tuple[TiledInput, TiledInput]]:
    """Lazy ``(x, y)`` batches of ``dataset`` (the same crops as ``loader``): each rank reads only its windows.

    The first step learns which windows the engine reads on this rank; later steps' windows are
    read on a background thread one step ahead. Train with ``loss_fn=label_loss(loss)``.
    """
    sampler = StepSampler(len(dataset), batch_size, seed=seed)
    stop = None if steps is None else start_step + steps
    ahead = TileReadAhead(dataset, sampler, stop)
    try:
        step = start_step
        while stop is None or step < stop:
            yield ahead.batch(step)
            step += 1
    finally:
        ahead.close()
