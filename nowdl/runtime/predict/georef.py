"""Georeferenced predictions: the source raster's CRS, transform and nodata in the outputs.

[Note: georeferenced outputs] A ``geotiff:`` source carries a
:class:`~nowdl.runtime.data.georaster.GeoRef`. Its prediction keeps it:

- ``OUT.tif`` is a Cloud-Optimized GeoTIFF written by GDAL's COG driver (256² tiles, DEFLATE,
  overviews down to 256 pixels: average for logits and probabilities, nearest for class
  labels), with the source's CRS and transform (pixel for pixel when the network's output has
  the input's size; an output ``f`` times smaller has pixels ``f`` times larger from the same
  corner);
- ``OUT.zarr`` (OME-Zarr 0.5) also carries the Zarr conventions ``proj:`` (the CRS as
  ``proj:code`` such as ``EPSG:32633`` where it has one, and ``proj:wkt2``) and ``spatial:``
  (``spatial:dimensions`` ``["y", "x"]``, ``spatial:transform`` in rasterio's ``Affine`` order
  ``a, b, c, d, e, f``, ``spatial:shape``, ``spatial:registration`` ``pixel``), registered in
  ``zarr_conventions``: the group has level 0's, each level array its own (GeoZarr's
  conventions, https://github.com/zarr-conventions/geo-proj and .../spatial).

Nodata: where the source declares a nodata value, an output pixel whose input pixels are all
nodata is written as the output's nodata: NaN for logits and probabilities, 255 for class
labels (-1 with more than 255 classes); the COG declares it, and the zarr arrays have it as
their ``fill_value``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nowdl.errors import NowdlError
from nowdl.runtime.data.georaster import GeoRef
from nowdl.runtime.data.pixels import invalid
from nowdl.runtime.data.readers import ImageArray
from nowdl.runtime.predict.writers import LevelStore

__all__ = ["zarr_geo_attributes", "output_nodata", "NodataMask", "write_cog", "check_georef"]

_PROJ = {"schema_url": "https://raw.githubusercontent.com/zarr-conventions/geo-proj/refs/tags/v1/schema.json",
         "spec_url": "https://github.com/zarr-conventions/geo-proj/blob/v1/README.md",
         "uuid": "f17cb550-5864-4468-aeb7-f3180cfb622f", "name": "proj",
         "description": "Coordinate reference system information for geospatial data"}
_SPATIAL = {"schema_url": "https://raw.githubusercontent.com/zarr-conventions/spatial/refs/tags/v1/schema.json",
            "spec_url": "https://github.com/zarr-conventions/spatial/blob/v1/README.md",
            "uuid": "689b58e2-cf7b-45e0-9fff-9cfc0883d6b4", "name": "spatial",
            "description": "Spatial coordinate information"}


def check_georef(image: ImageArray, out: str) -> None:
    """Refuse a ``geotiff:`` source without a CRS: its prediction could not keep one."""
    if image.geo is not None and image.geo.crs is None:
        raise NowdlError(f"{image.path} has no CRS, so the prediction {out} could not keep one as a geotiff: source "
                         f"asks: assign the raster's CRS (gdal_edit.py -a_srs EPSG:CODE {image.path}), or read it "
                         f"with tiff:{image.path} for a prediction without a spatial reference")


def zarr_geo_attributes(geo: GeoRef, spatial: Sequence[int], level: int) -> dict[str, Any]:
    """The ``proj:`` and ``spatial:`` attributes of pyramid level ``level`` (2^level coarser) of an
    output whose level 0 is ``spatial`` (H, W) pixels on the grid ``geo``."""
    g = geo.scaled((2 ** level, 2 ** level))
    attrs: dict[str, Any] = {"zarr_conventions": [_PROJ, _SPATIAL]}
    if geo.code is not None:
        attrs["proj:code"] = geo.code
    if geo.crs is not None:
        attrs["proj:wkt2"] = geo.crs
    h, w = (int(s) for s in spatial)
    attrs.update({"spatial:dimensions": ["y", "x"], "spatial:transform_type": "affine",
                  "spatial:transform": list(g.transform), "spatial:registration": "pixel",
                  "spatial:shape": [-(-h // 2 ** level), -(-w // 2 ** level)]})
    return attrs


def output_nodata(output: str, classes: int) -> float:
    """The nodata value of an ``output`` of ``classes`` classes: NaN, or 255 / -1 for class labels."""
    if output != "argmax":
        return float("nan")
    return 255.0 if classes <= 255 else -1.0


class NodataMask:
    """Sets an output share's pixels whose input pixels are all nodata to ``value``."""

    def __init__(self, image: ImageArray, scale: Sequence[int], value: float) -> None:
        self.image, self.scale, self.value = image, tuple(int(f) for f in scale), value

    def __call__(self, share: Sequence[tuple[int, int]], values: np.ndarray) -> np.ndarray:
        region = [(a * f, min(b * f, s)) for (a, b), f, s in zip(share, self.scale, self.image.spatial, strict=True)]
        bad = invalid(self.image.read(region), self.image.nodata)
        if bad is None:
            return values
        for d, f in enumerate(self.scale):  # an output pixel is nodata when its whole input block is
            if f > 1:
                bad = np.logical_and.reduceat(bad, np.arange(0, bad.shape[d], f), axis=d)
        bad = bad[tuple(slice(0, b - a) for a, b in share)]
        out = values.copy()
        out[:, bad] = self.value
        return out


def write_cog(root: Path, target: Path, geo: GeoRef, nodata: float | None, labels: bool) -> None:
    """A Cloud-Optimized GeoTIFF at ``target`` of level 0 of the work store ``root`` on the grid ``geo``."""
    import rasterio
    from rasterio.shutil import copy as rio_copy
    from rasterio.windows import Window

    store = LevelStore(root, 0)
    if len(store.shape) != 3:
        raise NowdlError(f"a GeoTIFF output holds 2D images but the prediction is {len(store.shape) - 1}D: write "
                         "--out OUT.zarr")
    c, h, w = store.shape
    plain = target.with_name(target.name + ".plain.tif")
    a, b, cc, d, e, f = geo.transform
    profile = {"driver": "GTiff", "width": w, "height": h, "count": c, "dtype": store.array.dtype.name,
               "crs": geo.crs, "transform": rasterio.Affine(a, b, cc, d, e, f), "nodata": nodata, "tiled": True,
               "blockxsize": 256, "blockysize": 256, "BIGTIFF": "IF_SAFER"}
    try:
        with rasterio.open(str(plain), "w", **profile) as dst:
            for y in range(0, h, 1024):
                for x in range(0, w, 1024):
                    block = np.asarray(store.array[:, y:y + 1024, x:x + 1024])
                    dst.write(block, window=Window(x, y, block.shape[2], block.shape[1]))  # type: ignore[call-arg]
        rio_copy(str(plain), str(target), driver="COG", COMPRESS="DEFLATE", BLOCKSIZE="256", OVERVIEWS="AUTO",
                 RESAMPLING="NEAREST" if labels else "AVERAGE", BIGTIFF="IF_SAFER")
    finally:
        plain.unlink(missing_ok=True)
