"""Large-image readers: zarr, TIFF (pyramid levels) and HDF5 arrays opened lazily, read by region.

A spec names the file and what to read of it::

    zarr:PATH[:ARRAY]          a zarr array (or the array ARRAY of a zarr group)
    tiff:PATH[:level=N]        a TIFF file, or a folder of .tif/.tiff files; N: pyramid level (0 = full size)
    h5:PATH:DATASET            an HDF5 dataset
    openslide:PATH[:level=N]   a whole slide (or a folder of them) through OpenSlide (``slides``)
    nifti:PATH                 a .nii/.nii.gz volume, or a folder of them, through nibabel (``volumes``)
    geotiff:PATH               any raster GDAL reads (or a folder of them), with its CRS, transform and
                               nodata value, through rasterio (``georaster``)

An image is ``(*S)`` (one channel), ``(C, *S)`` or ``(*S, C)`` (channels last, as RGB TIFFs
are), or ``(N, C, *S)`` (N images); ``S`` has as many dims as the model's input. Only the
regions asked for are read (a tiled TIFF or a chunked zarr/h5 array reads the tiles that
cover them). Pixels become the model's input by one rule for every reader ([Note: input
values] in ``pixels``). The libraries are optional: ``pip install 'nowdl[data]'``.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nowdl.errors import NowdlError
from nowdl.runtime.data.pixels import scale

__all__ = ["READERS", "ImageArray", "ReadCounter", "open_images", "is_reader_spec"]

#: ``--data`` / ``--labels`` kinds served by this module.
READERS = ("zarr", "tiff", "h5", "openslide", "nifti", "geotiff")
_LIBS = {"zarr": "zarr", "tiff": "tifffile", "h5": "h5py"}
_TIFF_EXTS = (".tif", ".tiff")


def is_reader_spec(spec: str) -> bool:
    """True for ``zarr:...``, ``tiff:...``, ``h5:...`` and the other :data:`READERS`."""
    return spec.partition(":")[0] in READERS and bool(spec.partition(":")[2])


def _lib(kind: str, spec: str) -> Any:
    name = _LIBS[kind]
    try:
        return importlib.import_module(name)
    except ImportError:
        raise NowdlError(f"{spec} needs the {name} package, which is not installed: pip install 'nowdl[data]' "
                         f"(or pip install {name})") from None


@dataclass
class ReadCounter:
    """Pixels (elements) and bytes this process read, per file (thread-safe: DataLoader threads)."""

    pixels: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, arr: np.ndarray, secs: float) -> None:
        with self._lock:
            self.pixels[name] = self.pixels.get(name, 0) + int(arr.size)
            self.bytes[name] = self.bytes.get(name, 0) + int(arr.nbytes)
            self.seconds += secs


class ImageArray:
    """One image of a file as ``(C, *spatial)``, read by region; ``path`` names it in messages.

    Args:
        opener: returns the lazily indexable array (zarr, h5py, tifffile's zarr store); picklable.
        path: file name (and dataset / level) for messages.
        (``nodata`` and ``geo``: the array's ``nodata`` value and ``georef``, a
        :class:`~nowdl.runtime.data.georaster.GeoRef`, where it has them: ``geotiff:``; else None.)
        layout: ``"cf"`` channels first, ``"cl"`` channels last, ``"none"`` no channel dim.
        index: the image's position along a leading N dim (None: no such dim).
    """

    def __init__(self, opener: Callable[[], Any], path: str, layout: str, index: int | None = None) -> None:
        self.opener, self.path, self.layout, self.index = opener, path, layout, index
        array = self.array
        shape = tuple(int(d) for d in array.shape)[(0 if index is None else 1):]
        if layout == "cl":
            self.shape = (shape[-1], *shape[:-1])
        elif layout == "none":
            self.shape = (1, *shape)
        else:
            self.shape = shape
        self.dtype = np.dtype(array.dtype)
        self.nodata: float | None = getattr(array, "nodata", None)
        self.geo: Any = getattr(array, "georef", None)

    @property
    def array(self) -> Any:
        """The open array; opened again in each process (DataLoader workers, pickling)."""
        if getattr(self, "_pid", None) != os.getpid():
            self._array, self._pid = self.opener(), os.getpid()
        return self._array

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_array", "_pid")}

    @property
    def spatial(self) -> tuple[int, ...]:
        return tuple(self.shape[1:])

    def read(self, bounds: Sequence[tuple[int, int]], counter: ReadCounter | None = None) -> np.ndarray:
        """The region ``bounds`` (per spatial dim ``[start, stop)``) as ``(C, *region)``."""
        import time

        t0 = time.perf_counter()
        sp = tuple(slice(a, b) for a, b in bounds)
        lead: tuple[Any, ...] = () if self.index is None else (self.index,)
        try:
            if self.layout == "cl":
                arr = np.moveaxis(np.asarray(self.array[lead + sp + (slice(None),)]), -1, 0)
            elif self.layout == "none":
                arr = np.asarray(self.array[lead + sp])[None]
            else:
                arr = np.asarray(self.array[lead + (slice(None),) + sp])
        except Exception as e:  # a truncated or corrupt tile: name the file and the region
            region = ", ".join(f"{a}:{b}" for a, b in bounds)
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise NowdlError(f"cannot read region [{region}] of {self.path} ({type(e).__name__}: {first}): the file "
                             "is damaged there (a truncated or corrupt tile); re-export or replace it, or take it "
                             "out of the data") from None
        if counter is not None:
            counter.add(self.path, arr, time.perf_counter() - t0)
        return arr


def to_tensor(arr: np.ndarray, *, label: bool = False) -> torch.Tensor:
    """Pixels as float32 by the dtype rule ([Note: input values]: integers / their type's maximum,
    floats as they are), or labels as int64."""
    if label:
        return torch.from_numpy(np.ascontiguousarray(arr)).long()
    return scale(arr)


# ---- opening -------------------------------------------------------------------------------------
def _split_opts(rest: str, kind: str, spec: str) -> tuple[str, dict[str, str], str | None]:
    """``PATH[:key=value][:NAME]`` -> (path, options, name)."""
    opts: dict[str, str] = {}
    name: str | None = None
    path = rest
    while ":" in path and not Path(path).exists():
        head, _, tail = path.rpartition(":")
        if re.fullmatch(r"\w+=[\w.+-]+", tail):
            k, _, v = tail.partition("=")
            opts[k] = v
        elif name is None and kind in ("zarr", "h5"):
            name = tail
        else:
            raise NowdlError(f"{spec}: cannot parse {tail!r}; write {kind}:PATH" +
                             (":level=N" if kind == "tiff" else ":NAME"))
        path = head
    return path, opts, name


def _tiff_array(path: str, level: int) -> Any:
    import tifffile
    import zarr

    return zarr.open(tifffile.TiffFile(path).series[0].aszarr(level=level), mode="r")


def _zarr_array(path: str, name: str | None) -> Any:
    import zarr

    node: Any = zarr.open(path, mode="r")
    return node[name] if name is not None else node


def _h5_array(path: str, name: str) -> Any:
    import h5py

    return h5py.File(path, "r")[name]


def _open_tiff(path: Path, level: int, spec: str) -> list[tuple[str, Callable[[], Any]]]:
    tifffile = _lib("tiff", spec)
    _lib("zarr", spec)
    files = sorted(f for f in path.iterdir() if f.suffix.lower() in _TIFF_EXTS) if path.is_dir() else [path]
    if not files:
        raise NowdlError(f"{spec}: the folder {path} holds no .tif/.tiff files; put the images there or name one file")
    out: list[tuple[str, Callable[[], Any]]] = []
    for f in files:
        try:
            with tifffile.TiffFile(f) as tif:
                levels = len(tif.series[0].levels)
        except Exception as e:
            raise NowdlError(f"cannot read {f} as a TIFF ({type(e).__name__}: {e}): check the file, or convert "
                             "it to a tiled TIFF, zarr or h5") from None
        if not 0 <= level < levels:
            raise NowdlError(f"{f} has {levels} pyramid level(s) (0..{levels - 1}) but {spec} asks for level "
                             f"{level}: use level=0..{levels - 1}")
        out.append((str(f) + (f" level {level}" if level else ""), functools.partial(_tiff_array, str(f), level)))
    return out


def _check_zarr(path: Path, name: str | None, spec: str) -> None:
    zarr = _lib("zarr", spec)
    try:
        node = zarr.open(str(path), mode="r")
    except Exception as e:
        raise NowdlError(f"cannot open {path} as zarr ({type(e).__name__}: {e}): check the path") from None
    keys = sorted(node.array_keys()) if hasattr(node, "array_keys") else []
    if name is not None:
        try:
            node = node[name]
        except Exception:
            raise NowdlError(f"{path} has no array {name!r}: its arrays are {', '.join(keys) or 'none'}") from None
    if not hasattr(node, "dtype"):
        raise NowdlError(f"{path} is a zarr group: name its array, e.g. zarr:{path}:{keys[0] if keys else 'NAME'}")


def _check_h5(path: Path, name: str | None, spec: str) -> None:
    h5py = _lib("h5", spec)
    if name is None:
        raise NowdlError(f"{spec}: name the dataset: h5:{path}:DATASET")
    try:
        f = h5py.File(path, "r")
    except Exception as e:
        raise NowdlError(f"cannot open {path} as HDF5 ({type(e).__name__}: {e}): check the file") from None
    with f:
        if name not in f or not isinstance(f[name], h5py.Dataset):
            names: list[str] = []
            f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
            raise NowdlError(f"{path} has no dataset {name!r}: its datasets are {', '.join(names[:8]) or 'none'}")


def _layout(shape: tuple[int, ...], channels: int, ndim: int, where: str, label: bool,
            stacked: bool) -> tuple[str, int | None]:
    """(layout, images along a leading N dim or None) of an array shaped ``shape``."""
    if len(shape) == ndim:
        return "none", None
    if len(shape) == ndim + 1:
        if shape[0] == channels:
            return "cf", None
        if shape[-1] == channels:
            return "cl", None
        if (channels == 1 and not label) or stacked:
            return "none", shape[0]  # (N, *S)
    if len(shape) == ndim + 2 and shape[1] == channels:
        return "cf", shape[0]
    want = "one integer class per pixel, (*S)" if label else f"(*S), ({channels}, *S), (*S, {channels}) or (N, {channels}, *S)"
    raise NowdlError(f"{where} has shape {shape} but --input asks for {channels} channel(s) and {ndim} spatial "
                     f"dim(s): store it as {want}, or fix --input")


def open_images(spec: str, channels: int, ndim: int, *, label: bool = False,
                stacked: bool = False) -> list[ImageArray]:
    """The images named by ``spec`` (one of :data:`READERS`) as ``(C, *spatial)`` arrays.

    Args:
        spec: the reader spec.
        channels: the model's input channels (1 for a mask).
        ndim: spatial dims of the model's input.
        label: open a mask (integer classes; no channel dim, or one of size 1).
        stacked: the images came as one ``(N, ...)`` array: a mask may be ``(N, *S)``.

    Raises:
        NowdlError: a missing or unreadable file, a missing level or dataset, a layout that does not fit.
    """
    kind, _, rest = spec.partition(":")
    if kind not in READERS or not rest:
        raise NowdlError(f"{spec}: use zarr:PATH, tiff:PATH[:level=N], h5:PATH:DATASET, openslide:PATH[:level=N], "
                         "nifti:PATH or geotiff:PATH")
    path_text, opts, name = _split_opts(rest, kind, spec)
    path = Path(path_text)
    if not path.exists():
        raise NowdlError(f"{path} does not exist ({spec}): check the path")
    arrays: list[tuple[str, Callable[[], Any]]]
    if kind in ("tiff", "openslide"):
        bad = set(opts) - {"level"}
        if bad:
            raise NowdlError(f"{spec}: unknown option {sorted(bad)[0]!r}; {kind} takes level=N")
        if kind == "openslide":
            from nowdl.runtime.data.slides import open_slides
        arrays = (open_slides if kind == "openslide" else _open_tiff)(path, int(opts.get("level", 0)), spec)
    elif kind == "nifti" and not opts:
        from nowdl.runtime.data.volumes import open_volumes

        arrays = open_volumes(path, spec)
    elif kind == "geotiff":
        from nowdl.runtime.data.georaster import open_georasters

        if set(opts) - {"nodata"}:
            raise NowdlError(f"{spec}: unknown option {sorted(set(opts) - {'nodata'})[0]!r}; geotiff takes nodata=V")
        return [_georaster(where, opener, 1 if label else channels, ndim, label)
                for where, opener in open_georasters(path, spec, opts.get("nodata"))]
    elif opts:
        raise NowdlError(f"{spec}: {kind} takes no key=value options")
    elif kind == "zarr":
        _check_zarr(path, name, spec)
        arrays = [(str(path) + (f":{name}" if name else ""), functools.partial(_zarr_array, str(path), name))]
    else:
        _check_h5(path, name, spec)
        arrays = [(f"{path}:{name}", functools.partial(_h5_array, str(path), str(name)))]
    out: list[ImageArray] = []
    for where, opener in arrays:
        shape = tuple(int(d) for d in opener().shape)
        layout, n = _layout(shape, 1 if label else channels, ndim, where, label, stacked)
        out.extend([ImageArray(opener, where, layout)] if n is None
                   else [ImageArray(opener, f"{where}[{i}]", layout, i) for i in range(n)])
    return out


def _georaster(where: str, opener: Callable[[], Any], channels: int, ndim: int, label: bool) -> ImageArray:
    """A ``geotiff:`` raster, always ``(bands, H, W)``: its band count must be the model's channels."""
    image = ImageArray(opener, where, "cf")
    if ndim != 2:
        raise NowdlError(f"{where} is a 2D raster but the model takes {ndim}D inputs: use a 2D model, or nifti:/zarr: "
                         "for volumes")
    if image.shape[0] != channels:
        what = "a mask must have one band (a class per pixel)" if label else (
            f"the model takes {channels} input channel(s) (in_channels)")
        raise NowdlError(f"{where} has {image.shape[0]} band(s) but {what}: select the bands with gdal_translate "
                         f"-b 1 -b 2 ... (or a .vrt), or build the model with in_channels={image.shape[0]}")
    return image
