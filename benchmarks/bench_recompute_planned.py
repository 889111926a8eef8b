"""Recompute chosen by the planner under a cap, measured on CPU gloo ranks: peak per rank and its cost.

What is measured
----------------
Each row is planned as a user would: ``nowdl.compile(model, gpus=2, mode="measure", device="cpu",
gpu_memory=CAP, recompute="auto", offload="off", <pins>).plan(x)`` (``--mode estimate``: the
``cpu`` spec's roofline instead of ops timed on this CPU), with a cap just under what the plan
needs without recomputation, so that the planner chooses to recompute some stage (the stages it
chose are printed). The same plan with every stage's ``recompute`` set to False (and no ``recompute_segment``) is the "off"
variant. Two gloo processes (one thread each, ``tests/helpers/distributed.py``'s
``run_workers``) train both variants from the same weights and batches: a warm-up step, the
peak of one step under nowdl's aten allocation tracker (``nowdl.runtime.training.metrics.peak_of``:
parameters, buffers and Adam state before the step plus the peak of the storages the step
allocates; the batch is made before the step, as ``nowdl run``'s meter and bench_runtime do: the
caller's global batch, which every rank is handed whole, is shown apart), then ``--repeats``
timed steps per variant, the variants alternating (ABBA), each between barriers.

* Table 1, peak: measured / ``plan.ranks[r].predicted_peak_bytes`` (target ±10%);
* Table 2, recomputation's cost per rank: the CPU time of a step on the rank's main thread
  (``time.thread_time``, the clock measure mode profiles the ops on with one thread; time waiting
  for the other rank or for a core the machine's other jobs hold is not counted), min over the
  repeats, planned minus off, against the predicted ``sum over the rank's stages of
  micro-batches x stages[s].predicted["recompute_s"]`` (target ±15%). The process's CPU time
  (``time.process_time``: it adds gloo's own threads, which burn CPU while a message waits for
  its receive to be posted, about as long as it waits) and the wall-clock difference (min over
  the repeats) are printed beside it.

Before planning, the links are measured on the same 2 gloo ranks (``calibrated_spec``: nowdl
calibrate's ping-pong fit for ``link_bw``; ``link_latency_s`` = the main thread's CPU time of one
halo exchange round, ``isend`` + ``irecv`` + wait, as runtime/spatial/exchange.py makes it, so
the plan's halo and norm waits are on table 2's clock), and the host work of the runtime that
the profile does not see, on the same clock: ``tile_op_s``/``tile_op_bwd_s`` per op kind (the
runtime's tiled conv, pool, transposed conv and BatchNorm on one half of the image against the
plain op on the whole over 2: [Note: tiled runtime overhead] in partitioner/costs/tile_overhead.py)
and ``recompute_tensor_s`` (the runtime's ``Recompute`` on a probe stage against its plain
forward, per saved tensor: [Note: recompute hooks] in partitioner/costs/levers.py).
``--no-calibrate`` plans on the built-in ``cpu`` spec, which has none of these.

Rows: pipeline (ResNet-20 v1, 2 stages, 1F1B, 4 micro-batches), spatial (nowdl UNet depth 3
width 8, one stage on 2 tiles, GPipe, 2 micro-batches: one spatial stage holds one micro-batch
under 1F1B, where recomputing saves nothing, [Note: recompute cost]), MASTER (replicas=2,
2 stages, GPipe, 4 micro-batches per replica, nowdl UNet).

Table 3: the largest square side (multiple of 16) that plans under a fixed per-rank cap on
2 ranks (ResNet-20, 2 stages, GPipe, 4 micro-batches), recompute "auto" vs "off", found by
doubling then bisection in estimate mode; then one real training step at each found side, its
measured peak per rank against the plan and the cap. Target: side with / without >= 1.5.

How to run
----------
    .venv/bin/python benchmarks/bench_recompute_planned.py --quick

Tables go to stdout as Markdown, progress to stderr. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.distributed import run_workers  # noqa: E402

import nowdl  # noqa: E402
from nowdl.errors import NowdlError  # noqa: E402
from nowdl.plan.plan import Plan  # noqa: E402
from nowdl.profiler import DeviceSpec, get_device_spec  # noqa: E402
from nowdl.profiler.calibrate.links import QUICK_SIZES, links_to_spec, measure_p2p  # noqa: E402
from nowdl.runtime.training.metrics import peak_of  # noqa: E402

__all__ = ["main"]

MIB = float(1 << 20)

from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "unet":
        return nowdl.models.unet(1, 2, depth=3, base_width=8)
    return nowdl.models.resnet(depth=20, version=1, width=16, num_classes=10, conv_bias=False)


def loss_of(kind: str) -> nn.Module:
    return nn.MSELoss() if kind == "unet" else nn.CrossEntropyLoss()


def batch(kind: str, step: int, n: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "unet":
        return torch.randn(n, 1, side, side, generator=g), torch.randn(n, 2, side, side, generator=g)
    return torch.randn(n, 3, side, side, generator=g), torch.randint(0, 10, (n,), generator=g)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


MODE = {"mode": "estimate", "device_spec": "cpu"}
"""How table 1 profiles: ``--mode measure`` times the ops on this CPU (``mode="measure", device="cpu"``)."""


HALO_PROBE_BYTES = (1024, 4096, 16384)  # the UNet rows' halo slabs: a few KiB each


def calibrate_worker(rank: int, world: int, rounds: int) -> dict[str, Any]:
    """On the bench's 2 gloo ranks: nowdl calibrate's ping-pong fit (wall clock), and the halo
    exchange's own pattern (``isend`` + ``irecv`` to the neighbour, then wait: one round per
    exchange, as ``runtime/spatial/exchange.py`` does) timed in this process's CPU time and in wall time."""
    torch.set_num_threads(1)
    fit = measure_p2p(QUICK_SIZES, repeats=5)
    cpu, wall = [], []
    for n in HALO_PROBE_BYTES:
        out, inp = torch.zeros(n // 4), torch.zeros(n // 4)
        for i in range(rounds + 10):
            dist.barrier()
            c0, t0 = time.thread_time(), time.perf_counter()
            for w in (dist.isend(out, 1 - rank), dist.irecv(inp, 1 - rank)):
                w.wait()
            if i >= 10:
                cpu.append(time.thread_time() - c0)
                wall.append(time.perf_counter() - t0)
    ar_cpu, ar_wall = [], []
    stats = torch.zeros(2, 33, dtype=torch.float64)  # a tile norm's statistics ([Note: tile norm latency])
    for i in range(rounds + 10):
        dist.barrier()
        c0, t0 = time.thread_time(), time.perf_counter()
        dist.all_reduce(stats)
        if i >= 10:
            ar_cpu.append(time.thread_time() - c0)
            ar_wall.append(time.perf_counter() - t0)
    fwd, bwd = tile_op_probe(rank, rounds)
    per_tensor = recompute_probe(rounds)
    return {"recompute_tensor_s": per_tensor, "p2p": fit, "cpu_s": statistics.median(cpu), "wall_s": statistics.median(wall),
            "ar_cpu_s": statistics.median(ar_cpu), "ar_wall_s": statistics.median(ar_wall),
            "tile_fwd": fwd, "tile_bwd": bwd}


TILE_PROBES = {  # kind: (module, input channels and side of the full image): the UNet rows' first level
    "conv": (lambda: nn.Conv2d(8, 8, 3, padding=1), (8, 128)),
    "pool": (lambda: nn.MaxPool2d(2), (8, 128)),
    "upsample": (lambda: nn.ConvTranspose2d(16, 8, 2, stride=2), (16, 64)),
    "norm": (lambda: nn.BatchNorm2d(8), (8, 128)),
}


def recompute_probe(rounds: int) -> float:
    """Thread CPU seconds the runtime's recompute (``runtime.pipeline.recompute.Recompute``) adds
    per saved tensor beyond the forward it runs again: a probe stage (conv, BatchNorm, ReLU, x4,
    8 channels, 64²) trained one micro-batch plain and under ``Recompute`` (forward, recompute,
    backward), the least of ``rounds`` each; (recomputed - plain - plain forward) / tensors saved
    ([Note: recompute hooks] in partitioner/costs/levers.py)."""
    from nowdl.profiler.memory import capture_saved
    from nowdl.runtime.pipeline.recompute import Recompute

    torch.manual_seed(0)
    mod = nn.Sequential(*[m for _ in range(4) for m in (nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())])
    x = torch.randn(1, 8, 64, 64)
    saved: list[torch.Tensor] = []
    with capture_saved(saved):
        mod(x.requires_grad_(True))
    n = len(saved)
    del saved
    rc = Recompute({0}, torch.device("cpu"))
    fwd, plain, again = [], [], []
    for i in range(rounds + 5):
        c0 = time.thread_time()
        y = mod(x)
        c1 = time.thread_time()
        y.sum().backward()
        c2 = time.thread_time()
        y = rc.forward((0, 0, i), mod, lambda: mod(x))
        rc.recompute((0, 0, i))
        y.sum().backward()
        c3 = time.thread_time()
        rc.drop((0, 0, i))
        if i >= 5:
            fwd.append(c1 - c0)
            plain.append(c2 - c0)
            again.append(c3 - c2)
    return max(0.0, (min(again) - min(plain) - min(fwd)) / n)


def tile_op_probe(rank: int, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per op kind, the thread CPU time the spatial runtime adds to a tiled op beyond the op:
    ``runtime.spatial.dispatch.tile_forward`` on this rank's half (2 x 1 grid) against the plain
    module on the whole image over 2, forward and backward, the least of ``rounds`` each
    ([Note: tiled runtime overhead] in partitioner/costs/tile_overhead.py), never below 0."""
    from nowdl.runtime.spatial.dispatch import tile_forward
    from nowdl.runtime.spatial.tiles import TileGrid

    fwd, bwd = {}, {}
    for kind, (make, (ch, side)) in TILE_PROBES.items():
        torch.manual_seed(0)
        mod = make()
        full = torch.randn(1, ch, side, side)
        grid = TileGrid.for_rank((side, side), (2, 1), rank)
        tile = grid.split(full)

        def tiled(x: torch.Tensor = tile, g: TileGrid = grid, m: nn.Module = mod) -> torch.Tensor:
            return tile_forward(m, x, g)[0]

        times = {}
        for name, fn, x in (("tiled", tiled, tile), ("plain", mod, full)):
            f_s, b_s = [], []
            for i in range(rounds + 5):
                xi = x.detach().requires_grad_(True)
                dist.barrier()
                c0 = time.thread_time()
                y = fn(xi)
                c1 = time.thread_time()
                y.backward(torch.ones_like(y))
                c2 = time.thread_time()
                if i >= 5:
                    f_s.append(c1 - c0)
                    b_s.append(c2 - c1)
            times[name] = (min(f_s), min(b_s))
        fwd[kind] = max(0.0, times["tiled"][0] - times["plain"][0] / 2)
        bwd[kind] = max(0.0, times["tiled"][1] - times["plain"][1] / 2)
    return fwd, bwd


def calibrated_spec(rounds: int = 100) -> DeviceSpec:
    """The ``cpu`` spec with this machine's links measured on 2 gloo ranks now: ``link_bw`` from
    nowdl calibrate's ping-pong, ``link_latency_s`` the CPU time of one halo exchange round (the
    mean of the ranks' medians), so the plan's halo waits are on table 2's clock (CPU time)."""
    res = run_workers(calibrate_worker, 2, rounds, timeout_s=600)
    fit = res[0]["p2p"]
    cpu = sum(r["cpu_s"] for r in res) / len(res)
    wall = sum(r["wall_s"] for r in res) / len(res)
    per_rank = ", ".join(f"{r['cpu_s'] * 1e6:.0f}" for r in res)
    ar_cpu = sum(r["ar_cpu_s"] for r in res) / len(res)
    ar_wall = sum(r["ar_wall_s"] for r in res) / len(res)
    spec = links_to_spec(get_device_spec("cpu"), {"p2p": fit}, allreduce=False)
    tile_fwd = {k: sum(r["tile_fwd"][k] for r in res) / len(res) for k in TILE_PROBES}
    tile_bwd = {k: sum(r["tile_bwd"][k] for r in res) / len(res) for k in TILE_PROBES}
    tiles = ", ".join(f"{k} {tile_fwd[k] * 1e6:.0f} + {tile_bwd[k] * 1e6:.0f}" for k in TILE_PROBES)
    per_tensor = sum(r["recompute_tensor_s"] for r in res) / len(res)
    log(f"calibrated on 2 gloo ranks: ping-pong (wall) {fit.latency_s * 1e6:.0f} us + bytes at "
        f"{fit.bw / 1e9:.2f} GB/s; halo exchange round {cpu * 1e6:.0f} us CPU, {wall * 1e6:.0f} us wall "
        f"(ranks: {per_rank} us CPU); norm all-reduce {ar_cpu * 1e6:.0f} us CPU, {ar_wall * 1e6:.0f} us wall")
    print(f"Links calibrated on the same 2 gloo ranks before planning: ping-pong (wall, nowdl calibrate's fit) "
          f"{fit.latency_s * 1e6:.0f} us + bytes at {fit.bw / 1e9:.2f} GB/s; one halo exchange round "
          f"(isend + irecv + wait, median of {rounds} x {len(HALO_PROBE_BYTES)} sizes) {cpu * 1e6:.0f} us CPU, "
          f"{wall * 1e6:.0f} us wall; a tile norm's statistics all-reduce {ar_cpu * 1e6:.0f} us CPU, "
          f"{ar_wall * 1e6:.0f} us wall. The plans use link_latency_s = {cpu * 1e6:.0f} us (CPU, table 2's clock) "
          f"and link_bw = {fit.bw / 1e9:.2f} GB/s. The tiled runtime's work per op beyond the op "
          f"(tile_op_s + tile_op_bwd_s, thread CPU, least of {rounds}): {tiles} us; the recompute's hooks per saved "
          f"tensor (recompute_tensor_s): {per_tensor * 1e6:.1f} us.\n")
    log(f"tiled runtime per op (fwd + bwd): {tiles} us; recompute hooks {per_tensor * 1e6:.1f} us per saved tensor")
    return dataclasses.replace(spec, link_latency_s=cpu, tile_op_s=tile_fwd, tile_op_bwd_s=tile_bwd,
                               recompute_tensor_s=per_tensor)


def plan_for(kind: str, side: int, cap_mib: float, recompute: str, pins: dict[str, Any],
             mode: dict[str, Any] | None = None) -> Plan:
    """The planner's plan (estimate mode, ``cpu`` spec, unless ``mode``) for one sample at ``side``;
    raises NowdlError if none fits."""
    x, y = batch(kind, 0, 1, side)
    cm = nowdl.compile(make_model(kind), gpus=2, **(mode or MODE), gpu_memory=int(cap_mib * MIB),
                       recompute=recompute, offload="off", tiles_per_gpu=1, optimizer=adam, loss_fn=loss_of(kind),
                       cache=False, progress=False, **pins)
    return cm.plan(x, target=y)


def chosen_stages(plan: Plan) -> str:
    """The recomputed stages, each with its segment's nodes where only a prefix is recomputed."""
    return ", ".join(f"{s.index}" + (f" (nodes {s.recompute_segment[0]}..{s.recompute_segment[1] - 1} of "
                                     f"{len(s.nodes)})" if s.recompute_segment else "")
                     for s in plan.stages if s.recompute) or "none"


def without_recompute(plan: Plan) -> Plan:
    off = Plan.from_dict(plan.to_dict())
    for s in off.stages:
        s.recompute, s.recompute_segment = False, []
    return off


def worker(rank: int, world: int, kind: str, plans: dict[str, str], n: int, side: int, repeats: int
           ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    models: dict[str, Any] = {}
    for name, path in plans.items():
        cm = nowdl.compile(make_model(kind), plan=path, optimizer=adam, loss_fn=loss_of(kind), progress=False,
                           timeout_s=600)
        cm.train_step(*batch(kind, 0, n, side))  # builds the stages; warm-up
        eng = cm._trainer.engine
        held = [eng.stages[s].module for _, s in eng.held]
        x, y = batch(kind, 1, n, side)  # the caller's batch: made before the step, as a data loader would
        _, peak = peak_of(lambda cm=cm, x=x, y=y: cm.train_step(x, y), held, eng.optimizer)
        models[name] = cm
        out[name] = {"peak": peak, "cpu": [], "proc": [], "wall": [], "batch": x.nbytes + y.nbytes}
    names = list(models)
    for step in range(repeats):  # ABBA: the shared machine's load hits every variant alike
        x, y = batch(kind, 2 + step, n, side)
        for name in (names if step % 2 == 0 else names[::-1]):
            dist.barrier()
            c0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
            models[name].train_step(x, y)
            c1, p1 = time.thread_time(), time.process_time()
            dist.barrier()
            out[name]["wall"].append(time.perf_counter() - t0)
            out[name]["cpu"].append(c1 - c0)
            out[name]["proc"].append(p1 - p0)
    for name, v in out.items():
        v["cpu_s"] = min(v.pop("cpu")) if repeats else float("nan")
        v["step_s"] = min(v.pop("wall")) if repeats else float("nan")
        v["proc_s"] = min(v.pop("proc")) if repeats else float("nan")
        if rank == 0:
            log(f"  {name}: rank 0 peak {v['peak'] / MIB:.2f} MiB, step {v['step_s'] * 1e3:.0f} ms, "
                f"CPU {v['cpu_s'] * 1e3:.0f} ms")
    return out


def run(kind: str, plans: dict[str, Plan], n: int, side: int, repeats: int, tmp: str) -> list[dict[str, Any]]:
    paths = {name: str(p.save(Path(tmp) / f"{kind}_{side}_{name}.json")) for name, p in plans.items()}
    return run_workers(worker, 2, kind, paths, n, side, repeats, timeout_s=1800)


def samples(plan: Plan) -> int:
    c = plan.config
    return int(c.get("micro_batches", 1)) * int(c.get("replicas", 1)) * int(c.get("dp", 1)) \
        * int(c.get("micro_batch_size", 1) or 1)


def predicted_cost(plan: Plan, rank: int) -> float:
    """Seconds recomputation adds to ``rank``'s step: micro-batches x recompute_s of each stage it holds."""
    m = int(plan.config.get("micro_batches", 1))
    held = plan.ranks[rank].stages
    return sum(m * plan.stages[h["stage"]].predicted.get("recompute_s", 0.0) for h in held)


ROWS = [  # name, model, side, cap MiB, pins
    ("pipeline", "resnet", 128, 22.0, dict(stages=2, spatial_parts=1, replicas=1, dp=1, micro_batches=4,
                                           schedule="1f1b")),
    ("spatial", "unet", 128, 7.0, dict(stages=1, spatial_parts=2, replicas=1, dp=1, micro_batches=2,
                                       schedule="gpipe")),
    ("MASTER", "unet", 128, 20.0, dict(stages=2, spatial_parts=1, replicas=2, dp=1, micro_batches=4,
                                       schedule="gpipe")),
]


def verdict(ratios: list[float], tol: float) -> str:
    ok = [abs(r - 1.0) <= tol for r in ratios]
    return f"{sum(ok)} of {len(ok)} rows within ±{tol:.0%}" + (": met" if all(ok) and ok else ": NOT met")


def table1(rows: list[tuple[str, str, int, float, dict[str, Any]]], repeats: int, tmp: str,
           mode: dict[str, Any]) -> None:
    results = []
    for name, kind, side, cap, pins in rows:
        log(f"{name}: planning {kind} {side}² under {cap} MiB")
        try:
            plan = plan_for(kind, side, cap, "auto", pins, mode)
        except NowdlError as e:
            log(f"  no plan: {str(e).splitlines()[0][:160]}")
            continue
        res = run(kind, {"planned": plan, "off": without_recompute(plan)}, samples(plan), side, repeats, tmp)
        results.append((name, kind, side, cap, plan, res))
    print("### 1. Peak memory per rank vs the plan (planner's recompute choice; target ±10%)\n")
    print("| row | model, side | cap | recompute on stages | rank | predicted peak | measured peak | measured / plan "
          "| caller's batch (in neither) | off variant: measured peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios: list[float] = []
    for name, kind, side, cap, plan, res in results:
        chosen = chosen_stages(plan)
        for r, v in enumerate(res):
            pred, meas = plan.ranks[r].predicted_peak_bytes, v["planned"]["peak"]
            ratios.append(meas / pred)
            print(f"| {name} | {kind} {side}² | {cap:g} MiB | {chosen} | {r} | {pred / MIB:.2f} MiB "
                  f"| {meas / MIB:.2f} MiB | {meas / pred:.3f} | {v['planned']['batch'] / MIB:.2f} MiB "
                  f"| {v['off']['peak'] / MIB:.2f} MiB |", flush=True)
    print(f"\nPeak, planned rows: {verdict(ratios, 0.10)}\n")
    print("### 2. Step-time cost of recomputation per rank vs the plan (target ±15%)\n")
    print("| row | rank | micro-batches x recompute_s (predicted) | thread CPU time, planned - off (min of "
          f"{repeats} each) | measured / predicted | process CPU, planned - off | wall, planned - off (min of "
          f"{repeats} each) | thread CPU planned | thread CPU off |")
    print("|---|---|---|---|---|---|---|---|---|")
    cost_ratios: list[float] = []
    for name, _kind, _side, _cap, plan, res in results:
        for r, v in enumerate(res):
            pc = predicted_cost(plan, r)
            cpu = v["planned"]["cpu_s"] - v["off"]["cpu_s"]
            wall = v["planned"]["step_s"] - v["off"]["step_s"]
            ratio = cpu / pc if pc > 0 else float("nan")
            if pc > 0:
                cost_ratios.append(ratio)
            proc = v["planned"]["proc_s"] - v["off"]["proc_s"]
            print(f"| {name} | {r} | {pc * 1e3:.1f} ms | {cpu * 1e3:.1f} ms | {ratio:.2f} | {proc * 1e3:.1f} ms "
                  f"| {wall * 1e3:.1f} ms "
                  f"| {v['planned']['cpu_s'] * 1e3:.0f} ms | {v['off']['cpu_s'] * 1e3:.0f} ms |", flush=True)
    print(f"\nRecompute cost, rows with a prediction: {verdict(cost_ratios, 0.15)}")


def largest(cap: float, recompute: str, pins: dict[str, Any], step: int, limit: int) -> tuple[int, Plan | None]:
    """Largest side (multiple of ``step``) that plans under ``cap`` MiB: doubling from 64, then bisection."""
    def fits(side: int) -> Plan | None:
        try:
            p = plan_for("resnet", side, cap, recompute, pins)
        except NowdlError:
            p = None
        log(f"  {recompute}: {side}² {'fits' if p else 'does not fit'}")
        return p

    lo, best, hi = 0, None, 64
    while hi <= limit:
        p = fits(hi)
        if p is None:
            break
        lo, best, hi = hi, p, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        p = fits(mid)
        if p is None:
            hi = mid
        else:
            lo, best = mid, p
    return lo, best


def table2(cap: float, step: int, repeats: int, tmp: str) -> None:
    pins = dict(stages=2, spatial_parts=1, replicas=1, dp=1, micro_batches=4, schedule="gpipe")
    print(f"\n### 3. Largest square side that plans under {cap:g} MiB per rank on 2 ranks (ResNet-20, 2 stages, "
          f"GPipe, 4 micro-batches; targets: with / without >= 1.5, peak ±10% of the plan)\n")
    print("| recompute | largest side | recompute on stages | rank | predicted peak | measured peak | measured / plan "
          "| measured / cap | step (wall, min) |")
    print("|---|---|---|---|---|---|---|---|---|")
    sides = {}
    ratios: list[float] = []
    for rc in ("off", "auto"):
        side, plan = largest(cap, rc, pins, step, 4096)
        sides[rc] = side
        if plan is None:
            print(f"| {rc} | none | | | | | | | |")
            continue
        res = run("resnet", {rc: plan}, samples(plan), side, repeats, tmp)
        chosen = chosen_stages(plan)
        for r, v in enumerate(res):
            pk, pred = v[rc]["peak"], plan.ranks[r].predicted_peak_bytes
            ratios.append(pk / pred)
            print(f"| {rc} | {side} | {chosen} | {r} | {pred / MIB:.2f} MiB | {pk / MIB:.2f} MiB "
                  f"| {pk / pred:.3f} | {pk / (cap * MIB):.3f} | {v[rc]['step_s'] * 1e3:.0f} ms |", flush=True)
    ratio = sides["auto"] / max(sides["off"], 1)
    print(f"\nside with / without recompute: {ratio:.2f} (target >= 1.5: {'met' if ratio >= 1.5 else 'NOT met'}); "
          f"peak: {verdict(ratios, 0.10)}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--quick", action="store_true", help="3 timed steps, side found to 32 pixels")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per variant (default 30; --quick 4)")
    ap.add_argument("--cap-mib", type=float, default=24.0, help="per-rank cap of table 3")
    ap.add_argument("--mode", choices=("estimate", "measure"), default="measure",
                    help="how tables 1-2 plan: measure (ops timed on this CPU, the default: the cost's prediction "
                         "and its measurement on the same clock) or estimate (cpu spec roofline)")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="tables 1-2: plan on the built-in cpu spec's links instead of links measured first")
    ap.add_argument("--tables", default="12", help="which parts: 1 (tables 1 and 2), 2 (table 3) or 12")
    ap.add_argument("--rows", default="all", help="rows of tables 1-2: all, or names joined by commas")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    repeats = args.repeats or (4 if args.quick else 30)  # the least of 30: steadier than of 10 on a shared machine
    rows = list(ROWS) if args.rows == "all" else [r for r in ROWS if r[0] in args.rows.split(",")]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if "1" in args.tables:
            mode: dict[str, Any] = dict(MODE) if args.mode == "estimate" else {"mode": "measure", "device": "cpu"}
            if not args.no_calibrate:
                mode["device_spec"] = calibrated_spec()
            table1(rows, repeats, tmp, mode)
        if "2" in args.tables:
            table2(args.cap_mib, 32 if args.quick else 16, repeats, tmp)
    print(f"\n({time.perf_counter() - t0:.0f} s wall)")
    return 0


if __name__ == "__main__":
    with recorded("bench_recompute_planned", "--results" in sys.argv):
        raise SystemExit(main())
