"""From stored pixels to the model's input: the one dtype rule, nodata, per-band normalisation.

[Note: input values] Every reader's pixels go through :func:`pixels`:

1. Scale by dtype: an integer image is divided by the largest value of its type (uint8 by 255,
   uint16 by 65535, int16 by 32767, ...), so full-range imagery lands in [0, 1] ([-1, 1]
   signed); a bool image is 0 or 1; a float image is kept as it is.
2. Normalise per band, when asked (``--normalize``, :class:`Normalize`): ``(x - mean) / std``
   with the band's mean and std taken on the scaled values of step 1.
3. Nodata: a pixel is nodata where any band equals the raster's nodata value (``geotiff:``
   rasters declare one) or is NaN or infinite. Its input is 0 in every band (after step 2) and
   its label, wherever a mask is read with it, is :data:`IGNORE_INDEX` (-100, which
   ``torch.nn.CrossEntropyLoss`` ignores by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nowdl.errors import NowdlError

__all__ = ["IGNORE_INDEX", "Normalize", "scale", "invalid", "pixels", "labels", "may_have_nodata",
           "check_nodata", "parse_normalize"]

#: The label of a nodata pixel (``torch.nn.CrossEntropyLoss``'s default ``ignore_index``).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Normalize:
    """Per-band ``(x - mean) / std`` on the dtype-scaled pixels (one mean and one std per band)."""

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.mean) != len(self.std):
            raise NowdlError(f"--normalize gives {len(self.mean)} mean(s) but {len(self.std)} std(s): give one of "
                             "each per band")
        bad = [s for s in self.std if not (math.isfinite(s) and s > 0)]
        if bad or not all(math.isfinite(m) for m in self.mean):
            raise NowdlError(f"--normalize needs finite means and positive finite stds, got std {bad[0] if bad else ''}"
                             f"{'' if bad else 'with a non-finite mean'}: fix the values")

    def check(self, channels: int, where: str) -> None:
        """Raise unless there is one mean and one std per input band."""
        if len(self.mean) != channels:
            raise NowdlError(f"--normalize gives {len(self.mean)} value(s) per statistic but {where} has {channels} "
                             f"band(s): give {channels} means and {channels} stds, or --normalize auto")

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(C, *S)`` normalised per band."""
        shape = (len(self.mean),) + (1,) * (x.dim() - 1)
        mean = torch.tensor(self.mean, dtype=x.dtype).view(shape)
        std = torch.tensor(self.std, dtype=x.dtype).view(shape)
        return (x - mean) / std

    def text(self) -> str:
        """``mean=a,b,std=c,d`` (what ``--normalize`` takes back)."""
        return (f"mean={','.join(f'{m:.6g}' for m in self.mean)},"
                f"std={','.join(f'{s:.6g}' for s in self.std)}")

    def to_json(self) -> dict[str, list[float]]:
        return {"mean": list(self.mean), "std": list(self.std)}

    @staticmethod
    def from_json(obj: Any, where: str) -> Normalize:
        try:
            return Normalize(tuple(float(v) for v in obj["mean"]), tuple(float(v) for v in obj["std"]))
        except (KeyError, TypeError, ValueError):
            raise NowdlError(f"{where} records no readable normalisation ({obj!r}): give --normalize") from None


def parse_normalize(text: str | None) -> Normalize | str | None:
    """``--normalize``: None, ``"auto"``, or ``mean=a,b,..,std=c,d,..`` as a :class:`Normalize`.

    Raises:
        NowdlError: another form, a value that is not a number, unequal counts, a std <= 0.
    """
    if text is None or text == "auto":
        return text
    form = "write --normalize mean=M1,M2,...,std=S1,S2,... (one per band) or --normalize auto"
    body = text.replace(" ", "")
    if not body.startswith("mean=") or ",std=" not in body:
        raise NowdlError(f"--normalize {text}: {form}")
    mean_text, _, std_text = body[len("mean="):].partition(",std=")
    try:
        mean = tuple(float(v) for v in mean_text.split(","))
        std = tuple(float(v) for v in std_text.split(","))
    except ValueError:
        raise NowdlError(f"--normalize {text}: the values must be numbers; {form}") from None
    return Normalize(mean, std)


