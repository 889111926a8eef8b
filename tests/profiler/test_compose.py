"""[Note: whole-pass scale]: measure-mode node times are scaled to add up to one whole pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nowdl.profiler import Profile, compose, profile
from nowdl.trace.tracer import trace


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))


def _profile(monkeypatch: pytest.MonkeyPatch | None = None, free: int | None = None) -> Profile:
    if monkeypatch is not None and free is not None:
        monkeypatch.setattr(compose, "free_bytes", lambda device: free)
    x = torch.randn(1, 3, 32, 32)
    t = trace(_net(), (x,))
    return profile(t.gm, (x,), mode="measure", device="cpu", cache=False, progress=False, repeats=3)


def test_scaled_to_a_whole_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[float, float]] = []
    real = compose.whole_pass

    def spy(*args: object, **kw: object) -> tuple[float, float] | None:
        out = real(*args, **kw)  # type: ignore[arg-type]
        assert out is not None
        seen.append(out)
        return out

    monkeypatch.setattr("nowdl.profiler.profile_graph.whole_pass", spy)
    prof = _profile()
    (whole_fwd, whole_bwd), (f, b) = seen[0], prof.time_scale
    lo, hi = compose.SCALE_BOUNDS
    assert lo <= f <= hi and lo <= b <= hi
    if f != 1.0:  # applied: the nodes' forwards add up to the whole pass
        assert sum(n.fwd_s for n in prof.nodes) == pytest.approx(whole_fwd, rel=1e-9)
    assert b == 1.0 and whole_bwd > 0  # the backward stays as timed node by node
    assert Profile.from_json(prof.to_json()).time_scale == prof.time_scale


def test_skipped_when_the_pass_would_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _profile(monkeypatch, free=1024).time_scale == (1.0, 1.0)


def test_out_of_bounds_factors_are_not_applied() -> None:
    from nowdl.profiler.cost import NodeCost

    nodes = [NodeCost("a", "call_module", "m", fwd_s=1.0, bwd_s=1.0)]
    scaled, factors = compose.scale_times(nodes, 10.0, 0.5)  # 10x: a burst of load, not the model
    assert factors == (1.0, 0.5) and scaled[0].fwd_s == 1.0 and scaled[0].bwd_s == 0.5
    assert compose.scale_times(nodes, 2.0)[1] == (2.0, 1.0)  # no whole backward given: bwd untouched
    assert compose.scale_times([NodeCost("a", "placeholder", "x")], 1.0, 1.0)[1] == (1.0, 1.0)  # nothing timed
