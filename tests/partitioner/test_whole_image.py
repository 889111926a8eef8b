"""Whole-image ops: found in the graph, recorded in an inference plan, shown by ``nowdl show``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import nowdl
from nowdl.cli.commands import main
from nowdl.plan.plan import Plan
from nowdl.plan.purpose import format_whole_image_ops
from nowdl.runtime.predict.windows import network_reach

MONAI_ARGS = ('{"spatial_dims": 2, "in_channels": 1, "out_channels": 2, "channels": [8, 16, 32], "strides": [2, 2], '
              '"num_res_units": 1}')


class _Pooled(nn.Module):
    """A conv, a GroupNorm, and a squeeze-excite gate from a global average pool."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.conv(x))
        return self.head(y * self.pool(y))


def _plan(model: nn.Module, shape: tuple[int, ...], train: bool = False) -> Plan:
    cm = nowdl.compile(model.eval(), gpus=1, mode="estimate", cache=False, progress=False)
    return cm.plan(torch.empty(shape, device="meta"), train=train)


def test_inference_plan_records_the_ops_network_reach_names() -> None:
    pytest.importorskip("monai")
    from monai.networks.nets import UNet

    torch.manual_seed(0)
    net = UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(8, 16, 32), strides=(2, 2), num_res_units=1)
    plan = _plan(net, (1, 1, 64, 64))
    ops = plan.config["whole_image_ops"]
    assert ops and all(o["op"] == "InstanceNorm2d" and o["kind"] == "instance/group norm statistics" for o in ops)
    assert [o["pass"] for o in ops] == [1, 2, 3, 4, 5, 6]  # a chain: one statistics pass each
    assert all(o["windowed"].startswith("exact: whole-image statistics") for o in ops)
    example = torch.empty(1, 1, 64, 64)
    reach = network_reach(nowdl.compile(net.eval(), gpus=1, mode="estimate", cache=False,
                                        progress=False).trace(example).gm, example)
    assert [(o["node"], o["pass"]) for o in ops] == [(n, p) for n, _, _, p in reach.whole]  # one list, two readers
    again = Plan.from_json(plan.to_json())
    assert again.config["whole_image_ops"] == ops


def test_group_norm_and_global_pooling_named_bounded_networks_empty() -> None:
    ops = _plan(_Pooled(), (1, 1, 32, 32)).config["whole_image_ops"]
    assert [(o["op"], o["kind"], o["pass"]) for o in ops] == [("GroupNorm", "instance/group norm statistics", 1),
                                                             ("AdaptiveAvgPool2d", "global pooling", 2)]
    torch.manual_seed(0)
    plan = _plan(nowdl.models.unet(1, 2, depth=2, base_width=4), (1, 1, 32, 32))  # BatchNorm, eval: running stats
    assert plan.config["whole_image_ops"] == []
    assert "none" in format_whole_image_ops(plan)
    train = _plan(_Pooled(), (1, 1, 32, 32), train=True)
    assert "whole_image_ops" not in train.config and format_whole_image_ops(train) == ""


def test_show_prints_them_and_an_older_plan_still_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("monai")
    out = tmp_path / "p.json"
    assert main(["plan", "monai.networks.nets:UNet", "--model-args", MONAI_ARGS, "--input", "1x1x64x64", "--gpus", "1",
                 "--inference", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    n = len(json.loads(out.read_text())["config"]["whole_image_ops"])
    assert f"whole-image ops: {n}, {n} exact when streamed, 0 not" in shown and f"{n} statistics pass(es)" in shown
    assert "InstanceNorm2d, instance/group norm statistics): exact: whole-image statistics" in shown
    old = json.loads(out.read_text())
    del old["config"]["whole_image_ops"]  # a plan made before the field
    out.write_text(json.dumps(old))
    assert main(["show", str(out)]) == 0
    assert "whole-image ops: not recorded" in capsys.readouterr().out
