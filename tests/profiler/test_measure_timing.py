"""How measure mode turns a node's timed runs into one figure (profiler/measure.py, [Note: thread clock minimum])."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from nowdl.profiler.measure import MeasureBackend
from nowdl.trace import trace


@pytest.fixture
def threads() -> Iterator[None]:
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_one_thread_cpu_takes_the_least_run_else_the_median(threads: None) -> None:
    """On the thread CPU clock load only adds time: the least run is the op's own cost; on the
    wall clock (several intra-op threads) the median."""
    backend = MeasureBackend(nn.Linear(2, 2), torch.device("cpu"), repeats=5, warmup=2)
    runs = [3e-3, 1e-3, 9e-3, 2e-3, 4e-3]
    torch.set_num_threads(1)
    assert backend.summarise(runs) == 1e-3
    torch.set_num_threads(2)
    assert backend.summarise(runs) == 3e-3


def test_profile_node_time_is_the_least_timed_run(threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walker reports the backend's figure: with one thread, a node's fwd_s is the least of
    its timed runs. The thread clock is replaced by one whose successive timings cycle through
    5, 1, 7, 3, 9 us (any 5 timed runs of a phase see each once): the least is 1 us, the median 5."""
    from nowdl.profiler import measure as measure_mod
    from nowdl.profiler import profile

    torch.set_num_threads(1)
    ticks = iter(range(10**6))
    slow = [5, 1, 7, 3, 9]

    def clock() -> float:
        i = next(ticks)
        return (i // 2) * 1.0 + (slow[(i // 2) % len(slow)] * 1e-6 if i % 2 else 0.0)

    monkeypatch.setattr(measure_mod.time, "thread_time", clock)
    monkeypatch.setattr("nowdl.profiler.profile_graph.whole_pass", lambda *a, **k: None)  # nodes alone
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())
    t = trace(model, (torch.randn(1, 1, 8, 8),))
    prof = profile(t.gm, (torch.randn(1, 1, 8, 8),), mode="measure", device="cpu", cache=False, progress=False,
                   repeats=5, warmup=2)
    timed = [n for n in prof.nodes if n.fwd_s > 0]
    assert timed and all(n.fwd_s == pytest.approx(1e-6) for n in timed)


def test_whole_pass_uses_the_nodes_clock_and_the_least_run(threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: whole-pass scale] on the thread clock: the whole forward and backward are timed on
    ``time.thread_time`` (not the wall clock, which counts the time other jobs hold the core) and
    summarised by the least timed run, as the nodes are."""
    from nowdl.profiler import compose

    torch.set_num_threads(1)
    fwd, bwd = [9.0, 4.0, 2.0, 6.0], [8.0, 5.0, 3.0, 7.0]  # the warm-up run, then WHOLE_RUNS = 3
    assert compose.WHOLE_RUNS == 3
    stamps, now = [], 0.0
    for f, b in zip(fwd, bwd, strict=True):
        stamps += [now, now + f, now + f + 1.0, now + f + 1.0 + b]
        now += f + b + 2.0
    readings = iter(stamps)
    monkeypatch.setattr(compose.time, "thread_time", lambda: next(readings))
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU())
    assert compose.whole_pass(model, (torch.randn(1, 1, 8, 8),), torch.device("cpu"), []) == (2.0, 3.0)
