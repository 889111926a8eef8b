"""[Note: halo wider than a tile]: pinned spatial parts that cut a dilated conv's output into
tiles narrower than its halo are refused naming the node, the halo against the tile and the
image that holds it, not the memory cap; the image it names plans."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nowdl


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),  # to 1/2 of the input
                         nn.Conv2d(8, 8, 3, padding=12, dilation=12), nn.ReLU(), nn.Conv2d(8, 2, 1))


def _plan(width: int) -> nowdl.Plan:
    cm = nowdl.compile(_net(), gpus=2, stages=1, spatial_parts=2, slice="vertical", micro_batches=1, dp=1,
                       replicas=1, mode="estimate", progress=False, cache=False)
    return cm.plan(torch.empty(1, 3, 32, width, device="meta"))


def test_a_halo_wider_than_the_tile_names_the_node_and_the_image_that_holds_it() -> None:
    with pytest.raises(nowdl.TileHaloError) as e:
        _plan(32)  # the dilated conv's output: 16 columns at 1/2, 8 per tile, against a halo of 12
    text = str(e.value)
    assert e.value.node == "_2" and text.startswith("Node '_2' (Conv2d)"), text
    assert "a halo of 12 pixels along W" in text and "leaves 8 per tile" in text, text
    assert "at least 48 pixels along W" in text and "fewer spatial parts" in text, text
    assert "memory" not in text.replace("at any memory cap", ""), text  # the cap is not the cause
    assert isinstance(e.value, nowdl.InfeasibleError)  # callers that catch a refusal still do


def test_the_image_the_refusal_names_plans_on_the_same_tiles() -> None:
    plan = _plan(48)  # 24 columns at 1/2: tiles of 12, as wide as the halo
    assert [s.parts for s in plan.stages] == [2]
