"""Image files for the data tests: a seeded image and its mask as tiled TIFF, zarr and HDF5.

Importing this module skips the importing test module when tifffile, zarr or h5py is missing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

__all__ = ["H", "W", "image", "make_files", "write_tiff"]

tifffile = pytest.importorskip("tifffile")
zarr = pytest.importorskip("zarr")
h5py = pytest.importorskip("h5py")

H = W = 64


def image(seed: int = 0) -> np.ndarray:
    """A seeded ``H`` x ``W`` RGB uint8 image."""
    return np.random.default_rng(seed).integers(0, 255, (H, W, 3), dtype=np.uint8)


def write_tiff(path: Path, img: np.ndarray, *, pyramid: bool = True) -> None:
    """A tiled TIFF, with a half-size second level when ``pyramid``."""
    rgb = img.ndim == 3
    with tifffile.TiffWriter(path) as w:
        w.write(img, tile=(16, 16), subifds=1 if pyramid else 0, photometric="rgb" if rgb else "minisblack")
        if pyramid:
            w.write(img[::2, ::2], tile=(16, 16), subfiletype=1, photometric="rgb" if rgb else "minisblack")


def make_files(d: Path) -> dict[str, np.ndarray]:
    """``image()`` and a mask of it in ``d`` as TIFF (img.tif, mask.tif), zarr (img.zarr: x, y) and
    HDF5 (img.h5: x, y); returns both arrays."""
    img = image()
    mask = (img[..., 0] > 127).astype(np.uint8)
    write_tiff(d / "img.tif", img)
    write_tiff(d / "mask.tif", mask, pyramid=False)
    z = zarr.open_group(str(d / "img.zarr"), mode="w")
    z.create_array("x", shape=(3, H, W), chunks=(3, 16, 16), dtype="uint8")[...] = img.transpose(2, 0, 1)
    z.create_array("y", shape=(H, W), chunks=(16, 16), dtype="uint8")[...] = mask
    with h5py.File(d / "img.h5", "w") as f:
        f.create_dataset("x", data=img.transpose(2, 0, 1), chunks=(3, 16, 16))
        f.create_dataset("y", data=mask)
    return {"img": img, "mask": mask}
