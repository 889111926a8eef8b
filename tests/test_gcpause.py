"""[Note: planning without gc]: automatic collection is paused inside and restored after."""

from __future__ import annotations

import gc

import pytest
import torch

import nowdl
from nowdl.gcpause import gc_paused


def test_paused_inside_and_restored_after_even_on_error() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: the outer block resumes it
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
    with gc_paused(enabled=False):
        assert gc.isenabled()


def test_left_off_when_it_was_off() -> None:
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_plan_pauses_it_and_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    cm = nowdl.compile(torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.ReLU(), torch.nn.Conv2d(2, 1, 3)),
                       gpus=1, mode="estimate", device_spec="h100", progress=False, cache=False)
    real = cm._search

    def spy(*a: object, **kw: object) -> object:
        seen.append(gc.isenabled())
        return real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(cm, "_search", spy)
    cm.plan(torch.randn(1, 1, 16, 16))
    assert seen == [False] and gc.isenabled()
