"""Measure mode: run each node on real tensors on a device, timing forward and backward."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch

from nowdl.profiler.backend import Backend, PhaseResult
from nowdl.profiler.flops import OpCostMode
from nowdl.profiler.memory import AllocTracker

__all__ = ["MeasureBackend", "resolve_device", "device_label"]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The measuring device: ``device``, or cuda when available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"invalid device {device!r}: {e}") from e
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available; "
                             f"use device='cpu' or mode='estimate'")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
    return d


def device_label(d: torch.device) -> str:
    """``cpu`` or ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    if d.type == "cuda":
        return f"{d} ({torch.cuda.get_device_name(d)})"
    return str(d)


class MeasureBackend(Backend):
    """Real tensors on ``device``: one accounting run (FLOPs, saved tensors, workspace),
    ``warmup - 1`` more untimed runs, then ``repeats`` timed runs (the least on the thread CPU
    clock, [Note: thread clock minimum]; else the median).

    CPU times come from ``time.thread_time`` when torch runs one intra-op thread (the op runs on
    this thread: its CPU time is its compute, not the time other jobs held the core, so a profile
    taken on a loaded machine predicts the CPU time of the same ops, which
    benchmarks/bench_recompute_planned.py compares with the ranks'), else from
    ``time.perf_counter``; CUDA times from CUDA events after a synchronize. Workspace is the
    ``max_memory_allocated`` peak above the memory live after the phase on CUDA, and on CPU the
    aten-level allocation tracker of :class:`~nowdl.profiler.memory.AllocTracker` (blind to
    oneDNN's internal scratch).
    The model must already be on ``device``.
    """

    def __init__(self, gm: torch.nn.Module, device: torch.device, repeats: int,
                 warmup: int) -> None:
        self.gm = gm
        self.device = device
        self.cuda = device.type == "cuda"
        self.device_label = device_label(device)
        self.device_type = device.type
        self.n_runs = 1 + max(0, warmup - 1) + max(1, repeats)
        self._untimed = 1 + max(0, warmup - 1)
        self._run_index = 0

    def input(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.detach().to(self.device).requires_grad_(t.requires_grad)
        return t

    def attr(self, obj: Any) -> Any:
        return obj

    def static_tensors(self) -> Iterable[torch.Tensor]:
        yield from self.gm.parameters()
        yield from self.gm.buffers()

    def call_module(self, mod: torch.nn.Module, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        return mod(*args, **kwargs)

    def params_of(self, mod: torch.nn.Module) -> list[torch.Tensor]:
        return list(mod.parameters())

    def _thread_clock(self) -> bool:
        return not self.cuda and torch.get_num_threads() == 1

    def summarise(self, seconds: Sequence[float]) -> float:
        """[Note: thread clock minimum] On the thread CPU clock (CPU, one intra-op thread) the
        least of the timed runs; else (wall clock, CUDA events) their median.

        The thread clock leaves out the time other jobs hold the core, but not what they do to
        it while this thread runs (a busy sibling hyperthread, evicted caches, a lower clock
        rate): that only ever adds CPU time, by an amount that follows the machine's load, not
        the op. The least of the runs is the op's own cost, the figure a profile taken on a
        loaded machine can repeat: with the median of 5, two profiles of ResNet-20 on this
        shared 2-core machine gave a stage's forward 30% apart (bench_recompute_planned Table
        2), while the steps it predicts, timed on the same clock as the least of 10, were steady.
        """
        if self._thread_clock():
            return min(seconds)
        return statistics.median(seconds)

    def phase(self, name: str, accounting: bool) -> AbstractContextManager[PhaseResult]:
        if name == "fwd":
            self._run_index = 0 if accounting else self._run_index + 1
        if accounting:
            return self._accounting(name)
        return self._timed(timed=self._run_index >= self._untimed)

    @contextmanager
    def _accounting(self, name: str) -> Iterator[PhaseResult]:
        res = PhaseResult()
        with ExitStack() as stack:
            counter = stack.enter_context(OpCostMode()) if name == "fwd" else None
            if self.cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                base = torch.cuda.memory_allocated(self.device)
                yield res
                torch.cuda.synchronize(self.device)
                peak = torch.cuda.max_memory_allocated(self.device)
                end = torch.cuda.memory_allocated(self.device)
                res.workspace = max(0, peak - max(base, end))
            else:
                tracker = stack.enter_context(AllocTracker(log=True))
                yield res
                stack.close()
                res.workspace = tracker.workspace
                res.alloc = tracker
            if counter is not None:
                res.flops = counter.flops

    @contextmanager
    def _timed(self, timed: bool) -> Iterator[PhaseResult]:
        res = PhaseResult()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            yield res
            stop.record()
            torch.cuda.synchronize(self.device)
            t = start.elapsed_time(stop) / 1e3
        else:
            clock = time.thread_time if self._thread_clock() else time.perf_counter
            t0 = clock()
            yield res
            t = clock() - t0
        if timed:
            res.seconds = t
