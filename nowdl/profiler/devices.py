"""Device specs (peak FLOP/s, memory and link bandwidth) for estimate-mode roofline timing."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from nowdl.errors import NowdlError
from nowdl.profiler.specs import (
    HOST_FIELDS,
    OP_CLASSES,
    OPTIONAL_FIELDS,
    TILE_OP_KINDS,
    check_efficiency,
    check_op_throughput,
    check_tile_op,
    opt_float,
)

__all__ = ["DeviceSpec", "BUILTIN_SPECS", "DATASHEET_SPECS", "FITTED_PATH", "HOST_FIELDS", "get_device_spec",
           "measure_cpu_spec", "OP_CLASSES", "TILE_OP_KINDS", "CONTEXT_BYTES", "memory_reserve", "fitted_specs",
           "nominal_specs"]

log = logging.getLogger(__name__)

_GIB = 2**30
_MIB = 2**20




@dataclass(frozen=True)
class DeviceSpec:
    """Peak throughputs of one accelerator: FLOP/s per dtype, bytes/s, bytes.

    Numbers are dense (no structured sparsity) peaks. ``tf32_flops`` is the tensor-core
    rate for float32 convolutions/matmuls when TF32 is allowed (None: no TF32).
    ``link_bw`` is the one-direction GPU-to-GPU bandwidth (NVLink) the planner charges
    for boundary tensors inside a node. A spec JSON may also hold a ``"node"`` object (GPUs
    per node, inter-node bandwidth and latency: see ``nowdl.plan.topology``). ``memory_bytes`` is the device memory as reported by the driver.

    Optional, measured by ``nowdl calibrate`` (docs/calibrate.md; None: not measured):
    ``link_latency_s`` (seconds per point-to-point message, used for halo exchanges),
    ``allreduce_bw``/``allreduce_latency_s`` (ring bus bandwidth and per-call latency of the
    all-reduce inside a node), ``op_throughput`` (``{dtype: {op class: rate}}``, the achieved
    FLOP/s or bytes/s per class of :data:`OP_CLASSES`, which the estimate-mode roofline uses
    in place of the peaks) and ``calibration`` (where and how it was measured).
    ``tile_op_s``/``tile_op_bwd_s`` (``{kind: seconds}``, kinds of :data:`TILE_OP_KINDS`): what
    the spatial runtime adds per tiled op forward/backward beyond the op itself ([Note: tiled
    runtime overhead] in partitioner/costs/tile_overhead.py); None or a kind left out: not charged.
    ``recompute_tensor_s``: seconds a recomputed stage's hooks spend per tensor autograd saves
    ([Note: recompute hooks] in partitioner/costs/levers.py); None: not charged.

    Optional, fitted from a GPU's records (``benchmarks/fit_specs.py``; None: not fitted):
    ``op_floor_s`` (seconds every aten op that does work costs at least: launch and small-kernel
    overhead), ``op_efficiency`` (``{op class or "other": [top, half]}``: the fraction of the peak an
    op reaches, ``top x work / (work + half)``, [Note: op efficiency]), ``conv_workspace`` (bytes of
    cuDNN workspace per byte of a convolution's operands, [Note: convolution workspace] in
    profiler/memory.py) and ``context_bytes`` (what the CUDA context and the libraries' handles take
    of ``memory_bytes`` before the first tensor: a plan reserves it).

    Optional, for host offload (None or 0: no host memory to offload to): ``host_memory`` (bytes of
    host RAM of one node, shared by the node's GPUs: the spec's ``"node"`` or the built-in DGX
    node, [Note: host offload] in partitioner/costs/levers.py) and ``host_link_bw`` (bytes/s one
    GPU copies to or from host memory, one direction, as achieved rather than the PCIe peak).
    """

    name: str
    fp32_flops: float
    bf16_flops: float
    fp16_flops: float
    mem_bw: float
    link_bw: float
    memory_bytes: int
    tf32_flops: float | None = None
    link_latency_s: float | None = None
    allreduce_bw: float | None = None
    allreduce_latency_s: float | None = None
    op_throughput: dict[str, dict[str, float]] | None = field(default=None, hash=False)
    calibration: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    host_memory: int | None = None
    host_link_bw: float | None = None
    tile_op_s: dict[str, float] | None = field(default=None, hash=False)
    tile_op_bwd_s: dict[str, float] | None = field(default=None, hash=False)
    recompute_tensor_s: float | None = None
    op_floor_s: float | None = None
    op_efficiency: dict[str, tuple[float, float]] | None = field(default=None, hash=False)
    conv_workspace: float | None = None
    context_bytes: int | None = None

    def efficiency(self, op_class: str | None, work: float) -> float:
        """The fraction of the rate an op of ``op_class`` doing ``work`` (FLOPs, or bytes for the
        byte classes) reaches ([Note: op efficiency]); 1 when the spec has no fit."""
        table = self.op_efficiency or {}
        e = table.get(op_class or "other") or table.get("other")
        if e is None:
            return 1.0
        top, half = e
        return top * work / (work + half) if half > 0 else top

    def achieved(self, op_class: str, dtype: torch.dtype | str) -> float | None:
        """The calibrated rate of ``op_class`` in ``dtype`` (FLOP/s or bytes/s), None if not measured."""
        rates = (self.op_throughput or {}).get(_dtype_name(dtype))
        return None if rates is None else rates.get(op_class)

    def flops_for(self, dtype: torch.dtype | str, *, tf32: bool = False) -> float:
        """Peak FLOP/s for ``dtype``; ``tf32`` selects the TF32 tensor-core rate for float32.

        float64 is taken as half the float32 rate; integer and other dtypes as float32.
        """
        d = _dtype_name(dtype)
        if d == "float16":
            return self.fp16_flops
        if d == "bfloat16":
            return self.bf16_flops
        if d == "float32" and tf32 and self.tf32_flops:
            return self.tf32_flops
        if d == "float64":
            return self.fp32_flops / 2
        return self.fp32_flops

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (JSON-ready); optional calibrated fields only when set."""
        d = asdict(self)
        return {k: v for k, v in d.items() if not (k in OPTIONAL_FIELDS and v is None)}

    def to_json(self) -> str:
        """JSON text of this spec (what :meth:`from_json` reads back)."""
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceSpec:
        """Build a spec from a dict, validating every field (errors name the bad field)."""
        if not isinstance(d, dict):
            raise NowdlError(f"device spec must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known - {"node"})  # "node": the cluster's nodes (plan/topology.py)
        if unknown:
            raise NowdlError(
                f"device spec has unknown field(s) {unknown}; valid fields: {sorted(known)}"
            )
        required = ("name", "fp32_flops", "bf16_flops", "fp16_flops", "mem_bw", "link_bw",
                    "memory_bytes")
        missing = [k for k in required if k not in d]
        if missing:
            raise NowdlError(f"device spec is missing field(s) {missing}")
        if not isinstance(d["name"], str) or not d["name"]:
            raise NowdlError(f"device spec field 'name' must be a non-empty string, got {d['name']!r}")
        for k in ("fp32_flops", "bf16_flops", "fp16_flops", "mem_bw", "link_bw", "memory_bytes",
                  "tf32_flops"):
            v = d.get(k)
            if k == "tf32_flops" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise NowdlError(f"device spec field {k!r} must be a positive number, got {v!r}")
        for k in ("link_latency_s", "allreduce_bw", "allreduce_latency_s", "recompute_tensor_s"):
            v = d.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v < 0 or (k == "allreduce_bw" and v == 0)):
                raise NowdlError(f"device spec field {k!r} must be a {'positive' if k == 'allreduce_bw' else 'non-negative'} "
                                 f"number (or absent), got {v!r}")
        for k in ("host_memory", "host_link_bw"):  # host_memory 0: none to offload to, as absent
            v = d.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v < 0 or (v == 0 and k == "host_link_bw")):
                raise NowdlError(f"device spec field {k!r} must be a positive number{' or 0' if k == 'host_memory' else ''} "
                                 f"(or absent), got {v!r}")
        for k in ("op_floor_s", "conv_workspace", "context_bytes"):
            v = d.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
                raise NowdlError(f"device spec field {k!r} must be a non-negative number (or absent), got {v!r}")
        calib = d.get("calibration")
        if calib is not None and not isinstance(calib, dict):
            raise NowdlError(f"device spec field 'calibration' must be a JSON object (or absent), got {calib!r}")
        return cls(
            name=d["name"],
            fp32_flops=float(d["fp32_flops"]),
            bf16_flops=float(d["bf16_flops"]),
            fp16_flops=float(d["fp16_flops"]),
            mem_bw=float(d["mem_bw"]),
            link_bw=float(d["link_bw"]),
            memory_bytes=int(d["memory_bytes"]),
            tf32_flops=None if d.get("tf32_flops") is None else float(d["tf32_flops"]),
            link_latency_s=opt_float(d.get("link_latency_s")),
            allreduce_bw=opt_float(d.get("allreduce_bw")),
            allreduce_latency_s=opt_float(d.get("allreduce_latency_s")),
            op_throughput=check_op_throughput(d.get("op_throughput")),
            calibration=calib,
            host_memory=None if d.get("host_memory") is None else int(d["host_memory"]),
            host_link_bw=opt_float(d.get("host_link_bw")),
            tile_op_s=check_tile_op(d.get("tile_op_s"), "tile_op_s"),
            tile_op_bwd_s=check_tile_op(d.get("tile_op_bwd_s"), "tile_op_bwd_s"),
            recompute_tensor_s=opt_float(d.get("recompute_tensor_s")),
            op_floor_s=opt_float(d.get("op_floor_s")),
            op_efficiency=check_efficiency(d.get("op_efficiency")),
            conv_workspace=opt_float(d.get("conv_workspace")),
            context_bytes=None if d.get("context_bytes") is None else int(d["context_bytes"]),
        )

    @classmethod
    def from_json(cls, text: str) -> DeviceSpec:
        """Parse JSON text written by :meth:`to_json` (or by hand)."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise NowdlError(f"device spec is not valid JSON: {e}") from e
        return cls.from_dict(d)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DeviceSpec:
        """Read a spec from a JSON file."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise NowdlError(f"cannot read device spec file {p}: {e}") from e
        try:
            return cls.from_json(text)
        except ValueError as e:
            raise NowdlError(f"{p}: {e}") from e


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


