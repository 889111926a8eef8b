"""Rank 0's conversions of the finished work store (``writers``) into a pyramidal TIFF or a NIfTI file.

The TIFF is tiled (256² tiles, zlib), level 0 in the first page and each downsampled level
as a SubIFD of it (``tifffile.TiffFile(path).series[0].levels``); it is written tile by tile
from the zarr levels, so not even rank 0 holds the whole image. A NIfTI file is one gzip stream:
nibabel writes it from the whole volume, which rank 0 then holds (volumes are far smaller than
slides); it keeps the input's affine and voxel spacing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from nowdl.errors import NowdlError
from nowdl.runtime.predict.writers import LevelStore

__all__ = ["write_tiff", "write_nifti", "TIFF_TILE"]

TIFF_TILE = 256


def _tiles(store: LevelStore) -> Iterator[np.ndarray]:
    """The level's tiles, plane by plane (planar config separate), row-major, edge tiles padded."""
    c, h, w = store.shape
    t = TIFF_TILE
    for ch in range(c):
        for y in range(0, h, t):
            for x in range(0, w, t):
                block = np.asarray(store.array[ch, y:y + t, x:x + t])
                if block.shape != (t, t):
                    block = np.pad(block, ((0, t - block.shape[0]), (0, t - block.shape[1])))
                yield block


def write_tiff(root: Path, levels: int, target: Path) -> None:
    """A tiled pyramidal TIFF of the 2D levels ``0..levels-1`` of the work store ``root``."""
    import tifffile

    stores = [LevelStore(root, k) for k in range(levels)]
    if len(stores[0].shape) != 3:
        raise NowdlError(f"a TIFF output holds 2D images but the prediction is {len(stores[0].shape) - 1}D: "
                         "write --out OUT.zarr or OUT.nii.gz")
    with tifffile.TiffWriter(str(target), bigtiff=True) as tif:
        for k, st in enumerate(stores):
            c, h, w = st.shape
            shape: Sequence[int] = (c, h, w) if c > 1 else (h, w)
            tif.write(_tiles(st), shape=tuple(shape), dtype=st.array.dtype, tile=(TIFF_TILE, TIFF_TILE),
                      photometric="minisblack", planarconfig="separate" if c > 1 else None, compression="zlib",
                      metadata=None, subifds=levels - 1 if k == 0 else None, subfiletype=1 if k else 0)


def write_nifti(root: Path, target: Path, affine: np.ndarray | None, spacing: Sequence[float] | None) -> None:
    """A NIfTI file of level 0 (``(X, Y, Z)`` labels, or ``(X, Y, Z, C)``) with ``affine`` and ``spacing``."""
    import nibabel

    data = LevelStore(root, 0).read([(0, s) for s in LevelStore(root, 0).shape[1:]])
    if data.ndim != 4:
        raise NowdlError(f"a NIfTI output holds 3D volumes but the prediction is {data.ndim - 1}D: write --out OUT.zarr "
                         "or OUT.tif")
    vol = data[0] if data.shape[0] == 1 else np.moveaxis(data, 0, -1)
    img = nibabel.Nifti1Image(vol, np.eye(4) if affine is None else affine)
    if spacing is not None and affine is None:
        img.header.set_zooms(tuple(spacing)[:3] + tuple(img.header.get_zooms()[3:]))
    nibabel.save(img, str(target))
