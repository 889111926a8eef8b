"""An input size the network cannot take is refused naming the multiple it needs ([Note: size
multiples]), not with an fx node dump."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

import nowdl
from nowdl.errors import NowdlError
from nowdl.trace.sizes import runs_at, size_refusal, stride_product


def _unet() -> nn.Module:
    torch.manual_seed(0)
    return nowdl.models.unet(depth=2, base_width=4)  # two stride-2 levels


def test_size_refusal_names_the_multiple() -> None:
    gm = fx.symbolic_trace(_unet())
    x = torch.empty(1, 3, 30, 30)
    assert stride_product(gm) == 4 and not runs_at(gm, [x], [30, 30]) and runs_at(gm, [x], [32, 28])
    msg = size_refusal(gm, [x], "UNet")
    assert msg is not None and "UNet cannot take an input of 1x3x30x30" in msg
    assert "multiples of 4" in msg and "use 1x3x28x28 or 1x3x32x32" in msg, msg
    assert size_refusal(gm, [torch.empty(1, 3, 32, 32)], "UNet") is None  # it runs: nothing to say
    flat = fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Flatten(), nn.Linear(3 * 30 * 30, 2)))
    assert size_refusal(flat, [torch.empty(1, 3, 31, 31)], "net") is None  # a failure no multiple explains


@pytest.mark.parametrize("size,alts", [((30, 34), "1x3x28x32 or 1x3x32x36"),  # refused by the tracer's check
                                       ((510, 510), "1x3x508x508 or 1x3x512x512")],  # checked on a smaller copy:
                         ids=["traced", "profiled"])                                 # refused when profiled
def test_planning_an_impossible_size_is_one_paragraph(size: tuple[int, int], alts: str) -> None:
    cm = nowdl.compile(_unet(), gpus=2, mode="estimate", cache=False, progress=False)
    with pytest.raises(NowdlError) as e:
        cm.plan(torch.empty(1, 3, *size, device="meta"))
    msg = str(e.value)
    assert "multiples of 4" in msg and alts in msg and "%" not in msg and "\n" not in msg, msg
