"""Measured links: point-to-point latency and bandwidth, all-reduce bus bandwidth (collective calls).

Every function here is called by every rank of an initialised process group. Times are medians
over repeats after warm-up; ``time = latency + bytes / bw`` is fitted by least squares on the
relative error (rows divided by the measured time), so a 1 KiB message weighs as much as a
64 MiB one. Point to point is a ping-pong between ranks 0 and 1 (one way = half the round
trip). The all-reduce is timed on every rank, the slowest rank's median counts, and its
bandwidth is the ring *bus* bandwidth: ``time = latency + 2 (n - 1) / n x bytes / bw``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nowdl.profiler.calibrate.ops import median_times
from nowdl.profiler.devices import DeviceSpec

__all__ = ["LinkFit", "fit_line", "link_device", "measure_p2p", "measure_allreduce", "measure_links",
           "links_to_spec", "probe_links", "with_links_file", "PROBE_SIZES", "QUICK_SIZES", "FULL_SIZES"]

log = logging.getLogger(__name__)

_KIB = 1024
#: message sizes (bytes): the run probe, ``nowdl calibrate --quick`` and the full calibration
PROBE_SIZES = (4 * _KIB, 256 * _KIB, 4096 * _KIB)
QUICK_SIZES = (_KIB, 64 * _KIB, 1024 * _KIB, 8192 * _KIB)
FULL_SIZES = tuple(_KIB * 4**i for i in range(9))  # 1 KiB .. 64 MiB
_CACHE_FORMAT = "nowdl.links"


@dataclass(frozen=True)
class LinkFit:
    """``time = latency_s + bytes / bw`` fitted to ``medians`` (seconds) at ``sizes`` (bytes)."""

    latency_s: float
    bw: float
    sizes: tuple[int, ...]
    medians: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"latency_s": self.latency_s, "bw": self.bw, "sizes": list(self.sizes),
                "medians_s": list(self.medians)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LinkFit:
        fit = cls(float(d["latency_s"]), float(d["bw"]), tuple(int(s) for s in d["sizes"]),
                  tuple(float(t) for t in d["medians_s"]))
        if not (fit.bw > 0 and fit.latency_s >= 0 and len(fit.sizes) == len(fit.medians)):
            raise ValueError(f"bad link fit {d}")
        return fit


def fit_line(xs: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """(latency, bandwidth) of ``t = latency + x / bandwidth``, least squares on relative error.

    The latency is clamped at 0 (refitted through the origin) and a non-positive slope falls
    back to the largest message's rate, so both are always usable.
    """
    x = np.asarray(xs, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if len(x) != len(t) or len(x) == 0 or not np.all(t > 0):
        raise ValueError(f"need as many positive times as sizes, got {list(xs)} and {list(times)}")
    a = np.stack([np.ones_like(x), x], axis=1) / t[:, None]
    (lat, slope), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if lat < 0 or len(x) == 1:
        lat = 0.0
        slope = float(np.sum(x / t) / np.sum((x / t) ** 2))  # through the origin, same weights
    if not slope > 0:
        i = int(np.argmax(x))
        slope = max(t[i] - lat, 1e-12) / x[i]
    return float(lat), float(1.0 / slope)


def link_device() -> torch.device:
    """Where the group's tensors live: this rank's CUDA device under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _share(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def measure_p2p(sizes: Sequence[int] = QUICK_SIZES, repeats: int = 5, warmup: int = 2) -> LinkFit | None:
    """Ping-pong between ranks 0 and 1 (None on a one-rank group); every rank gets the fit."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return None
    dev = link_device()
    bufs = [torch.zeros(max(1, n // 4), dtype=torch.float32, device=dev) for n in sizes]

    def ping(buf: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            if rank == 0:
                dist.send(buf, dst=1)
                dist.recv(buf, src=1)
            else:
                dist.recv(buf, src=0)
                dist.send(buf, dst=0)
        return run

    medians = [m / 2 for m in median_times([ping(b) for b in bufs], dev, repeats, warmup)] if rank < 2 else []
    fit = None
    if rank == 0:
        lat, bw = fit_line([float(n) for n in sizes], medians)
        fit = LinkFit(lat, bw, tuple(sizes), tuple(medians))
    dist.barrier()
    return _share(fit)  # type: ignore[no-any-return]


def measure_allreduce(sizes: Sequence[int] = QUICK_SIZES, repeats: int = 5, warmup: int = 2) -> LinkFit | None:
    """Sum all-reduce over the whole group (None on one rank); the fit's ``bw`` is the bus bandwidth."""
    world = dist.get_world_size()
    if world < 2:
        return None
    dev = link_device()
    bufs = [torch.zeros(max(1, n // 4), dtype=torch.float32, device=dev) for n in sizes]
    dist.barrier()
    mine = median_times([functools.partial(dist.all_reduce, b) for b in bufs], dev, repeats, warmup)
    slowest = torch.tensor(mine, dtype=torch.float64, device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    medians = [float(v) for v in slowest.tolist()]
    factor = 2 * (world - 1) / world
    lat, bw = fit_line([factor * n for n in sizes], medians)
    return LinkFit(lat, bw, tuple(sizes), tuple(medians))


def measure_links(sizes: Sequence[int] = QUICK_SIZES, repeats: int = 5,
                  say: Callable[[str], None] | None = None) -> dict[str, LinkFit | None]:
    """Both measurements (collective); ``say`` reports progress (rank 0 passes one)."""
    if say:
        say(f"point-to-point ping-pong, {len(sizes)} sizes x {repeats} repeats")
    p2p = measure_p2p(sizes, repeats)
    if say:
        say(f"all-reduce over {dist.get_world_size()} ranks")
    return {"p2p": p2p, "allreduce": measure_allreduce(sizes, repeats)}


def links_to_spec(spec: DeviceSpec, links: dict[str, LinkFit | None], *, allreduce: bool = True) -> DeviceSpec:
    """``spec`` with its link figures replaced by the measured ones (those that were measured)."""
    p2p, ar = links.get("p2p"), links.get("allreduce") if allreduce else None
    out = spec
    if p2p is not None:
        out = dataclasses.replace(out, link_bw=p2p.bw, link_latency_s=p2p.latency_s)
    if ar is not None:
        out = dataclasses.replace(out, allreduce_bw=ar.bw, allreduce_latency_s=ar.latency_s)
    return out


def _cache_path(cache_dir: Path, world: int) -> Path:
    dev = link_device()
    label = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    key = f"links-{os.uname().nodename}-{dist.get_backend()}-w{world}-{label}"
    return cache_dir / (re.sub(r"[^A-Za-z0-9._-]+", "_", key) + ".json")


def _read_cache(path: Path) -> dict[str, LinkFit | None] | None:
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        if d.get("format") != _CACHE_FORMAT:
            raise ValueError(f"format is {d.get('format')!r}, not {_CACHE_FORMAT!r}")
        return {k: None if d[k] is None else LinkFit.from_dict(d[k]) for k in ("p2p", "allreduce")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("ignoring corrupt link cache %s (%s): measuring again", path, e)
        return None


def probe_links(cache_dir: str | os.PathLike[str] | None, sizes: Sequence[int] = PROBE_SIZES,
                repeats: int = 5) -> tuple[dict[str, LinkFit | None], str]:
    """The short link probe of ``nowdl run`` (collective): rank 0's cached figures for this
    host, backend, world size and device when there are some, else measured now (and cached
    by rank 0). Returns the figures and where they came from (the cache file, or "measured")."""
    world = dist.get_world_size()
    path = _cache_path(Path(cache_dir), world) if cache_dir is not None else None
    hit = _read_cache(path) if path is not None and dist.get_rank() == 0 else None
    hit = _share(hit)
    if hit is not None:
        return hit, str(path)
    links = measure_links(sizes, repeats)
    if path is not None and dist.get_rank() == 0:
        from nowdl.profiler.cache import atomic_write_text

        body = {"format": _CACHE_FORMAT, "version": 1, "backend": dist.get_backend(), "world": world,
                **{k: None if v is None else v.to_dict() for k, v in links.items()}}
        try:
            atomic_write_text(path, json.dumps(body, indent=2))
        except OSError as e:
            log.warning("could not cache the link probe at %s: %s", path, e)
    return links, "measured"


def with_links_file(device_spec: str | None, links: dict[str, LinkFit | None], path: str | os.PathLike[str], *,
                    allreduce: bool = True) -> tuple[str, str]:
    """Write ``device_spec`` (a name or JSON path; None: h100) with the measured ``links`` to
    ``path`` (its node description kept), for the planner; returns the path and a one-line summary."""
    from nowdl.plan.topology import node_spec_for
    from nowdl.profiler.cache import atomic_write_text
    from nowdl.profiler.devices import get_device_spec

    arg = device_spec or "h100"
    spec = get_device_spec(arg)
    node = node_spec_for(arg, spec.name)
    d = links_to_spec(spec, links, allreduce=allreduce).to_dict()
    if node is not None:
        d["node"] = dataclasses.asdict(node)
    atomic_write_text(path, json.dumps(d, indent=2))
    p2p, ar = links.get("p2p"), links.get("allreduce") if allreduce else None
    parts = [f"point-to-point {p2p.bw / 1e9:.2f} GB/s + {p2p.latency_s * 1e6:.0f} us"] if p2p else []
    if ar is not None:
        parts.append(f"all-reduce {ar.bw / 1e9:.2f} GB/s + {ar.latency_s * 1e6:.0f} us")
    return str(path), ", ".join(parts)
