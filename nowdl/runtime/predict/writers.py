"""Where predictions go: a chunked zarr store written by region in parallel, its OME-Zarr
pyramid, and the rename that makes the output appear only when it is complete.

[Note: predict output] Every rank writes its share of each window's exact core into level 0 of
a zarr v3 array (``WORK/0``) under a temporary name beside OUT (``.NAME.nowdl-partial``); the
shares are whole chunks (a chunk at a core's edge is finished by the next window, after the
ranks agree that the window is written). The ranks then build the downsampled levels
``1, 2, ...`` (2x per level, block means for logits and probabilities, every second pixel for
class labels) chunk by chunk, each level from the one before, so no rank holds more than two
chunks of it. OUT ``.zarr`` is that store with OME-NGFF 0.5 metadata; ``.tif`` and
``.nii.gz`` are converted from it by rank 0 (``nowdl.runtime.predict.export``). Only when all of
it is on disk is the temporary name renamed to OUT; a failure (a full disk) removes it.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nowdl.errors import NowdlError

__all__ = ["OUT_KINDS", "output_kind", "check_out", "partial_path", "LevelStore", "chunk_shape",
           "pyramid_shapes", "build_level", "ngff_attributes", "publish", "discard"]

#: OUT suffix -> format.
OUT_KINDS = {".zarr": "zarr", ".tif": "tiff", ".tiff": "tiff", ".nii.gz": "nifti", ".nii": "nifti"}


def output_kind(out: str | Path) -> str:
    """``zarr``, ``tiff`` or ``nifti`` from OUT's suffix.

    Raises:
        NowdlError: any other suffix.
    """
    name = str(out).rstrip("/").lower()
    for suffix, kind in sorted(OUT_KINDS.items(), key=lambda kv: -len(kv[0])):
        if name.endswith(suffix):
            return kind
    raise NowdlError(f"--out {out}: name the output OUT.zarr (OME-Zarr), OUT.tif (pyramidal TIFF) or OUT.nii.gz "
                     "(NIfTI), or a folder (one OUT.zarr per image there, with --format)")


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an existing ``out`` (unless ``overwrite``) or a missing parent folder."""
    if out.exists() and not overwrite:
        raise NowdlError(f"{out} already exists: pass --overwrite to replace it (it is replaced only once the new "
                         "prediction is complete), or choose another --out")
    if not out.parent.is_dir():
        raise NowdlError(f"the folder {out.parent} of --out {out} does not exist: create it first")


def partial_path(out: Path, suffix: str = "") -> Path:
    """The temporary name OUT is written under (beside it, so the final rename is atomic)."""
    return out.parent / f".{out.name}.nowdl-partial{suffix}"


def discard(path: Path) -> None:
    """Remove a partial output (a file or a folder), ignoring what is already gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def publish(partial: Path, out: Path) -> None:
    """Rename ``partial`` to ``out``; an existing ``out`` (``--overwrite``) is removed only after."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.parent / f".{out.name}.nowdl-old"
        discard(old)
        os.replace(out, old)
    os.replace(partial, out)
    if old is not None:
        discard(old)


def chunk_shape(channels: int, spatial: Sequence[int]) -> tuple[int, ...]:
    """Chunks of all channels and 256² (2D) or 64³ (3D) pixels, clipped to the image."""
    side = 256 if len(spatial) <= 2 else 64
    return (channels, *(min(side, int(s)) for s in spatial))


def pyramid_shapes(spatial: Sequence[int], smallest: int = 256) -> list[tuple[int, ...]]:
    """Level 0's spatial shape and each 2x smaller level until the largest side is ``smallest`` or less."""
    out = [tuple(int(s) for s in spatial)]
    while max(out[-1]) > smallest and min(out[-1]) > 1:
        out.append(tuple(math.ceil(s / 2) for s in out[-1]))
    return out


