"""The harvest's records file: written whole after every section (and every few rows), so a run cut
short by its time limit keeps what it measured.

Layout (``format`` "nowdl.gpu_records", ``version`` 1)::

    {"format", "version", "command", "started", "wall_s", "budget_s",
     "device": {name, kind, capability, total_memory, sm_count, driver, cuda, cudnn, context_bytes},
     "torch", "nowdl", "settings": {cudnn/tf32 flags, allocator config},
     "sections": {name: {"status": ok|error|skipped|partial, "wall_s", "error"}},
     <section name>: [rows...] or {...}}
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

__all__ = ["Records", "RECORDS_FORMAT", "RECORDS_VERSION", "log", "jsonable"]

RECORDS_FORMAT = "nowdl.gpu_records"
RECORDS_VERSION = 1


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)


def jsonable(v: Any) -> Any:
    """``v`` with non-finite floats as None, tuples as lists, tensors and dtypes as text."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, (int, str, bool)) or v is None:
        return v
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return jsonable(v.item())
    return str(v)


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def device_facts(device: torch.device) -> dict[str, Any]:
    """What the records were measured on."""
    if device.type != "cuda":
        return {"name": platform.processor() or platform.machine(), "kind": "cpu", "cores": os.cpu_count()}
    p = torch.cuda.get_device_properties(device)
    torch.cuda.init()
    torch.empty(1, device=device)  # the context exists: what it takes is total - free - reserved
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return {"name": p.name, "kind": "cuda", "capability": [p.major, p.minor], "total_memory": int(total),
            "sm_count": p.multi_processor_count, "driver": _driver(), "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "context_bytes": int(total - free - reserved),
            "free_after_context": int(free)}


def settings() -> dict[str, Any]:
    return {"cudnn.benchmark": torch.backends.cudnn.benchmark, "cudnn.deterministic": torch.backends.cudnn.deterministic,
            "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
            "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "PYTORCH_ALLOC_CONF": os.environ.get("PYTORCH_ALLOC_CONF"),
            "CUDNN_CONV_WSCAP_DBG": os.environ.get("CUDNN_CONV_WSCAP_DBG"),
            "expandable_segments": "expandable_segments:True" in (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "")
            + (os.environ.get("PYTORCH_ALLOC_CONF") or "")}


class Records:
    """One records file, rewritten atomically as rows arrive; sections run against one time budget."""

    def __init__(self, path: Path, device: torch.device, budget_s: float, command: str) -> None:
        import nowdl

        self.path = path
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self._last_flush = 0.0
        self._section_end = float("inf")
        self.data: dict[str, Any] = {
            "format": RECORDS_FORMAT, "version": RECORDS_VERSION, "command": command,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "wall_s": 0.0, "budget_s": budget_s,
            "device": device_facts(device), "torch": torch.__version__, "nowdl": nowdl.__version__,
            "python": platform.python_version(), "settings": settings(), "sections": {}}
        self.flush()

    def left(self) -> float:
        """Seconds left: of the budget, and of the running section's cap."""
        now = time.perf_counter()
        return min(self.budget_s - (now - self.t0), self._section_end - now)

    def rows(self, key: str) -> list[dict[str, Any]]:
        return self.data.setdefault(key, [])

    def add(self, key: str, row: dict[str, Any]) -> None:
        """Append ``row`` to the list ``key``; flush at most every 5 s."""
        self.rows(key).append(row)
        if time.perf_counter() - self._last_flush > 5.0:
            self.flush()

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.flush()

    def flush(self) -> None:
        self.data["wall_s"] = time.perf_counter() - self.t0
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(jsonable(self.data), indent=1))
        os.replace(tmp, self.path)
        self._last_flush = time.perf_counter()

    @contextmanager
    def section(self, name: str, need_s: float, cap_s: float = float("inf")) -> Iterator[bool]:
        """Run a section if ``need_s`` seconds are left (yields False, recorded as skipped, if not),
        for at most ``cap_s`` seconds (``left()`` counts down to it); an exception ends the section,
        recorded with its traceback, and the harvest goes on."""
        info: dict[str, Any] = {"status": "ok", "cap_s": cap_s}
        self.data["sections"][name] = info
        if self.left() < need_s:
            info.update(status="skipped", reason=f"{self.left():.0f} s left of the budget, the section needs ~{need_s:.0f} s")
            log(f"{name}: skipped ({info['reason']})")
            self.flush()
            yield False
            return
        log(f"{name}: start ({self.left():.0f} s left)")
        t = time.perf_counter()
        self._section_end = t + cap_s
        try:
            yield True
        except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others
            info.update(status="error", error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-6000:])
            log(f"{name}: ERROR {type(e).__name__}: {str(e)[:300]}")
        finally:
            info["wall_s"] = time.perf_counter() - t
            if info["status"] == "ok" and self.left() < 0:
                info["status"] = "partial"
            self._section_end = float("inf")
            log(f"{name}: {info['status']} in {info['wall_s']:.1f} s")
            self.flush()
