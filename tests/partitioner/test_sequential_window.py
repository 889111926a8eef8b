"""Sequential tiles' window in the cost model equals the one the runtime recomputes a tile on
([Note: sequential tiles window] in partitioner/costs/sequential_tiles.py)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

import nowdl
from nowdl.partitioner.costs.costmodel import Costs
from nowdl.partitioner.costs.sequential_tiles import stage_reach_px, window_inflation
from nowdl.partitioner.spatial.tileable import convt_reach, spatial_rules
from nowdl.runtime.spatial.reach import stage_reach


def _costs(side: int) -> tuple[Costs, torch.fx.GraphModule]:
    cm = nowdl.compile(nowdl.models.unet(1, 2, depth=3, base_width=8), gpus=1, mode="estimate", progress=False,
                       cache=False)
    x = torch.empty(1, 1, side, side, device="meta")
    t = cm.trace(x)
    prof = cm.profile(x)
    return Costs(profile=prof, rules=spatial_rules(t.gm, prof.out_ranks()), link_bw=1e9, mem_cap=None), t.gm


@pytest.mark.parametrize(("k", "s", "d", "p", "want"), [
    (2, 2, 1, 0, Fraction(1, 2)),  # each output reads its own input pixel, half a pixel past its footprint
    (3, 1, 1, 1, Fraction(1)),  # a plain 3x3 conv's halo
    (4, 2, 1, 1, Fraction(1)),
    (3, 3, 1, 0, Fraction(2, 3)),
])
def test_transposed_conv_reach_is_exact(k: int, s: int, d: int, p: int, want: Fraction) -> None:
    assert convt_reach(k, s, d, p) == want
    assert convt_reach(k, s, d, p) <= math.ceil(max(d * (k - 1) - p, p + s - 1) / s)  # never past the old bound


def test_cost_model_reach_and_window_match_the_runtime() -> None:
    costs, gm = _costs(256)
    reach = stage_reach(gm, [(Fraction(1), Fraction(1))])
    assert stage_reach_px(costs, [256, 256]) == list(reach.reach) == [51, 51]
    # 2 x 2 tiles of 128: [0, 128) widens to [0, 179) -> 184 (a multiple of the alignment 8)
    assert reach.align == (8, 8)
    assert window_inflation(costs, (2, 2)) == pytest.approx((184 / 128) ** 2)
    # 4 x 4 tiles of 64: inner [64, 128) -> [8, 184), 176 wide; border [0, 64) -> [0, 120)
    assert window_inflation(costs, (4, 4)) == pytest.approx((176 / 64) ** 2)
    assert window_inflation(costs, (4, 4), mean=True) == pytest.approx(((120 + 176 + 176 + 120) / 4 / 64) ** 2)
