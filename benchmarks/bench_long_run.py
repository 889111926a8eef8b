"""Long-run stability: memory and time per step over 1,000 training steps on 2 gloo ranks.

``python benchmarks/bench_long_run.py [--steps 1000] [--every 50] [--windows 10]`` trains a small
ResNet (depth 8, width 4, 3 classes, 32x32 inputs, batch 4) as a 2-stage pipeline plan (2
micro-batches, 1F1B, Adam) through ``nowdl.compile(...).train_step`` on 2 CPU gloo processes
(``tests/helpers/distributed.py``'s ``run_workers``; ``torch.set_num_threads(1)`` on each rank),
a fresh seeded batch every step.

Memory: every ``--every`` steps each rank records its RSS (``/proc/self/statm``), the bytes of
every live torch tensor the garbage collector reaches (parameters, optimizer state, buffers,
anything a step leaves behind) and the number of live Python objects. The table gives each
quantity's least-squares slope per 1,000 steps over the steps after the first 10% (warm-up:
allocator pools and Adam's state fill up), next to its value at the end.

Time: every step each rank records the CPU time of its main thread (``time.thread_time``: the
step's own work, nowdl's Python and torch's kernels on one thread), the CPU time of the whole
process (``time.process_time``: gloo's threads too) and wall time (``time.perf_counter``). On a
machine shared with other jobs none of them is steady: wall time waits for the other jobs, and
even CPU time per step moved by up to 50% between windows of 100 steps, both ranks together,
with the load (a busy neighbour on the same core or cache slows every instruction; a rank that
waits for its peer wakes with cold caches). Gloo's TCP loop thread (process minus main thread)
also grows with how long a receive waits (on rank 1, +2.6 ms per step when rank 0 slept 20 ms
before each step). So two measures that the load cannot move carry the verdict:

* Python bytecodes per step: once per window (its middle step, left out of the times) each rank
  counts the bytecodes its main thread executes in the step (``sys.settrace`` opcode events). A
  list, cache or log that grows with the steps and is walked in Python shows there.
* Old against fresh, interleaved: after the run each rank compiles a fresh copy of the model,
  warms it up for 10 steps, and times ``--pairs`` pairs of steps, one of the trained model and
  one of the copy on the same batch, back to back (the order alternating). Both steps of a pair
  see the same machine, so the ratio old / fresh is the cost the 1,000 steps added (state that
  grows inside the compiled model or its engine), with the load divided out. The estimate is the
  geometric mean of the median log-ratio of each order (a cost that falls on whichever step runs
  first cancels), with a 95% bootstrap interval.

The raw clocks are shown per window of ``--steps / --windows`` steps (each window's median,
robust to the slow steps that other jobs cause, and the load average at its end), with the last
window against the first and the Theil-Sen slope (median of the pairwise slopes) of the window
values, Sen's 95% confidence interval, relative to the run's median.

Verdict, fixed before the run: time per step is flat when, on every rank, the Python bytecodes
of the last window's step are within 1% of the first window's and the main-thread CPU ratio
old / fresh is within 5% of 1. CPU only.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402
from helpers.distributed import run_workers  # noqa: E402
from torch import nn  # noqa: E402

import nowdl  # noqa: E402

__all__ = ["main", "paired_ratio", "theil_sen"]

#: The verdict's bounds, fixed before the run: |last window / first window - 1| of the Python
#: bytecodes of a step, and |median ratio - 1| of the main-thread CPU time, old model / fresh copy.
OPCODES_BOUND = 0.01
PAIRED_BOUND = 0.05

from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402


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


def _opcodes(fn: Callable[[], object]) -> int:
    """Python bytecodes the main thread executes in ``fn()`` (every frame traced: slow)."""
    count = 0

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def _compile() -> Any:
    torch.manual_seed(0)
    model = nowdl.models.resnet(depth=8, version=1, num_classes=3, width=4, conv_bias=False)
    return nowdl.compile(model, gpus=2, stages=2, dp=1, replicas=1, micro_batches=2, schedule="1f1b",
                         spatial_parts=1, mode="estimate", optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
                         loss_fn=nn.CrossEntropyLoss(), cache=False, progress=False, timeout_s=120)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 3, (4,), generator=g)


def _timed(cm: Any, step: int) -> tuple[float, float, float]:
    """``(main-thread CPU, process CPU, wall)`` seconds of one ``train_step``."""
    x, y = _batch(step)
    w0, c0, t0 = time.perf_counter(), time.process_time(), time.thread_time()
    cm.train_step(x, y)
    t1, c1, w1 = time.thread_time(), time.process_time(), time.perf_counter()
    return t1 - t0, c1 - c0, w1 - w0


def _paired(cm: Any, steps: int, pairs: int) -> dict[str, list[float]]:
    """Steps of ``cm`` (trained ``steps`` steps) and of a freshly compiled copy, interleaved (the
    order alternates from pair to pair): main-thread CPU and wall seconds of each."""
    fresh = _compile()
    for i in range(10):  # its warm-up: Adam's state, allocator pools
        _timed(fresh, steps + i + 1)
    out: dict[str, list[float]] = {"old_thread": [], "new_thread": [], "old_wall": [], "new_wall": []}
    for i in range(pairs):
        step = steps + 11 + i
        for who in (("old", "new") if i % 2 == 0 else ("new", "old")):
            thread, _, wall = _timed(cm if who == "old" else fresh, step)
            out[f"{who}_thread"].append(thread)
            out[f"{who}_wall"].append(wall)
    return out


def _worker(rank: int, world: int, steps: int, every: int, window: int, pairs: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    cm = _compile()
    memory: list[dict[str, float]] = []
    times: dict[str, list[float]] = {key: [] for key in ("thread", "cpu", "wall")}
    opcodes: list[int] = []
    load: list[float] = []
    for step in range(1, steps + 1):
        if step % window == window // 2:  # one traced step per window, left out of the times
            gc.collect()
            opcodes.append(_opcodes(functools.partial(cm.train_step, *_batch(step))))
            for key in times:
                times[key].append(math.nan)
        else:
            for key, sec in zip(("thread", "cpu", "wall"), _timed(cm, step), strict=True):
                times[key].append(sec)
        if step % every == 0:
            tb, objs = _tensor_bytes()
            memory.append({"step": step, "rss": _rss(), "tensors": tb, "objects": objs})
        if step % window == 0:
            load.append(os.getloadavg()[0])
    return {"memory": memory, "times": times, "opcodes": opcodes, "load": load, "threads": torch.get_num_threads(),
            "pairs": _paired(cm, steps, pairs)}


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def theil_sen(xs: list[float], ys: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """``(slope, low, high)``: the median of the pairwise slopes and Sen's confidence interval
    (``z`` 1.96: 95%) from the ranks of the sorted slopes; distinct ``xs``."""
    n = len(xs)
    s = sorted((ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(n) for j in range(i + 1, n))
    c = z * math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
    lo = max(0, math.floor((len(s) - c) / 2))  # 0-based: the (N - C)/2-th slope
    hi = min(len(s) - 1, math.ceil((len(s) + c) / 2))  # the (N + C)/2 + 1-th
    return statistics.median(s), s[lo], s[hi]


def _windows(values: list[float], window: int) -> list[float]:
    """The median of each window of ``window`` steps (NaN, a traced step, left out)."""
    return [statistics.median(v for v in values[i:i + window] if not math.isnan(v))
            for i in range(0, len(values) - window + 1, window)]


def _memory_table(ranks: list[dict[str, Any]], steps: int) -> None:
    print(f"\nMemory: least-squares slope per 1,000 steps over steps {steps // 10 + 1}..{steps}\n")
    print("| rank | quantity | at the end | slope / 1,000 steps | slope / value |")
    print("|---:|---|---:|---:|---:|")
    for rank, res in enumerate(ranks):
        rows = [r for r in res["memory"] if r["step"] > steps // 10]
        xs = [r["step"] for r in rows]
        for key, name, scale, unit in (("rss", "RSS", 2**20, "MiB"), ("tensors", "live tensor bytes", 2**20, "MiB"),
                                       ("objects", "live Python objects", 1, "")):
            ys = [r[key] / scale for r in rows]
            sl, end = _slope(xs, ys) * 1000, ys[-1]
            fmt = ",.0f" if unit == "" else ".2f"
            u = f" {unit}" if unit else ""
            print(f"| {rank} | {name} | {end:{fmt}}{u} | {sl:+.3f}{u} | {sl / end if end else 0:+.3%} |")


def _series(res: dict[str, Any], window: int) -> dict[str, tuple[list[float], float]]:
    """Each measure's window values and its median over the run."""
    out = {key: (_windows(v, window), statistics.median(x for x in v if not math.isnan(x)))
           for key, v in res["times"].items()}
    out["opcodes"] = ([float(c) for c in res["opcodes"]], float(statistics.median(res["opcodes"])))
    return out


