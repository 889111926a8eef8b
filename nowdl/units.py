"""Parsing of sizes ("80GiB") and shapes ("1x3x2048x2048") given by users."""

from __future__ import annotations

import re

from nowdl.errors import NowdlError

__all__ = ["parse_bytes", "parse_shape", "parse_parts", "format_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str | int | float) -> int:
    """'80GiB' -> 85899345920, '40GB' -> 40e9, 1024 -> 1024.

    Raises:
        NowdlError: not a positive size.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise NowdlError(f"a memory size must be positive, got {text}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise NowdlError(f"cannot read {text!r} as a memory size: write e.g. 80GiB, 40GB or 16000MiB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise NowdlError(f"a memory size must be positive, got {text!r}")
    return int(value)


def parse_shape(text: str) -> list[int]:
    """'1x3x2048x2048' -> [1, 3, 2048, 2048] (also accepts commas).

    Raises:
        NowdlError: not a list of positive integers.
    """
    parts = re.split(r"[x,×]", str(text).strip().lower())
    try:
        shape = [int(p) for p in parts if p.strip() != ""]
    except ValueError:
        shape = []
    if not shape or len(shape) != len(parts) or any(d <= 0 for d in shape):
        raise NowdlError(
            f"cannot read {text!r} as a shape: write positive integers joined by 'x', batch and "
            "channels first, e.g. 1x3x2048x2048 (2D) or 1x1x128x128x128 (3D)"
        )
    return shape


def parse_parts(text: str) -> int | tuple[int, ...]:
    """'4' -> 4, '4,2' -> (4, 2): spatial parts, one value or one per spatial stage.

    Raises:
        NowdlError: not positive integers.
    """
    try:
        vals = [int(v) for v in str(text).replace(" ", "").split(",")]
    except ValueError:
        raise NowdlError(f"spatial parts {text!r} must be an integer or a comma-separated list (e.g. 4 or 4,2)") from None
    if any(v < 1 for v in vals):
        raise NowdlError(f"spatial parts {text!r} must be positive")
    return vals[0] if len(vals) == 1 else tuple(vals)


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
