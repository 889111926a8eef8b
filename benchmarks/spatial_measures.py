"""Measurements of issue 10 for bench_spatial.py: halo overlap, spatial stage step, peak memory.

Imported by ``benchmarks/bench_spatial.py`` (its module docstring says what each table means);
the functions named ``*_case`` run inside that script's spawned gloo ranks, one call per rank.

* :func:`overlap_case` (Table 4): per conv layer ``Conv2d(16, 16, 3, padding=1) + ReLU`` on a
  tile, forward + backward, three ways, all ranks at once, a barrier before each repeat:
  ``compute`` the same unpadded conv on an already assembled window (no communication),
  ``off`` the tiled conv with the halo exchange completed before the op, ``on`` the tiled conv
  overlapping it ([Note: halo overlap] in ``nowdl/runtime/spatial/window_op.py``). The repeats of
  the three alternate, so machine load drifts hit all of them alike.
* :func:`step_case` (Table 5): forward + backward of a whole spatial stage, overlap on vs off.
* :func:`memory_case` (Table 6): peak bytes of one training step (``nowdl.runtime.training.metrics.
  peak_of``: parameters, buffers and Adam state + the peak of storages aten ops allocate, as
  bench_runtime measures them) against the plan's ``predicted_peak_bytes`` of the rank.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import nowdl
from nowdl.partitioner.spatial.tileable import slice_grid
from nowdl.runtime.spatial import halo_exchange, set_halo_overlap, tile_forward
from nowdl.runtime.spatial.tiles import TileGrid
from nowdl.runtime.training.metrics import peak_of

__all__ = ["overlap_case", "step_case", "slowest", "memory_case", "MEMORY_CASES", "memory_model", "memory_batch"]

CHANNELS = 16
SEED = 0


def _timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def overlap_case(side: int, p: int, warmup: int, repeats: int) -> dict[str, Any]:
    """Medians (this rank) of one conv layer's fwd+bwd: no-communication compute, overlap off, on."""
    rank = dist.get_rank()
    grid = TileGrid.for_rank((side, side), slice_grid("square", p, 2), rank, tuple(range(p)))
    g = torch.Generator().manual_seed(SEED + side)
    full = torch.randn(1, CHANNELS, side, side, generator=g)
    tile = grid.split(full).clone()
    conv = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1)
    window = halo_exchange(tile, grid, [(1, 1), (1, 1)]).detach()  # the window the tiled conv computes on
    # image boundary: the tiled conv pads with zeros there, as the window does

    def compute() -> None:
        xw = window.detach().requires_grad_(True)
        y = F.relu(F.conv2d(xw, conv.weight, conv.bias))
        y.backward(torch.ones_like(y))

    def tiled(on: bool) -> Callable[[], None]:
        def run() -> None:
            set_halo_overlap(on)
            x = tile.detach().requires_grad_(True)
            y = F.relu(tile_forward(conv, x, grid)[0])
            y.backward(torch.ones_like(y))
        return run

    runs = {"compute": compute, "off": tiled(False), "on": tiled(True)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(warmup + repeats):
        for k in (list(runs) if i % 2 == 0 else list(reversed(runs))):
            t = _timed(runs[k])
            conv.zero_grad(set_to_none=True)
            if i >= warmup:
                times[k].append(t)
    set_halo_overlap(True)
    return {"side": side, "grid": grid.grid, "tile": grid.tile_shape(), "raw": times,
            **{k: statistics.median(v) for k, v in times.items()}}


def conv_stack(depth: int = 4) -> nn.Sequential:
    """``depth`` x (Conv2d(16, 16, 3, padding=1) + ReLU): the stage of Table 5's first rows."""
    torch.manual_seed(SEED)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers)


