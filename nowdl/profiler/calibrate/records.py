"""GPU records: what ``benchmarks/gpu_check.py`` measured on a GPU, read back for fitting and testing.

A records file (``format`` "nowdl.gpu_records", ``version`` 1) holds the device, the torch
version, the command and, per section, the measured rows: ``steps`` (a model's training,
recompute, offload, sequential-tile or inference step with ``max_allocated`` and ``step_s``, and
the ``compile`` keywords that plan it again), ``profiles`` (per-node or total forward and
backward times), ``ops`` (single ops over a grid) and more. The device specs are fitted from them
(``benchmarks/fit_specs.py``) and the tests check the fit against every row.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nowdl.errors import NowdlError

__all__ = ["Records", "load_records", "RECORDS_FORMAT", "RECORDS_VERSION"]

log = logging.getLogger(__name__)

RECORDS_FORMAT = "nowdl.gpu_records"
RECORDS_VERSION = 1


@dataclass(frozen=True)
class Records:
    """One records file: its path, what it ran on, and its sections."""

    path: Path
    data: dict[str, Any]

    @property
    def device(self) -> str:
        return str(self.data.get("device", {}).get("name", "?"))

    @property
    def torch(self) -> str:
        return str(self.data.get("torch", "?"))

    def rows(self, section: str) -> list[dict[str, Any]]:
        """The measured rows of ``section`` (rows that failed or were skipped left out)."""
        rows = self.data.get(section, [])
        if isinstance(rows, dict):
            rows = rows.get("rows", [])
        return [r for r in rows if isinstance(r, dict) and "error" not in r and "skipped" not in r]


def load_records(path: str | os.PathLike[str], *, warn: bool = True) -> Records:
    """Read and check a records file. One made with another torch version (or on another driver)
    is used with a warning that names both, since kernels and their workspaces change between
    versions.

    Raises:
        NowdlError: the file is missing, not JSON, or not a records file of a known version.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise NowdlError(f"cannot read the GPU records {p}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise NowdlError(f"{p} is not a GPU records file: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != RECORDS_FORMAT:
        raise NowdlError(f"{p} is not a GPU records file (format {data.get('format') if isinstance(data, dict) else '?'!r}, "
                         f"expected {RECORDS_FORMAT!r}): make one with benchmarks/gpu_check.py")
    if data.get("version") != RECORDS_VERSION:
        raise NowdlError(f"{p} is a records file of version {data.get('version')!r}; this nowdl reads version "
                         f"{RECORDS_VERSION}: upgrade nowdl or make the records again with benchmarks/gpu_check.py")
    rec = Records(p, data)
    if warn:
        mine = torch.__version__.split("+")[0]
        theirs = rec.torch.split("+")[0]
        if mine != theirs:
            log.warning("GPU records %s were measured with torch %s on %s (driver %s); this is torch %s: kernels and "
                        "their workspaces may differ, so the fit may not hold here", p.name, rec.torch, rec.device,
                        data.get("device", {}).get("driver"), torch.__version__)
    return rec