def scale(arr: np.ndarray) -> torch.Tensor:
    """Step 1 of [Note: input values]: float32 pixels from any stored dtype."""
    a = np.ascontiguousarray(arr)
    if a.dtype == np.bool_:
        return torch.from_numpy(a.astype(np.float32))
    if a.dtype.kind in "iu":
        top = np.iinfo(a.dtype).max
        if a.dtype.itemsize <= 2:  # exact in float32
            return torch.from_numpy(a.astype(np.float32) / np.float32(top))
        return torch.from_numpy((a.astype(np.float64) / float(top)).astype(np.float32))
    return torch.from_numpy(a).float()


def may_have_nodata(dtype: Any, nodata: float | None) -> bool:
    """True when pixels of ``dtype`` can be nodata (a declared value, or NaN in a float image)."""
    return nodata is not None or np.dtype(dtype).kind in "fc"


def invalid(arr: np.ndarray, nodata: float | None) -> np.ndarray | None:
    """Nodata pixels ``(*S)`` of ``arr`` ``(C, *S)``: any band equal to ``nodata`` or not finite (None: none)."""
    bad: np.ndarray | None = None
    if np.dtype(arr.dtype).kind in "fc":
        bad = ~np.isfinite(arr).all(axis=0)
    if nodata is not None and not (isinstance(nodata, float) and math.isnan(nodata)):
        hit = (arr == np.asarray(nodata).astype(arr.dtype)).any(axis=0)
        bad = hit if bad is None else bad | hit
    return bad if bad is not None and bool(bad.any()) else None


def pixels(arr: np.ndarray, nodata: float | None = None, normalize: Normalize | None = None) -> torch.Tensor:
    """The model's input ``(C, *S)`` from stored pixels ``arr`` ``(C, *S)`` ([Note: input values])."""
    bad = invalid(arr, nodata) if may_have_nodata(arr.dtype, nodata) else None
    x = scale(arr)
    if normalize is not None:
        x = normalize.apply(x)
    if bad is not None:
        x = x.masked_fill(torch.from_numpy(bad)[None], 0.0)
    return x


def labels(mask: np.ndarray, mask_nodata: float | None = None, image_bad: np.ndarray | None = None) -> torch.Tensor:
    """Integer labels ``(*S)`` from a mask region, with :data:`IGNORE_INDEX` where the mask is its
    own nodata value or the image's pixels are nodata (``image_bad``)."""
    y = torch.from_numpy(np.ascontiguousarray(mask)).long()
    if mask_nodata is not None and not math.isnan(mask_nodata):
        y = y.masked_fill(torch.from_numpy(np.ascontiguousarray(mask == mask_nodata)), IGNORE_INDEX)
    if image_bad is not None:
        y = y.masked_fill(torch.from_numpy(image_bad), IGNORE_INDEX)
    return y


def check_nodata(nodata: float | None, dtype: Any, where: str) -> None:
    """Raise unless ``nodata`` is a value pixels of ``dtype`` can hold (NaN: a float type only)."""
    if nodata is None:
        return
    dt = np.dtype(dtype)
    fix = ("give a value its pixels can hold (geotiff:PATH:nodata=V), or fix the file's (gdal_edit.py -a_nodata V "
           "PATH; -unsetnodata removes it)")
    if dt.kind in "iu":
        info = np.iinfo(dt)
        if math.isnan(nodata) or nodata != int(nodata) or not info.min <= nodata <= info.max:
            raise NowdlError(f"{where} declares nodata {nodata:g}, which its {dt.name} pixels cannot hold "
                             f"({info.min}..{info.max} integers), so no pixel can be nodata as it says: {fix}")
    elif dt.kind == "f" and math.isfinite(nodata) and abs(nodata) > float(np.finfo(dt).max):
        raise NowdlError(f"{where} declares nodata {nodata:g}, outside its {dt.name} pixels' range "
                         f"(+-{float(np.finfo(dt).max):.4g}): {fix}")