#: What the CUDA context and the cuDNN/cuBLAS handles of one process take of a GPU's memory
#: before its first tensor (torch's caching allocator never sees it). Assumed, not measured here
#: yet: ``benchmarks/gpu_check.py`` records it (``device.context_bytes``) for the next fit.
CONTEXT_BYTES = 768 * _MIB

# Public datasheet numbers, dense. link_bw = NVLink bandwidth per GPU, one direction.
# host_memory: system RAM of the vendor's 8-GPU server (DGX-1 V100: 512 GiB; DGX A100 640GB:
# 2 TiB; DGX H100 and DGX H200: 2 TiB), shared by its 8 GPUs. host_link_bw: what one GPU achieves
# copying pinned memory to or from the host, one direction, about 85% of the PCIe x16 peak
# (Gen3 16 GB/s -> 12e9, Gen4 32 GB/s -> 25e9, Gen5 64 GB/s -> 55e9; NVIDIA's bandwidthTest on
# H100 SXM reports 55 GB/s).
_TIB = 2**40
DATASHEET_SPECS: dict[str, DeviceSpec] = {
    # V100 SXM2: 15.7 TF fp32, 125 TF fp16 tensor; no bf16 (taken as fp32), 900 GB/s HBM2,
    # NVLink2 300 GB/s total (150 GB/s per direction). DGX-1: 512 GiB host, PCIe Gen3.
    "v100": DeviceSpec("v100", 15.7e12, 15.7e12, 125e12, 900e9, 150e9, 32 * _GIB,
                       host_memory=512 * _GIB, host_link_bw=12e9),
    "v100-16gb": DeviceSpec("v100-16gb", 15.7e12, 15.7e12, 125e12, 900e9, 150e9, 16 * _GIB,
                            host_memory=512 * _GIB, host_link_bw=12e9),
    # A100 SXM 80GB: 19.5 TF fp32, 156 TF tf32, 312 TF bf16/fp16, 2039 GB/s HBM2e,
    # NVLink3 600 GB/s total. DGX A100 640GB: 2 TiB host, PCIe Gen4.
    "a100": DeviceSpec("a100", 19.5e12, 312e12, 312e12, 2039e9, 300e9, 80 * _GIB, 156e12,
                       host_memory=2 * _TIB, host_link_bw=25e9),
    # H100 SXM5 80GB: 67 TF fp32, 494.5 TF tf32, 989.4 TF bf16/fp16, 3.35 TB/s HBM3,
    # NVLink4 900 GB/s total. DGX H100: 2 TiB host, PCIe Gen5. Memory: what the driver reports
    # (81,559 MiB, nvidia-smi), not the nominal 80 GiB.
    "h100": DeviceSpec("h100", 67e12, 989.4e12, 989.4e12, 3.35e12, 450e9, 81559 * _MIB, 494.5e12,
                       host_memory=2 * _TIB, host_link_bw=55e9, context_bytes=CONTEXT_BYTES),
    # H200 SXM 141GB: H100 compute, 4.8 TB/s HBM3e, NVLink4 900 GB/s total. DGX H200: 2 TiB host.
    # Memory: what the driver reports (143,771 MiB, seen on an H200 of this project).
    "h200": DeviceSpec("h200", 67e12, 989.4e12, 989.4e12, 4.8e12, 450e9, 143771 * _MIB,
                       494.5e12, host_memory=2 * _TIB, host_link_bw=55e9, context_bytes=CONTEXT_BYTES),
}


