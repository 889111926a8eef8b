"""Whole-slide images through OpenSlide (``openslide:PATH[:level=N]``), read by region.

OpenSlide (openslide-python with openslide-bin) reads Aperio .svs, Hamamatsu .ndpi, MIRAX
.mrxs, Leica .scn, Ventana .bif and generic tiled TIFF. A level is ``(H, W, 3)`` uint8 RGB
(the alpha channel is dropped: pixels outside the scanned area read as 0); only the regions
asked for are decoded, so a 100k x 100k slide is never held whole.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from nowdl.errors import NowdlError

__all__ = ["SLIDE_EXTS", "SlideLevel", "open_slides", "slide_levels"]

SLIDE_EXTS = (".svs", ".ndpi", ".mrxs", ".scn", ".bif", ".vms", ".vmu", ".svslide", ".tif", ".tiff")


def _openslide(spec: str) -> Any:
    try:
        import openslide
    except ImportError:
        raise NowdlError(f"{spec} needs openslide-python and openslide-bin, which are not installed: "
                         "pip install openslide-python openslide-bin") from None
    return openslide


class SlideLevel:
    """Level ``level`` of the slide at ``path`` as a lazily sliced ``(H, W, 3)`` uint8 array."""

    def __init__(self, path: str, level: int) -> None:
        import openslide

        self.path, self.level = path, level
        self.slide = openslide.OpenSlide(path)
        w, h = self.slide.level_dimensions[level]
        self.down = float(self.slide.level_downsamples[level])
        self.shape = (int(h), int(w), 3)
        self.dtype = np.dtype(np.uint8)

    def __getitem__(self, index: Any) -> np.ndarray:
        idx = index if isinstance(index, tuple) else (index,)
        sl = [idx[i] if i < len(idx) else slice(None) for i in range(3)]
        (y0, y1, _), (x0, x1, _) = (s.indices(n) for s, n in zip(sl[:2], self.shape[:2], strict=True))
        h, w = max(0, y1 - y0), max(0, x1 - x0)
        if h == 0 or w == 0:
            return np.zeros((h, w, 3), np.uint8)[:, :, sl[2]]
        img = self.slide.read_region((int(round(x0 * self.down)), int(round(y0 * self.down))), self.level, (w, h))
        return np.asarray(img)[:, :, :3][:, :, sl[2]]


def slide_levels(path: str | Path) -> list[tuple[int, int]]:
    """``(H, W)`` of every level of the slide at ``path``."""
    import openslide

    with openslide.OpenSlide(str(path)) as s:
        return [(int(h), int(w)) for w, h in s.level_dimensions]


def open_slides(path: Path, level: int, spec: str) -> list[tuple[str, Callable[[], Any]]]:
    """``(name, opener)`` for the slide at ``path`` (or every slide in the folder) at ``level``.

    Raises:
        NowdlError: openslide missing, an unreadable slide, no slides in the folder, a level out of range.
    """
    openslide = _openslide(spec)
    files = sorted(f for f in path.iterdir() if f.suffix.lower() in SLIDE_EXTS) if path.is_dir() else [path]
    if not files:
        raise NowdlError(f"{spec}: the folder {path} holds no slides ({', '.join(SLIDE_EXTS)}); put them there "
                         "or name one file")
    out: list[tuple[str, Callable[[], Any]]] = []
    for f in files:
        try:
            with openslide.OpenSlide(str(f)) as s:
                levels = int(s.level_count)
        except Exception as e:
            raise NowdlError(f"cannot open {f} with OpenSlide ({type(e).__name__}: {e}): it reads .svs, .ndpi, .mrxs, "
                             ".scn, .bif and tiled TIFF; convert the slide or use tiff:{f}") from None
        if not 0 <= level < levels:
            raise NowdlError(f"{f} has {levels} level(s) (0..{levels - 1}) but {spec} asks for level {level}: "
                             f"use level=0..{levels - 1}")
        out.append((str(f) + (f" level {level}" if level else ""), functools.partial(SlideLevel, str(f), level)))
    return out
