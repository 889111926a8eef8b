"""Georeferenced rasters through rasterio (``geotiff:PATH[:nodata=V]``: any raster GDAL reads, or a folder of them).

A raster is ``(bands, H, W)``, read by window (``rasterio.windows.Window``), so only the blocks
that cover a region are decoded. Its CRS, affine transform, nodata value and band descriptions
come with it (:class:`GeoRef`, ``ImageArray.geo``); ``:nodata=V`` declares (or replaces) the
nodata value, e.g. for scenes whose 0 means "no data" but whose files do not say so (rasterio
reports no nodata value when the file declares one its pixels' type cannot hold). Nodata pixels become a zero input and an
ignored label ([Note: input values] in ``pixels``), and ``nowdl predict`` writes them back into
a Cloud-Optimized GeoTIFF or an OME-Zarr (``nowdl.runtime.predict.georef``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from nowdl.errors import NowdlError
from nowdl.runtime.data.pixels import check_nodata

__all__ = ["GEO_EXTS", "GeoRef", "GeoBands", "open_georasters"]

#: Files a ``geotiff:FOLDER`` spec takes (a single file may be any format GDAL reads).
GEO_EXTS = (".tif", ".tiff", ".vrt", ".jp2", ".img")


@dataclass(frozen=True)
class GeoRef:
    """Where a raster lies: CRS (WKT, or None), affine transform ``(a, b, c, d, e, f)`` as rasterio's
    ``Affine`` orders it (x = a*col + b*row + c, y = d*col + e*row + f), nodata, band names."""

    crs: str | None
    transform: tuple[float, ...]
    nodata: float | None
    descriptions: tuple[str | None, ...]
    code: str | None = None  # "EPSG:32633" when the CRS has an authority code

    def scaled(self, factors: tuple[int, ...]) -> GeoRef:
        """The same raster at a resolution ``factors`` (y, x) times coarser (same origin)."""
        fy, fx = factors
        a, b, c, d, e, f = self.transform
        return replace(self, transform=(a * fx, b * fy, c, d * fx, e * fy, f))


def _rasterio(spec: str) -> Any:
    try:
        import rasterio
    except ImportError:
        raise NowdlError(f"{spec} needs rasterio, which is not installed: pip install 'nowdl[data]' "
                         "(or pip install rasterio)") from None
    return rasterio


def _open(path: str) -> Any:
    """``rasterio.open(path)`` without rasterio's NotGeoreferencedWarning (``geo.crs`` None says it)."""
    import rasterio
    from rasterio.errors import NotGeoreferencedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotGeoreferencedWarning)
        return rasterio.open(path)


def georef_of(ds: Any) -> GeoRef:
    """The :class:`GeoRef` of an open rasterio dataset."""
    crs = ds.crs
    code = None
    if crs is not None:
        auth = crs.to_authority()
        code = f"{auth[0]}:{auth[1]}" if auth else None
    t = ds.transform
    return GeoRef(crs=None if crs is None else crs.to_wkt(), transform=(t.a, t.b, t.c, t.d, t.e, t.f),
                  nodata=None if ds.nodata is None else float(ds.nodata), descriptions=tuple(ds.descriptions),
                  code=code)


class GeoBands:
    """The raster at ``path`` as a lazily sliced ``(bands, H, W)`` array (``nodata``, ``georef``);
    ``nodata``: the value to take as nodata instead of the file's (None: the file's)."""

    def __init__(self, path: str, nodata: float | None = None) -> None:
        self.path = path
        self.ds = _open(path)
        self.shape = (int(self.ds.count), int(self.ds.height), int(self.ds.width))
        self.dtype = np.dtype(self.ds.dtypes[0])
        self.georef = georef_of(self.ds)
        if nodata is not None:
            self.georef = replace(self.georef, nodata=nodata)
        self.nodata = self.georef.nodata

    def __getitem__(self, index: Any) -> np.ndarray:
        from rasterio.windows import Window

        idx = index if isinstance(index, tuple) else (index,)
        sl = [idx[i] if i < len(idx) else slice(None) for i in range(3)]
        bands = list(range(1, self.shape[0] + 1))[sl[0]]
        (y0, y1, _), (x0, x1, _) = (s.indices(n) for s, n in zip(sl[1:], self.shape[1:], strict=True))
        window = Window(x0, y0, max(0, x1 - x0), max(0, y1 - y0))  # type: ignore[call-arg]
        return np.asarray(self.ds.read(bands, window=window))


def open_georasters(path: Path, spec: str, nodata: str | None = None) -> list[tuple[str, Callable[[], Any]]]:
    """``(name, opener)`` for the raster at ``path`` or every raster in the folder (``nodata``: the
    ``:nodata=V`` option's text).

    Raises:
        NowdlError: rasterio missing, no rasters in the folder, a file GDAL cannot read, bands of
            different types, a nodata value the pixels' type cannot hold.
    """
    _rasterio(spec)
    try:
        value = None if nodata is None else float(nodata)
    except ValueError:
        raise NowdlError(f"{spec}: nodata={nodata} is not a number; write e.g. geotiff:PATH:nodata=0") from None
    files = sorted(f for f in path.iterdir() if f.suffix.lower() in GEO_EXTS) if path.is_dir() else [path]
    if not files:
        raise NowdlError(f"{spec}: the folder {path} holds no rasters ({', '.join(GEO_EXTS)}); put them there or "
                         "name one file")
    out: list[tuple[str, Callable[[], Any]]] = []
    for f in files:
        try:
            with _open(str(f)) as ds:
                dtypes, own = set(ds.dtypes), ds.nodata
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise NowdlError(f"cannot read {f} as a raster ({type(e).__name__}: {first}): check the file, or "
                             "convert it with gdal_translate") from None
        if len(dtypes) != 1:
            raise NowdlError(f"{f} has bands of different types ({', '.join(sorted(dtypes))}): convert it to one type "
                             f"(gdal_translate -ot Float32 {f} out.tif)")
        declared = value if value is not None else None if own is None else float(own)
        check_nodata(declared, next(iter(dtypes)), str(f) if value is None else f"{spec} (for {f})")
        out.append((str(f), functools.partial(GeoBands, str(f), value)))
    return out
