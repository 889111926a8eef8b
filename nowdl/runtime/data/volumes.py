"""NIfTI volumes through nibabel (``nifti:PATH``: a .nii/.nii.gz file or a folder of them).

A volume is ``(X, Y, Z)`` (one channel) or ``(X, Y, Z, C)`` as nibabel returns it, in voxel
order; the affine and voxel spacing stay in the header (:func:`nifti_header`), which predict
copies into a NIfTI output. nibabel reads regions of an uncompressed .nii from disk; a .nii.gz
is decompressed as it is read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from nowdl.errors import NowdlError

__all__ = ["NIFTI_EXTS", "open_volumes", "nifti_header", "is_nifti"]

NIFTI_EXTS = (".nii", ".nii.gz")


def is_nifti(path: str | Path) -> bool:
    """True for a name ending in .nii or .nii.gz."""
    return str(path).lower().endswith(NIFTI_EXTS)


def _nibabel(spec: str) -> Any:
    try:
        import nibabel
    except ImportError:
        raise NowdlError(f"{spec} needs nibabel, which is not installed: pip install nibabel") from None
    return nibabel


def _volume(path: str) -> Any:
    import nibabel

    return nibabel.load(path).dataobj  # type: ignore[attr-defined]


def nifti_header(path: str | Path) -> tuple[np.ndarray, tuple[float, ...]]:
    """The ``(4, 4)`` affine and the voxel spacing of the volume at ``path``."""
    import nibabel

    img: Any = nibabel.load(str(path))
    return np.asarray(img.affine, dtype=np.float64), tuple(float(z) for z in img.header.get_zooms()[:3])


def open_volumes(path: Path, spec: str) -> list[tuple[str, Callable[[], Any]]]:
    """``(name, opener)`` for the volume at ``path`` or every .nii/.nii.gz in the folder.

    Raises:
        NowdlError: nibabel missing, no volumes in the folder, a file nibabel cannot read.
    """
    nibabel = _nibabel(spec)
    files = sorted(f for f in path.iterdir() if is_nifti(f)) if path.is_dir() else [path]
    if not files:
        raise NowdlError(f"{spec}: the folder {path} holds no .nii/.nii.gz volumes; put them there or name one file")
    out: list[tuple[str, Callable[[], Any]]] = []
    for f in files:
        try:
            nibabel.load(str(f))
        except Exception as e:
            raise NowdlError(f"cannot read {f} as NIfTI ({type(e).__name__}: {e}): check the file") from None
        out.append((str(f), functools.partial(_volume, str(f))))
    return out
