"""The device specs' data: the fields of a spec JSON file and their checks, and ``fitted.json``, the
fields ``benchmarks/fit_specs.py`` fits to the GPU records (read by ``nowdl.profiler.devices``).
"""

from __future__ import annotations

import math
from typing import Any

from nowdl.errors import NowdlError

__all__ = ["OP_CLASSES", "TILE_OP_KINDS", "DTYPES", "HOST_FIELDS", "OPTIONAL_FIELDS", "check_efficiency",
           "check_op_throughput", "check_tile_op", "opt_float"]

#: op classes of ``DeviceSpec.op_throughput``: FLOP/s for conv2d/conv3d/matmul, bytes/s for the rest
OP_CLASSES = {"conv2d": "flops", "conv3d": "flops", "matmul": "flops", "elementwise": "bytes", "norm": "bytes"}
HOST_FIELDS = ("host_memory", "host_link_bw")  # host offload: not part of a profile's cache key
OPTIONAL_FIELDS = ("link_latency_s", "allreduce_bw", "allreduce_latency_s", "op_throughput", "calibration",
             "host_memory", "host_link_bw", "tile_op_s", "tile_op_bwd_s", "recompute_tensor_s", "op_floor_s",
             "op_efficiency", "conv_workspace", "context_bytes")
DTYPES = ("float32", "bfloat16", "float16")
TILE_OP_KINDS = ("conv", "pool", "upsample", "norm")
"""Op kinds the spatial runtime runs through its own tiled implementation (``runtime/spatial/dispatch.py``)."""
_DTYPES = DTYPES


def opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def check_tile_op(v: Any, key: str) -> dict[str, float] | None:
    """Validate ``tile_op_s``/``tile_op_bwd_s``: ``{kind: non-negative seconds}`` (errors name the entry)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise NowdlError(f"device spec field {key!r} must be an object {{kind: seconds}} with kinds "
                         f"{list(TILE_OP_KINDS)}, got {v!r}")
    for kind, sec in v.items():
        if kind not in TILE_OP_KINDS or isinstance(sec, bool) or not isinstance(sec, (int, float)) \
                or not math.isfinite(sec) or sec < 0:
            raise NowdlError(f"device spec field {key!r} has entry {kind!r}: {sec!r}; kinds are {list(TILE_OP_KINDS)} "
                             f"and seconds a non-negative number")
    return {str(k): float(x) for k, x in v.items()}


def check_efficiency(v: Any) -> dict[str, tuple[float, float]] | None:
    """Validate ``op_efficiency``: ``{op class or "other": [top in (0, 1], half >= 0]}``."""
    if v is None:
        return None
    classes = (*OP_CLASSES, "other")
    if not isinstance(v, dict):
        raise NowdlError(f"device spec field 'op_efficiency' must be an object {{class: [top, half]}}, got {v!r}")
    out: dict[str, tuple[float, float]] = {}
    for k, pair in v.items():
        ok = (k in classes and isinstance(pair, (list, tuple)) and len(pair) == 2
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in pair))
        if not ok or not 0 < pair[0] <= 1 or pair[1] < 0:
            raise NowdlError(f"device spec field 'op_efficiency' has entry {k!r}: {pair!r}; keys are {list(classes)} and "
                             "values [top, half] with 0 < top <= 1 and half >= 0")
        out[str(k)] = (float(pair[0]), float(pair[1]))
    return out


def check_op_throughput(v: Any) -> dict[str, dict[str, float]] | None:
    """Validate ``op_throughput``: ``{dtype: {op class: positive rate}}`` (errors name the entry)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise NowdlError(f"device spec field 'op_throughput' must be an object {{dtype: {{op class: rate}}}}, got {v!r}")
    out: dict[str, dict[str, float]] = {}
    for dt, rates in v.items():
        if dt not in _DTYPES or not isinstance(rates, dict):
            raise NowdlError(f"device spec field 'op_throughput' has entry {dt!r}: keys must be dtypes {list(_DTYPES)} "
                             "mapping to objects {op class: rate}")
        for cls_, r in rates.items():
            if cls_ not in OP_CLASSES:
                raise NowdlError(f"device spec field 'op_throughput.{dt}' has unknown op class {cls_!r}; "
                                 f"valid classes: {sorted(OP_CLASSES)}")
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not (math.isfinite(r) and r > 0):
                raise NowdlError(f"device spec field 'op_throughput.{dt}.{cls_}' must be a positive number, got {r!r}")
        out[dt] = {c: float(r) for c, r in rates.items()}
    return out


