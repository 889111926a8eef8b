"""Long-run stability: memory and step time over 1,000 training steps on 2 gloo ranks.

``python benchmarks/bench_long_run.py [--steps 1000] [--every 50]`` trains a small ResNet (depth
8, width 4, 3 classes, 32x32 inputs, batch 4) as a 2-stage pipeline plan (2 micro-batches,
1F1B, Adam) through ``nowdl.compile(...).train_step`` on 2 CPU gloo processes
(``tests/helpers/distributed.py``'s ``run_workers``, ``OMP_NUM_THREADS=1``), a fresh seeded
batch every step. Every ``--every`` steps each rank records:

* RSS: the resident set size of the process (``/proc/self/statm``);
* tracked allocation: the bytes of every live torch tensor the garbage collector can reach
  (parameters, optimizer state, buffers, anything a step leaves behind) and the number of
  live Python objects;
* step time: the mean of the last ``--every`` steps.

The table gives each quantity's least-squares slope over the run after the first 10% of the
steps (warm-up: allocator pools and Adam's state fill up) per 1,000 steps, next to its value at
the end: a leak shows as a slope that is a sizeable fraction of the value. CPU only.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402
from helpers.distributed import run_workers  # noqa: E402
from torch import nn  # noqa: E402

import nowdl  # noqa: E402

__all__ = ["main"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tensor_bytes() -> tuple[int, int]:
    """Bytes of the live torch tensors the collector reaches (storages counted once), and the
    number of live Python objects."""
    gc.collect()
    objs = gc.get_objects()
    warnings.simplefilter("ignore", FutureWarning)  # isinstance() on torch's deprecated reduce_op object
    seen: set[int] = set()
    total = 0
    for o in objs:
        if isinstance(o, torch.Tensor) and not o.is_meta:
            try:
                st = o.untyped_storage()
            except RuntimeError:
                continue
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total, len(objs)


def _worker(rank: int, world: int, steps: int, every: int) -> list[dict[str, float]]:
    torch.manual_seed(0)
    model = nowdl.models.resnet(depth=8, version=1, num_classes=3, width=4, conv_bias=False)
    cm = nowdl.compile(model, gpus=2, stages=2, dp=1, replicas=1, micro_batches=2, schedule="1f1b",
                       spatial_parts=1, mode="estimate", optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
                       loss_fn=nn.CrossEntropyLoss(), cache=False, progress=False, timeout_s=120)
    rows: list[dict[str, float]] = []
    t_sum = 0.0
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 3, (4,), generator=g)
        t0 = time.perf_counter()
        cm.train_step(x, y)
        t_sum += time.perf_counter() - t0
        if step % every == 0:
            tb, objs = _tensor_bytes()
            rows.append({"step": step, "rss": _rss(), "tensors": tb, "objects": objs, "step_s": t_sum / every})
            t_sum = 0.0
    return rows


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    ranks: list[Any] = run_workers(_worker, 2, args.steps, args.every, timeout_s=3600)
    print(f"{args.steps} steps on 2 gloo ranks in {time.perf_counter() - t0:.0f} s (resnet depth 8 width 4, "
          f"32x32, batch 4, 2-stage 1F1B, Adam); slopes per 1,000 steps over steps > {args.steps // 10}")
    print(f"{'rank':>4} {'quantity':<22} {'at end':>12} {'slope/1000 steps':>17} {'slope/end':>10}")
    for rank, rows in enumerate(ranks):
        rows = [r for r in rows if r["step"] > args.steps // 10]
        xs = [r["step"] for r in rows]
        for key, name, scale, unit in (("rss", "RSS", 2**20, "MiB"), ("tensors", "live tensor bytes", 2**20, "MiB"),
                                       ("objects", "live Python objects", 1, ""), ("step_s", "step time", 1e-3, "ms")):
            ys = [r[key] / scale for r in rows]
            sl = _slope(xs, ys) * 1000
            end = ys[-1]
            print(f"{rank:>4} {name:<22} {end:>9.2f} {unit:<3}{sl:>+13.3f} {unit:<3} {sl / end if end else 0:>+9.2%}")
    for rank, rows in enumerate(ranks):
        print(f"rank {rank} step time per {args.every} steps (ms): "
              + " ".join(f"{r['step_s'] * 1e3:.0f}" for r in rows))
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} CPUs "
          "(other jobs on the machine slow steps down)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
