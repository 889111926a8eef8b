"""Recompute and offload at runtime, measured on CPU gloo ranks: peak memory per rank and step time.

What is measured
----------------
nowdl's ResNet-20 v1 (``resnet(depth=20, version=1, width=16, num_classes=10, conv_bias=False)``)
on 3xSxS inputs (S = ``--size``, 128 by default), cross-entropy, Adam (lr 1e-3), planned once in
the parent in estimate mode for ``gpus=K, stages=K, dp=1, replicas=1, spatial_parts=1``, M
micro-batches of one sample, schedule 1F1B. The same plan is then run three ways, its stage
fields set by hand (the planner choosing them is another part of issue 29):

* ``keep``: nothing recomputed or offloaded;
* ``recompute``: every stage ``recompute=True`` ([Note: recompute exactness]);
* ``offload``: every stage ``offload=True`` ([Note: offload]; on CPU the "host copy" is a clone
  in the same memory, so this row shows the path's time cost, not a saving).

K gloo processes (``tests/helpers/distributed.py``'s ``run_workers``, one thread each) run the
three variants one after another, each from the same weights and batches: one warm-up step,
then the peak of one step under nowdl's allocation tracker (``nowdl.runtime.training.metrics.peak_of``:
parameters, buffers and Adam state before the step plus the peak of the storages the step
allocates), then ``--repeats`` timed steps (rank 0 between barriers; the median is printed).
The plan's ``predicted_peak_bytes`` per rank is printed beside the measurement; it is the
plan's figure for keeping every activation (recompute and offload are not in its prediction
unless the planner chose them).

How to run
----------
    .venv/bin/python benchmarks/bench_recompute_runtime.py [--size 128] [--stages 2] [--micro-batches 4] [--repeats 5]

Tables go to stdout as Markdown, progress to stderr. Nothing is asserted.
"""

from __future__ import annotations

import argparse
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
from nowdl.plan.plan import Plan, format_bytes  # noqa: E402
from nowdl.runtime.training.metrics import peak_of  # noqa: E402

__all__ = ["main"]

VARIANTS = ("keep", "recompute", "offload")

from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nowdl.models.resnet(depth=20, version=1, width=16, num_classes=10, conv_bias=False)


def batch(step: int, m: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(m, 3, size, size, generator=g), torch.randint(0, 10, (m,), generator=g)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def worker(rank: int, world: int, plans: dict[str, str], m: int, size: int, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in VARIANTS:
        cm = nowdl.compile(make_model(), plan=plans[name], optimizer=adam, loss_fn=nn.CrossEntropyLoss(),
                           progress=False, timeout_s=300)
        cm.train_step(*batch(0, m, size))  # builds the stages; warm-up
        eng = cm._trainer.engine
        held = [eng.stages[s].module for _, s in eng.held]
        loss, peak = peak_of(lambda cm=cm: cm.train_step(*batch(1, m, size)), held, eng.optimizer)
        times = []
        for step in range(repeats):
            x, y = batch(2 + step, m, size)
            dist.barrier()
            t0 = time.perf_counter()
            cm.train_step(x, y)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        out[name] = {"peak": peak, "step_s": statistics.median(times), "loss": loss,
                     "offloaded": eng.offload.step_bytes}
        if rank == 0:
            log(f"{name}: rank 0 peak {format_bytes(peak)}, step {statistics.median(times) * 1e3:.0f} ms")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    k, m, size = args.stages, args.micro_batches, args.size
    x, y = batch(0, m, size)
    cm = nowdl.compile(make_model(), gpus=k, stages=k, dp=1, replicas=1, spatial_parts=1, micro_batches=m,
                       schedule="1f1b", mode="estimate", optimizer=adam, loss_fn=nn.CrossEntropyLoss(),
                       cache=False, progress=False)
    base = cm.plan(x[:1], target=y[:1])
    with tempfile.TemporaryDirectory() as tmp:
        plans: dict[str, str] = {}
        for name in VARIANTS:
            plan = Plan.from_dict(base.to_dict())
            for s in plan.stages:
                s.recompute, s.offload = name == "recompute", name == "offload"
            plans[name] = str(plan.save(Path(tmp) / f"{name}.json"))
        t0 = time.perf_counter()
        ranks = run_workers(worker, k, plans, m, size, args.repeats, timeout_s=1800)
        wall = time.perf_counter() - t0
    print(f"# Recompute and offload at runtime (CPU, gloo, one thread per rank)\n\nResNet-20 v1 width 16, "
          f"3x{size}x{size}, K={k} stages, M={m} micro-batches of 1, 1F1B, Adam; median of {args.repeats} steps; "
          f"{wall:.0f} s wall.\n")
    print("| rank | variant | measured peak | vs keep | plan's predicted peak (keep) | step time | vs keep "
          "| offloaded per step | first loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r, res in enumerate(ranks):
        keep = res["keep"]
        for name in VARIANTS:
            v = res[name]
            pred = base.ranks[r].predicted_peak_bytes
            print(f"| {r} | {name} | {format_bytes(v['peak'])} | {v['peak'] / keep['peak']:.2f} | {format_bytes(pred)} "
                  f"| {v['step_s'] * 1e3:.0f} ms | {v['step_s'] / keep['step_s']:.2f} | {format_bytes(v['offloaded'])} "
                  f"| {v['loss']:.6f} |")
    return 0


if __name__ == "__main__":
    with recorded("bench_recompute_runtime", "--results" in sys.argv):
        raise SystemExit(main())
