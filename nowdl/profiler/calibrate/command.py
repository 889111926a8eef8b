"""``nowdl calibrate``: measure links and compute on this backend and device, as a DeviceSpec.

Outside a launched job, :func:`calibrate` spawns ``ranks`` local processes (gloo on CPU; NCCL
when this machine has that many CUDA devices) that measure point-to-point latency and
bandwidth and the all-reduce (``calibrate_links``); the parent then measures the per-op
compute rates on its own device with ``threads`` CPU threads (``calibrate_ops``). Inside a
torchrun job every rank measures the links in the job's group and rank 0 the compute. The
result is a :class:`~nowdl.profiler.devices.DeviceSpec` whose optional calibrated fields are
filled (docs/calibrate.md), ready for ``--device-spec FILE``.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nowdl.errors import NowdlError
from nowdl.profiler.calibrate.links import (
    FULL_SIZES,
    QUICK_SIZES,
    LinkFit,
    links_to_spec,
    measure_links,
)
from nowdl.profiler.calibrate.ops import measure_ops
from nowdl.profiler.devices import OP_CLASSES, DeviceSpec

__all__ = ["calibrate", "calibrate_command", "format_spec", "check_calibrate_args", "check_out_path",
           "default_backend"]

_GIB = 2**30


def default_backend(ranks: int) -> str:
    """NCCL when this machine has ``ranks`` CUDA devices, else gloo."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= ranks else "gloo"


def check_calibrate_args(ranks: int, backend: str | None, threads: int | None, repeats: int | None) -> str:
    """The backend to use; NowdlError naming the bad option and the fix otherwise."""
    if threads is not None and threads < 1:
        raise NowdlError(f"--threads must be a positive integer, got {threads}")
    if repeats is not None and repeats < 1:
        raise NowdlError(f"--repeats must be a positive integer, got {repeats}")
    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend())
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise NowdlError(f"--ranks must be an integer >= 2 (links are measured between two processes), got {ranks}")
    chosen = backend or default_backend(ranks)
    if chosen not in ("gloo", "nccl"):
        raise NowdlError(f"--backend {chosen!r} is not supported: use gloo or nccl")
    if chosen == "nccl" and not (torch.cuda.is_available() and torch.cuda.device_count() >= ranks):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise NowdlError(f"--backend nccl needs {ranks} CUDA devices (one per rank), this machine has {have}: "
                         "use --backend gloo or fewer --ranks")
    return chosen


def _links_worker(rank: int, world: int, port: int, backend: str, sizes: tuple[int, ...], repeats: int,
                  timeout_s: float, results: Any) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        say = (lambda m: print(f"nowdl calibrate: {m}", file=sys.stderr, flush=True)) if rank == 0 else None
        links = measure_links(sizes, repeats, say=say)
        if rank == 0:
            results.put({k: None if v is None else v.to_dict() for k, v in links.items()})
    finally:
        dist.destroy_process_group()