MEASURES = (("thread", "main-thread CPU (ms)", ".2f", 1e3), ("cpu", "process CPU (ms)", ".2f", 1e3),
            ("wall", "wall (ms)", ".1f", 1e3), ("opcodes", "Python bytecodes", ",.0f", 1.0))


def _time_tables(ranks: list[dict[str, Any]], window: int) -> bool:
    """Print the per-window values and the trend table; return whether the bytecodes held (< 1%)."""
    series = [_series(res, window) for res in ranks]
    n = len(series[0]["thread"][0])
    print(f"\nTime per step: median of each window of {window} steps (its traced step left out); Python bytecodes "
          "of the traced step; load average (1 min) at the window's end\n")
    head = " | ".join(f"r{r} {name}" for r in range(len(ranks)) for _, name, _, _ in MEASURES)
    print(f"| steps | {head} | load |")
    print("|---|" + "---:|" * (len(ranks) * len(MEASURES) + 1))
    for w in range(n):
        cells = " | ".join(f"{series[r][key][0][w] * scale:{fmt}}" for r in range(len(ranks))
                           for key, _, fmt, scale in MEASURES)
        print(f"| {w * window + 1}..{(w + 1) * window} | {cells} | {ranks[0]['load'][w]:.1f} |")
    print(f"\nTrend: last window against the first; Theil-Sen slope of the {n} window values per 1,000 steps "
          "(95% CI), both relative to the run's median\n")
    print("| rank | measure | median | first window | last window | last / first - 1 "
          "| slope / 1,000 steps | 95% CI |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    held = True
    xs = [(w + 0.5) * window for w in range(n)]
    for r in range(len(ranks)):
        for key, name, fmt, scale in MEASURES:
            ys, mid = series[r][key]
            change = ys[-1] / ys[0] - 1
            if key == "opcodes":
                held = held and abs(change) < OPCODES_BOUND
            sl, lo, hi = (v * 1000 / mid for v in theil_sen(xs, ys))
            print(f"| {r} | {name} | {mid * scale:{fmt}} | {ys[0] * scale:{fmt}} | {ys[-1] * scale:{fmt}} "
                  f"| {change:+.1%} | {sl:+.1%} | {lo:+.1%} .. {hi:+.1%} |")
    return held


def paired_ratio(old: list[float], new: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """``(ratio, low, high)`` of interleaved pairs whose order alternates (pair 0 old first, pair 1
    new first, ...): the geometric mean of the median log-ratio of each order, which cancels a
    cost that falls on whichever step runs first, and its 95% bootstrap interval (seeded)."""
    logs = [math.log(a / b) for a, b in zip(old, new, strict=True)]
    first, second = logs[0::2], logs[1::2]

    def est(a: list[float], b: list[float]) -> float:
        return math.exp((statistics.median(a) + statistics.median(b)) / 2)

    rng = random.Random(0)
    boot = sorted(est(rng.choices(first, k=len(first)), rng.choices(second, k=len(second))) for _ in range(resamples))
    return est(first, second), boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]


def _paired_table(ranks: list[dict[str, Any]], steps: int) -> bool:
    """Print the interleaved old/fresh comparison; return whether CPU time held (< 5%)."""
    n = len(ranks[0]["pairs"]["old_thread"])
    print(f"\nThe model after {steps} steps against a freshly compiled copy, {n} pairs of steps interleaved on "
          "the same batches (order alternating): the ratio old / fresh, the geometric mean of the median ratio of each order\n")
    print("| rank | clock | median step, old (ms) | median step, fresh (ms) | ratio old / fresh | 95% CI |")
    print("|---:|---|---:|---:|---:|---|")
    held = True
    for r, res in enumerate(ranks):
        pairs = res["pairs"]
        for key, name in (("thread", "main-thread CPU"), ("wall", "wall")):
            old, new = pairs[f"old_{key}"], pairs[f"new_{key}"]
            med, lo, hi = paired_ratio(old, new)
            if key == "thread":
                held = held and abs(med - 1) < PAIRED_BOUND
            print(f"| {r} | {name} | {statistics.median(old) * 1e3:.2f} | {statistics.median(new) * 1e3:.2f} "
                  f"| {med:.3f} | {lo:.3f} .. {hi:.3f} |")
    return held


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50, help="steps between memory samples")
    ap.add_argument("--windows", type=int, default=10, help="windows the steps are cut into for the medians")
    ap.add_argument("--pairs", type=int, default=100, help="interleaved old/fresh pairs of steps at the end")
    ap.add_argument("--raw", type=Path, default=None, help="also write every step's times (JSON) to this file")
    args = ap.parse_args(argv)
    if args.steps % args.windows or args.steps // args.windows < 2 or args.windows < 2:
        ap.error(f"--steps {args.steps} must split into --windows {args.windows} (>= 2) windows of >= 2 steps")
    window = args.steps // args.windows
    t0 = time.perf_counter()
    ranks: list[dict[str, Any]] = run_workers(_worker, 2, args.steps, args.every, window, args.pairs, timeout_s=3600)
    load = os.getloadavg()
    if args.raw is not None:
        args.raw.write_text(json.dumps([{k: r[k] for k in ("times", "opcodes", "pairs", "load")} for r in ranks]))
    print(f"{args.steps} steps on 2 gloo ranks in {time.perf_counter() - t0:.0f} s (resnet depth 8 width 4, 32x32, "
          f"batch 4, 2-stage 1F1B, Adam; {ranks[0]['threads']} torch thread per rank); load average at the end "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} CPUs")
    _memory_table(ranks, args.steps)
    flat = _time_tables(ranks, window)
    flat = _paired_table(ranks, args.steps) and flat
    print(f"\nVerdict (fixed before the run: on every rank, the Python bytecodes of a step within "
          f"{OPCODES_BOUND:.0%}, last window against the first, and the main-thread CPU ratio old / fresh "
          f"within {PAIRED_BOUND:.0%} of 1): " + ("FLAT" if flat else "NOT FLAT"))
    return 0


if __name__ == "__main__":
    with recorded("bench_long_run", "--results" in sys.argv):
        raise SystemExit(main())
