"""Spatial rules: which ops can run on tiles, their halos, and tile geometry."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from nowdl.partitioner.spatial.tileable import halo_elements, slice_grid, spatial_rules, tile_shape


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c3 = nn.Conv2d(3, 8, 3, padding=1)
        self.c5d2 = nn.Conv2d(8, 8, 5, padding=4, dilation=2)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.bn(self.c3(x)))
        b = self.c5d2(a)
        c = self.up(self.pool(b))
        d = torch.cat([a, c], dim=1)
        e = torch.cat([d, d], dim=2)
        return self.fc(self.gap(e).flatten(1)) + F.relu(d).sum()


def test_rules() -> None:
    gm = fx.symbolic_trace(Net())
    r = spatial_rules(gm)
    assert r["c3"].tileable and r["c3"].halo == (1, 1)
    assert r["c5d2"].tileable and r["c5d2"].halo == (4, 4)
    assert r["bn"].tileable and r["bn"].kind == "norm"
    assert r["pool"].tileable and r["pool"].halo == (0, 0)
    assert r["up"].tileable and r["up"].halo == (1,)
    assert r["cat"].tileable and r["cat"].kind == "concat"
    assert not r["cat_1"].tileable and "dim 2" in r["cat_1"].reason
    assert not r["gap"].tileable and "whole image" in r["gap"].reason
    assert not r["fc"].tileable
    assert not r["flatten"].tileable and "flatten" in r["flatten"].reason
    assert not r["sum_1"].tileable


class Repeats(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, 2, 1, 1) + x.repeat([1, 2, 1, 1]) + x.repeat(1, 1, 2, 1)[..., :4, :] + x.repeat(1, 1, 1, 1, 1)[0]


def test_repeat_runs_on_tiles_only_over_batch_and_channels() -> None:
    """VNet's input block repeats its input over channels (``x.repeat(1, 16, 1, 1, 1)``): tileable."""
    for tracer in ("fx", "export"):
        from nowdl.trace.tracer import trace

        t = trace(Repeats(), (torch.randn(1, 1, 4, 4),), tracer=tracer)
        ranks = {n.name: 4 for n in t.gm.graph.nodes}  # what the profile gives an fx graph (out_shape)
        r = spatial_rules(t.gm, ranks)
        reps = [n.name for n in t.gm.graph.nodes if "repeat" in str(n.target)]
        assert [r[n].tileable for n in reps] == [True, True, False, False], (tracer, reps)
        assert "spatial dim" in r[reps[2]].reason and "new dims" in r[reps[3]].reason, r[reps[3]]


def test_slice_grid() -> None:
    assert slice_grid("vertical", 4, 2) == (1, 4)
    assert slice_grid("horizontal", 4, 2) == (4, 1)
    assert slice_grid("square", 4, 2) == (2, 2)
    assert slice_grid("square", 8, 2) == (2, 4)
    assert slice_grid("depth", 4, 3) == (4, 1, 1)
    assert slice_grid("cube", 8, 3) == (2, 2, 2)
    with pytest.raises(ValueError, match="cube number"):
        slice_grid("cube", 4, 3)
    with pytest.raises(ValueError, match="3D volumes"):
        slice_grid("depth", 4, 2)
    with pytest.raises(ValueError, match="unknown slice"):
        slice_grid("diagonal", 4, 2)


def test_tiles_and_halo() -> None:
    assert tile_shape((1, 8, 101, 100), (2, 2)) == (1, 8, 51, 50)  # uneven tiles round up
    # square 2x2 tile of 64x64, halo 1: (66*66 - 64*64) * 8 channels
    assert halo_elements((1, 8, 128, 128), (2, 2), (1, 1)) == (66 * 66 - 64 * 64) * 8
    # vertical split: only the cut dim (W) gets a halo
    assert halo_elements((1, 8, 128, 128), (1, 4), (1, 1)) == 128 * 2 * 8
    assert halo_elements((1, 8, 128, 128), (2, 2), ()) == 0