class LevelStore:
    """One pyramid level of the work store: a zarr v3 array ``(C, *spatial)``, written by region."""

    def __init__(self, root: Path, level: int) -> None:
        import zarr

        self.path = root / str(level)
        self.array: Any = zarr.open_array(str(self.path), mode="r+")

    @staticmethod
    def create(root: Path, level: int, shape: Sequence[int], dtype: Any, attributes: dict[str, Any] | None = None,
               *, fill: float = 0, array_attributes: dict[str, Any] | None = None) -> None:
        """Create the group ``root`` (level 0, with ``attributes``) and the empty level array (with
        ``array_attributes`` and ``fill`` as its fill_value): float levels (logits, probabilities)
        uncompressed, class labels with zarr's default (zstd)."""
        import zarr

        if level == 0:
            zarr.open_group(str(root), mode="w", zarr_format=3, attributes=attributes or {})
        shape_t = tuple(int(s) for s in shape)
        floats = np.dtype(dtype).kind == "f"  # logits barely compress; zstd took 4x the time of the raw write
        zarr.create_array(str(root), name=str(level), shape=shape_t, dtype=dtype,
                          chunks=chunk_shape(shape_t[0], shape_t[1:]), zarr_format=3, fill_value=fill,
                          compressors=None if floats else "auto", attributes=array_attributes or {},
                          dimension_names=["c", *("zyx"[-(len(shape_t) - 1):])])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.array.shape)

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(int(c) for c in self.array.chunks)

    def write(self, bounds: Sequence[tuple[int, int]], values: np.ndarray) -> None:
        """Write ``values`` ``(C, *region)`` at the spatial region ``bounds``."""
        self.array[(slice(None), *(slice(a, b) for a, b in bounds))] = values

    def read(self, bounds: Sequence[tuple[int, int]]) -> np.ndarray:
        return np.asarray(self.array[(slice(None), *(slice(a, b) for a, b in bounds))])

    def chunk_regions(self) -> Iterator[tuple[tuple[int, int], ...]]:
        """Every chunk's spatial region, row-major."""
        sp, ch = self.shape[1:], self.chunks[1:]
        counts = [math.ceil(s / c) for s, c in zip(sp, ch, strict=True)]
        for flat in range(math.prod(counts)):
            idx, rest = [], flat
            for n in reversed(counts):
                rest, i = divmod(rest, n)
                idx.append(i)
            idx.reverse()
            yield tuple((i * c, min((i + 1) * c, s)) for i, c, s in zip(idx, ch, sp, strict=True))


def _downsample(block: np.ndarray, labels: bool) -> np.ndarray:
    """2x smaller ``(C, *S)``: every second pixel for labels, else the mean of each 2^d block."""
    nd = block.ndim - 1
    if labels:
        return block[(slice(None), *(slice(None, None, 2),) * nd)]
    pad = [(0, 0)] + [(0, s % 2) for s in block.shape[1:]]
    if any(p[1] for p in pad):
        block = np.pad(block, pad, mode="edge")
    # The sum of the 2^d strided corners: 5x faster than a reshaped mean over interleaved axes.
    total: np.ndarray | None = None
    for corner in itertools.product((0, 1), repeat=nd):
        part = block[(slice(None), *(slice(c, None, 2) for c in corner))]
        total = part.astype(np.float64 if block.dtype == np.float64 else np.float32) if total is None else total + part
    assert total is not None
    return (total * (0.5 ** nd)).astype(block.dtype)


def build_level(root: Path, level: int, labels: bool, rank: int, world: int) -> None:
    """Write this rank's chunks (every ``world``-th) of ``level`` from ``level - 1`` (already complete)."""
    src, dst = LevelStore(root, level - 1), LevelStore(root, level)
    for i, region in enumerate(dst.chunk_regions()):
        if i % world != rank:
            continue
        up = [(2 * a, min(2 * b, s)) for (a, b), s in zip(region, src.shape[1:], strict=True)]
        small = _downsample(src.read(up), labels)
        dst.write(region, small[(slice(None), *(slice(0, b - a) for a, b in region))])


def ngff_attributes(name: str, levels: int, ndim: int, spacing: Sequence[float] | None = None) -> dict[str, Any]:
    """OME-NGFF 0.5 ``multiscales`` attributes of a ``(c, [z,] y, x)`` pyramid of ``levels`` levels."""
    space = list("zyx"[-ndim:])
    sp = [float(s) for s in spacing] if spacing is not None else [1.0] * ndim
    datasets = [{"path": str(k), "coordinateTransformations": [
        {"type": "scale", "scale": [1.0, *(s * 2**k for s in sp)]}]} for k in range(levels)]
    axes = [{"name": "c", "type": "channel"}] + [{"name": a, "type": "space"} for a in space]
    return {"ome": {"version": "0.5", "multiscales": [{"name": name, "axes": axes, "datasets": datasets}]}}