def step_case(run_stage: Callable[[], torch.Tensor], warmup: int, repeats: int,
              alone: Callable[[], torch.Tensor] | None = None) -> dict[str, float]:
    """Medians (this rank) of a spatial stage's forward + backward with overlap off and on.

    ``run_stage()`` runs the stage's forward on this rank's tile and returns an output tile;
    ``alone()``, when given, the same module on the tile with no exchange at all (zero padding
    at the tile's edges, norms on the tile's own statistics): the compute a perfect overlap
    would leave, so ``alone / off`` is the floor of ``on / off``.
    """
    def step(fn: Callable[[], torch.Tensor], on: bool) -> Callable[[], None]:
        def run() -> None:
            set_halo_overlap(on)
            y = fn()
            y.backward(torch.ones_like(y))
        return run

    runs = {"off": step(run_stage, False), "on": step(run_stage, True)}
    if alone is not None:
        runs["alone"] = step(alone, True)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(warmup + repeats):
        for k in (list(runs) if i % 2 == 0 else list(reversed(runs))):
            t = _timed(runs[k])
            if i >= warmup:
                times[k].append(t)
    set_halo_overlap(True)
    return {"raw": times, **{k: statistics.median(v) for k, v in times.items()}}


def slowest(rows: list[dict[str, Any]], key: str) -> float:
    """Median over the repeats of the slowest rank's time of each repeat (``rows``: one per rank).

    A step ends when its last rank ends. The tiled runs end with waits on the peers, so each
    rank's time already includes the others' lateness, while the no-communication ``compute``
    does not: per-rank medians would give compute the median rank and the tiled runs about the
    slowest rank of each repeat, and count the ranks' load imbalance as halo time.
    """
    return statistics.median(max(r["raw"][key][i] for r in rows) for i in range(len(rows[0]["raw"][key])))


def conv_stack_stage(side: int, p: int) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """The conv stack on this rank's tile of a 1 x 16 x side x side image: tiled, and alone
    (the plain stack on the tile, no exchange; see ``step_case``)."""
    rank = dist.get_rank()
    grid = TileGrid.for_rank((side, side), slice_grid("square", p, 2), rank, tuple(range(p)))
    stack = conv_stack()
    g = torch.Generator().manual_seed(SEED + 3 * side)
    tile = grid.split(torch.randn(1, CHANNELS, side, side, generator=g)).clone().requires_grad_(True)

    def run() -> torch.Tensor:
        stack.zero_grad(set_to_none=True)
        return tile_forward(stack, tile, grid)[0]

    def alone() -> torch.Tensor:
        stack.zero_grad(set_to_none=True)
        return stack(tile)

    return run, alone


# ---- Table 6: measured peak vs predicted -------------------------------------------------------

MEMORY_CASES: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("1 spatial stage, P=2", {"gpus": 2, "stages": 1}, "off"),
    ("1 spatial stage, P=2", {"gpus": 2, "stages": 1}, "auto"),
    ("spatial P=2 + plain stage", {"gpus": 3, "stages": 2, "spatial_stages": 1}, "off"),
    ("spatial P=2 + plain stage", {"gpus": 3, "stages": 2, "spatial_stages": 1}, "auto"),
)
"""(label, nowdl.compile options, halo_fusion) of Table 6's plans."""


def memory_model() -> nn.Module:
    """nowdl's UNet, depth 2, width 8, 1 -> 2 channels (long skips, transposed convs)."""
    torch.manual_seed(SEED)
    return nowdl.models.unet(1, 2, depth=2, base_width=8)


def memory_batch(m: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(m, 1, side, side, generator=g), torch.randn(m, 2, side, side, generator=g)


def memory_case(rank: int, world: int, plan_path: str, m: int, side: int) -> dict[str, Any]:
    """One rank of a planned run: the measured peak of its third training step."""
    torch.set_num_threads(1)
    cm = nowdl.compile(memory_model(), plan=plan_path, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
                       loss_fn=nn.MSELoss(), cache=False, progress=False, timeout_s=300, backend="gloo")
    x, y = memory_batch(m, side)
    for _ in range(2):  # the engine built, Adam's state made
        cm.train_step(x, y)
    eng = cm._trainer.engine
    held = [eng.stages[s].module for _, s in eng.held]
    dist.barrier()
    loss, peak = peak_of(lambda: cm.train_step(x, y), held, eng.optimizer)
    return {"rank": rank, "peak": peak, "loss": loss}
