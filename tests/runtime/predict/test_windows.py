"""Streaming windows: the receptive field from the graph, window layouts, exact window centres."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.predict_models import reference, seg_net
from torch import nn

import nowdl
from nowdl.errors import NowdlError
from nowdl.runtime.predict import windows
from nowdl.runtime.predict.windows import Reach, cached_reach, layout_windows, network_reach

zarr = pytest.importorskip("zarr")


def _reach(net: nn.Module, shape: tuple[int, ...]) -> Reach:
    cm = nowdl.compile(net, gpus=1, progress=False, cache=False)
    x = torch.empty(shape, device="meta")
    return network_reach(cm.trace(x).gm, x)


def test_reach_of_a_two_level_unet() -> None:
    r = _reach(seg_net(), (1, 1, 64, 64))
    assert r.align == (2, 2) and r.scale == (1, 1) and r.out_channels == 3
    # conv(1) + conv at half resolution (2 input px) + conv(1), rounded to the stride: at least 4
    assert all(4 <= m <= 16 and m % 2 == 0 for m in r.margin)
    assert r.whole == ()


def test_reach_names_whole_image_statistics() -> None:
    r = _reach(seg_net(norm="instance"), (1, 1, 32, 32))
    assert r.whole == (("n1", "InstanceNorm2d", "instance/group norm statistics", 1),) and r.passes == 1
    assert r.whole_text(exact=True) == "instance/group norm statistics (1)" and r.whole_text() == ""
    assert r.whole_text(also=["n1"]) == "instance/group norm statistics (1: n1)"  # computed per window after all


def test_reach_is_cached_by_graph_and_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second prediction at the same window shape reads the reach back instead of propagating shapes."""
    cm = nowdl.compile(seg_net(norm="instance"), gpus=1, progress=False, cache=False)
    x, y = torch.empty((1, 1, 32, 32), device="meta"), torch.empty((1, 1, 48, 48), device="meta")
    first = cached_reach(cm.trace(x).gm, x, tmp_path)
    assert first == network_reach(cm.trace(x).gm, x) and len(list(tmp_path.glob("reach-*.json"))) == 1
    assert first.stat_ops and first.passes == 1  # the statistics passes are read back too

    def refuse(*_: object) -> Reach:
        raise AssertionError("propagated shapes again")

    monkeypatch.setattr(windows, "network_reach", refuse)
    assert cached_reach(cm.trace(x).gm, x, tmp_path) == first  # read back whole (the whole-image ops too)
    with pytest.raises(AssertionError):  # another shape is another entry
        cached_reach(cm.trace(y).gm, y, tmp_path)


@pytest.mark.parametrize("size,window", [(96, 40), (100, 100), (128, 64), (64, 200), (1000, 256)])
def test_cores_tile_the_image_once(size: int, window: int) -> None:
    reach = Reach(margin=(8,), align=(4,), scale=(1,))
    if size % 4 and size > window:
        with pytest.raises(NowdlError, match="multiples of 4"):
            layout_windows((size,), (window,), reach)
        return
    wins = layout_windows((size,), (window,), reach)
    covered = np.zeros(size, int)
    for w in wins:
        (r0, r1), (c0, c1) = w.read[0], w.core[0]
        assert r1 - r0 == min(window, size) and r0 % 4 == 0
        assert r0 <= c0 < c1 <= r1
        assert c0 == 0 or c0 - r0 >= 8  # the margin, unless at the image border
        assert c1 == size or r1 - c1 >= 8
        covered[c0:c1] += 1
    assert (covered == 1).all()


def test_window_too_small_for_the_receptive_field() -> None:
    with pytest.raises(NowdlError, match="at least 20 pixels"):
        layout_windows((64,), (16,), Reach(margin=(8,), align=(4,), scale=(1,)))


@pytest.mark.parametrize("dims,size,window", [(2, (96, 128), (48, 64)), (3, (24, 32, 16), (16, 24, 16))])
def test_streamed_windows_are_exact(tmp_path: Path, dims: int, size: tuple[int, ...], window: tuple[int, ...]) -> None:
    net = seg_net(dims=dims)
    img = np.random.default_rng(1).random((1, *size)).astype(np.float32)
    zarr.save_array(str(tmp_path / "in.zarr"), img)
    cm = nowdl.compile(net, gpus=1, progress=False, cache=False)
    summary = cm.predict(f"zarr:{tmp_path / 'in.zarr'}", tmp_path / "out.zarr", window=window)
    got = np.asarray(zarr.open_array(str(tmp_path / "out.zarr" / "0"))[:])
    assert summary.windows > 1 and "exact" in summary.line()
    np.testing.assert_allclose(got, reference(net, img), atol=1e-5, rtol=0)


def test_instance_norm_streams_exactly_in_a_statistics_pass(tmp_path: Path) -> None:
    net = seg_net(norm="instance")
    img = np.random.default_rng(2).random((1, 64, 64)).astype(np.float32)
    zarr.save_array(str(tmp_path / "in.zarr"), img)
    cm = nowdl.compile(net, gpus=1, progress=False, cache=False)
    ref = reference(net, img)
    for out, window in (("a.zarr", (32, 64)), ("b.zarr", None)):  # 3 windows, then the image
        summary = cm.predict(f"zarr:{tmp_path / 'in.zarr'}", tmp_path / out, window=window)
        got = np.asarray(zarr.open_array(str(tmp_path / out / "0"))[:])
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
        assert "exact (margin" in summary.line() and "NOT" not in summary.line()
        assert (summary.windows, summary.passes) == ((3, 1) if window else (1, 0))
    assert "1 statistics pass(es) over the windows for instance/group norm statistics (1)" in \
        cm.predict(f"zarr:{tmp_path / 'in.zarr'}", tmp_path / "c.zarr", window=(32, 64)).line()