FITTED_PATH = Path(__file__).resolve().parent / "specs" / "fitted.json"
"""The fields ``benchmarks/fit_specs.py`` fitted to the GPU records (benchmarks/records/)."""


def _with_fit(specs: dict[str, DeviceSpec]) -> dict[str, DeviceSpec]:
    """The datasheet specs with the fitted fields of :data:`FITTED_PATH` ([Note: op efficiency])."""
    try:
        fitted = json.loads(FITTED_PATH.read_text())
    except (OSError, ValueError):
        return dict(specs)
    out = dict(specs)
    for name, f in fitted.items():
        if name not in out:
            continue
        t = f.get("time", {})
        out[name] = dataclasses.replace(
            out[name], op_floor_s=t.get("floor_s"), conv_workspace=f.get("conv_workspace") or None,
            op_efficiency={"other": (float(t["top"]), float(t["half"]))} if "top" in t else None,
            calibration={"fitted_by": f.get("fitted_by"), "records": f.get("records"), "torch": f.get("torch")})
    return out


def fitted_specs() -> dict[str, DeviceSpec]:
    """The datasheet specs with their GPU records' fit: what ``BUILTIN_SPECS`` holds by default."""
    return _with_fit(DATASHEET_SPECS)


def nominal_specs() -> dict[str, DeviceSpec]:
    """The datasheet's peaks alone: an H100's nominal 80 GiB, no fitted efficiency, floor or
    convolution workspace, no reserve (``NOWDL_SPECS=nominal``): pure rooflines, for comparing
    with them or for tests of the planner's logic that a device's quirks would blur."""
    keep = dict(context_bytes=None)
    return {k: dataclasses.replace(v, **keep, memory_bytes=80 * _GIB if k == "h100" else v.memory_bytes)
            for k, v in DATASHEET_SPECS.items()}