def _spawn_links(ranks: int, backend: str, sizes: tuple[int, ...], repeats: int,
                 timeout_s: float) -> dict[str, LinkFit | None]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = mp.start_processes(_links_worker, args=(ranks, store.port, backend, sizes, repeats, timeout_s, results),
                               nprocs=ranks, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not procs.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise NowdlError(f"the {ranks} calibration processes did not finish in {timeout_s:g} s: "
                                 "is the machine overloaded? try --quick")
    except mp.ProcessRaisedException as e:
        raise NowdlError(f"a calibration process failed: {str(e).strip().splitlines()[-1]}") from e
    except mp.ProcessExitedException as e:
        raise NowdlError(f"a calibration process died ({e}); run again with -v for details") from e
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    got = results.get()
    return {k: None if v is None else LinkFit.from_dict(v) for k, v in got.items()}


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * _GIB


def calibrate(ranks: int = 2, *, backend: str | None = None, quick: bool = False, threads: int | None = None,
              repeats: int | None = None, timeout_s: float = 300.0,
              say: Callable[[str], None] | None = None) -> DeviceSpec:
    """Measure links between ``ranks`` processes and this device's compute; the calibrated spec.

    ``threads`` (CPU only; default 1, as torchrun gives each rank) is the torch thread count
    of the compute measurement. In a torchrun job (the default group is initialised) the job's
    group and backend are used and ``ranks``/``backend`` are ignored; every rank returns the spec.

    Raises:
        NowdlError: a bad option, or a calibration process that failed or hung.
    """
    reps = repeats or (7 if quick else 15)  # link repeats (cheap); the ops take 3 or 7 unless given
    sizes = QUICK_SIZES if quick else FULL_SIZES
    backend = check_calibrate_args(ranks, backend, threads, repeats)
    in_job = dist.is_available() and dist.is_initialized()
    if in_job:
        ranks = dist.get_world_size()
        if ranks < 2:
            raise NowdlError("nowdl calibrate inside a job needs at least 2 ranks (torchrun --nproc-per-node 2)")
    t0 = time.perf_counter()
    if in_job:
        links = measure_links(sizes, reps, say=say if dist.get_rank() == 0 else None)
    else:
        if say:
            say(f"starting {ranks} {backend} processes")
        links = _spawn_links(ranks, backend, sizes, reps, timeout_s)
    link_s = time.perf_counter() - t0
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    dtypes = [torch.float32] + ([torch.bfloat16, torch.float16] if device.type == "cuda" else [])
    ops: dict[str, dict[str, float]] = {}
    nthreads = threads or 1
    if not in_job or dist.get_rank() == 0:
        before = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(nthreads)
        try:
            ops = measure_ops(device, dtypes, quick=quick, repeats=repeats, say=say)
        finally:
            torch.set_num_threads(before)
    spec = _spec(device, ranks, str(backend), ops, links, quick, nthreads, link_s, time.perf_counter() - t0) \
        if ops else None
    if in_job:  # rank 0's spec, on every rank
        box = [spec]
        dist.broadcast_object_list(box, src=0)
        spec = box[0]
    if spec is None:
        raise NowdlError("calibration produced no spec on rank 0 (no compute rates were measured)")
    return spec


def _spec(device: torch.device, ranks: int, backend: str, ops: dict[str, dict[str, float]],
          links: dict[str, LinkFit | None], quick: bool, threads: int, link_s: float, total_s: float) -> DeviceSpec:
    if links.get("p2p") is None:
        raise NowdlError(f"no point-to-point figures were measured between {ranks} ranks: calibrate needs 2 or more")
    f32 = ops["float32"]
    fp32 = max(f32["conv2d"], f32["conv3d"], f32["matmul"])

    def low(dt: str) -> float:
        r = ops.get(dt)
        return max(r["conv2d"], r["conv3d"], r["matmul"]) if r else fp32

    if device.type == "cuda":
        label = torch.cuda.get_device_name(device)
        name = label.lower().replace(" ", "-") + "-calibrated"
    else:
        label = f"cpu ({threads} thread{'s' if threads != 1 else ''})"
        name = f"cpu-{threads}t-calibrated"
    base = DeviceSpec(name, fp32, low("bfloat16"), low("float16"), f32["elementwise"], 1.0,  # link_bw: below
                      _memory_bytes(device),
                      op_throughput=ops,
                      calibration={"host": socket.gethostname(), "device": label, "backend": backend, "ranks": ranks,
                                   "threads": threads if device.type == "cpu" else None, "quick": quick,
                                   "torch": torch.__version__, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "links": {k: None if v is None else v.to_dict() for k, v in links.items()},
                                   "link_seconds": round(link_s, 2), "seconds": round(total_s, 2)})
    return links_to_spec(base, links)


def _si(v: float, unit: str) -> str:
    for div, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= div:
            return f"{v / div:.3g} {p}{unit}"
    return f"{v:.3g} {unit}"


def format_spec(spec: DeviceSpec) -> str:
    """A short table of what a calibrated spec holds (link figures, then per-op rates)."""
    lines = [f"device spec {spec.name!r}", "| what | value |", "|---|---|",
             f"| point-to-point bandwidth (link_bw) | {_si(spec.link_bw, 'B/s')} |"]
    if spec.link_latency_s is not None:
        lines.append(f"| point-to-point latency (link_latency_s) | {spec.link_latency_s * 1e6:.1f} us |")
    if spec.allreduce_bw is not None:
        lines.append(f"| all-reduce bus bandwidth (allreduce_bw) | {_si(spec.allreduce_bw, 'B/s')} |")
    if spec.allreduce_latency_s is not None:
        lines.append(f"| all-reduce latency (allreduce_latency_s) | {spec.allreduce_latency_s * 1e6:.1f} us |")
    for dt, rates in (spec.op_throughput or {}).items():
        for cls_, r in rates.items():
            unit = "FLOP/s" if OP_CLASSES[cls_] == "flops" else "B/s"
            lines.append(f"| {cls_} fwd+bwd {dt} | {_si(r, unit)} |")
    lines.append(f"| memory_bytes | {spec.memory_bytes / _GIB:.1f} GiB |")
    return "\n".join(lines)


def check_out_path(out: str | os.PathLike[str]) -> Path:
    """``out`` as a Path if a file can be written there (checked before measuring; nothing is created)."""
    p = Path(out)
    if p.is_dir():
        raise NowdlError(f"--out {out} is a folder: give a file name, e.g. --out {p / 'device-spec.json'}")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise NowdlError(f"--out {out}: {parent} is a file, not a folder: choose another path")
    if not os.access(parent, os.W_OK):
        raise NowdlError(f"--out {out}: cannot write in {parent}: choose a writable folder")
    return p


def calibrate_command(out: str | os.PathLike[str], **kwargs: Any) -> int:
    """``nowdl calibrate``: measure (progress on stderr), write ``out`` atomically on rank 0, print the table."""
    from nowdl.profiler.cache import atomic_write_text

    path = check_out_path(out)
    check_calibrate_args(kwargs.get("ranks", 2), kwargs.get("backend"), kwargs.get("threads"), kwargs.get("repeats"))
    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    say = (lambda m: print(f"nowdl calibrate: {m}", file=sys.stderr, flush=True)) if rank0 else None
    spec = calibrate(say=say, **kwargs)
    if rank0:
        atomic_write_text(path, spec.to_json() + "\n")
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(path, 0o666 & ~mask)  # an ordinary file for the user, not the temp file's 0600
        print(format_spec(spec))
        print(f"wrote {path}: plan with --device-spec {path}")
    return 0