class AtenNet(nn.Module):
    """Traced by torch.export (a shape branch): its graph holds ATen calls."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 4:
            x = x + 1
        a = torch.sigmoid(self.c(x)) * 2                      # pointwise
        b = F.pad(a, (0, 0, 0, 0, 1, 1))                      # channels only: tileable
        c = F.pad(a, (1, 1, 1, 1))                            # the image border: not
        d = F.interpolate(b, scale_factor=2.0)                # a scale: tileable
        e = F.interpolate(a, size=(12, 12))                   # 8 -> 12: to a fixed size, tileable
        f = F.interpolate(a, size=(16, 16))                   # 8 -> 16: scale 2, tileable
        return d.sum() + c.sum() + e.sum() + f.sum() + torch.cat([a, a], dim=2).sum()


def test_aten_rules_of_an_exported_graph() -> None:
    from nowdl.trace.tracer import trace

    t = trace(AtenNet(), (torch.randn(1, 2, 8, 8),))
    assert t.tracer == "export"
    r = spatial_rules(t.gm)
    by_target: dict[str, list[bool]] = {}
    for n in t.gm.graph.nodes:
        if n.op == "call_function":
            by_target.setdefault(str(n.target), []).append(r[n.name].tileable)
    assert r["c"].tileable and r["c"].kind == "conv", "the conv is a lifted nn.Conv2d"
    assert by_target["aten.sigmoid.default"] == [True] and by_target["aten.mul.Tensor"] == [True]
    assert by_target["aten.pad.default"] == [True, False]
    # to a fixed size too: index maps over the whole extent, each tile fetches the rows its part reads
    assert by_target["aten.upsample_nearest2d.vec"] == [True, True, True]
    assert by_target["aten.cat.default"] == [False]
    reasons = {r[n.name].reason for n in t.gm.graph.nodes if not r[n.name].tileable and n.op == "call_function"}
    assert any("aten.pad" in x and "border" in x for x in reasons)
    assert any("aten.cat along dim 2" in x for x in reasons)


def test_exposed_halo_time_of_overlapped_ops() -> None:
    """[Note: halo overlap cost]: convs and pools wait for max(0, halo - compute) + the border
    frame; transposed convs and upsampling for the whole exchange each way."""
    from nowdl.partitioner.costs.costmodel import border_fraction, exposed_halo_s
    from nowdl.partitioner.spatial.tileable import SpatialRule

    conv, pool, up = SpatialRule(True, "", (1, 1), "conv"), SpatialRule(True, "", (1, 1), "pool"), \
        SpatialRule(True, "", (1,), "upsample")
    # halo hidden behind compute: only the border recompute is left
    assert exposed_halo_s(conv, 1e-3, 10e-3, 20e-3, True, 0.01) == pytest.approx(0.01 * 10e-3)
    # halo longer than the compute it overlaps (backward: a conv's whole backward but the border)
    assert exposed_halo_s(conv, 30e-3, 10e-3, 20e-3, True, 0.0) == pytest.approx(20e-3 + 10e-3)
    assert exposed_halo_s(conv, 30e-3, 10e-3, 20e-3, True, 0.5) == pytest.approx(20e-3 + 5e-3 + 20e-3)
    assert exposed_halo_s(pool, 1e-3, 2e-3, 2e-3, False, 0.0) == pytest.approx(1e-3)  # no weight gradient
    assert exposed_halo_s(up, 1e-3, 10e-3, 20e-3, False, 0.0) == pytest.approx(2e-3)
    # 1x2 grid of 128x128, halo 1: the two border columns of a 64-wide tile
    assert border_fraction((1, 8, 128, 128), (1, 2), (1, 1)) == pytest.approx(2 / 64)
    assert border_fraction((1, 8, 128, 128), (2, 2), (1, 1)) == pytest.approx(4 / 64)