BUILTIN_SPECS: dict[str, DeviceSpec] = (nominal_specs() if os.environ.get("NOWDL_SPECS", "").strip() == "nominal"
                                         else fitted_specs())
"""The built-in specs: the datasheet's peaks, the driver's capacities, the memory reserve, and for
the GPUs with records the fitted efficiency, per-op floor and convolution workspace
([Note: op efficiency]); ``NOWDL_SPECS=nominal`` plans with :func:`nominal_specs` instead."""



def _time_best(fn: Any, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu_spec(cache_dir: str | os.PathLike[str] | None = None) -> DeviceSpec:
    """Measure this machine's CPU once (a 512² fp32 matmul and a 64 MiB copy), cached on disk.

    bf16/fp16 are taken as the fp32 rate; ``link_bw`` as the copy bandwidth.
    """
    path: Path | None = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"cpu-spec-{os.uname().nodename}-{torch.get_num_threads()}t.json"
        if path.exists():
            try:
                return DeviceSpec.load(path)
            except ValueError as e:
                log.warning("ignoring corrupt CPU spec cache %s: %s", path, e)
    n = 512
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    flops = 2 * n**3 / _time_best(lambda: torch.mm(a, b))
    src = torch.empty(16 * _MIB, dtype=torch.float32)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 4 / _time_best(lambda: dst.copy_(src))  # read + write
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 16 * _GIB
    spec = DeviceSpec("cpu", flops, flops, flops, bw, bw, int(mem))
    if path is not None:
        from nowdl.profiler.cache import atomic_write_text

        try:
            atomic_write_text(path, spec.to_json())
        except OSError as e:
            log.warning("could not cache CPU spec at %s: %s", path, e)
    return spec


def get_device_spec(
    name_or_path: str | os.PathLike[str] | DeviceSpec | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> DeviceSpec:
    """A built-in spec by name (``v100``, ``v100-16gb``, ``a100``, ``h100``, ``h200``,
    ``cpu``), a spec from a JSON file path, or ``spec`` itself; None means ``h100``.

    ``cpu`` is measured on this machine once and cached in ``cache_dir`` when given.
    """
    if name_or_path is None:
        return BUILTIN_SPECS["h100"]
    if isinstance(name_or_path, DeviceSpec):
        return name_or_path
    if isinstance(name_or_path, os.PathLike) or str(name_or_path).endswith(".json"):
        return DeviceSpec.load(name_or_path)
    if not isinstance(name_or_path, str):
        raise NowdlError(f"device_spec must be a name, a JSON path or a DeviceSpec, "
                         f"got {type(name_or_path).__name__}")
    key = name_or_path.strip().lower()
    if key in BUILTIN_SPECS:
        return BUILTIN_SPECS[key]
    if key == "cpu":
        return measure_cpu_spec(cache_dir)
    if os.path.isfile(name_or_path):
        return DeviceSpec.load(name_or_path)
    names = sorted([*BUILTIN_SPECS, "cpu"])
    raise NowdlError(
        f"unknown device spec {name_or_path!r}; built-in names are {names}, "
        f"or pass the path of a JSON file with the DeviceSpec fields"
    )


NCCL_BYTES = 256 * _MIB
SLACK = 0.02


def memory_reserve(spec: DeviceSpec, gpus: int) -> dict[str, int]:
    """What a plan keeps of each GPU's memory for what it does not model, by term ([Note: memory reserve]).

    [Note: memory reserve] A GPU process holds memory that torch's caching allocator never
    hands out to tensors: the CUDA context and the cuDNN and cuBLAS handles (``context_bytes``
    of the spec), NCCL's buffers when several GPUs talk (``NCCL_BYTES``), and the allocator's
    own slack, the free parts of its cached segments that a request of another size cannot use
    (``SLACK`` of the memory). A plan caps each rank at ``memory_bytes`` less this reserve and
    shows the reserve as a line of its own (``nowdl plan``, ``nowdl show``, the memory picture).
    The context and slack figures are assumed until a GPU's records measure them
    (``benchmarks/gpu_check.py`` records the context and the allocator's reserved bytes); a spec
    without ``context_bytes`` (the CPU) reserves nothing.
    """
    if not spec.context_bytes:
        return {}
    out = {"context_bytes": int(spec.context_bytes), "slack_bytes": int(SLACK * spec.memory_bytes)}
    if gpus > 1:
        out["nccl_bytes"] = NCCL_BYTES
    return out
