"""torch.export graphs made plannable (nowdl.trace.exported): modules lifted, guards gone, train/eval live."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nowdl.trace.exported import ModeAware
from nowdl.trace.tracer import trace


class ShapeNet(nn.Module):
    """fx cannot trace the shape branch, so this goes through torch.export."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.3)
        self.up = nn.Upsample(scale_factor=2)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 8:
            x = x + 1
        y = self.drop(self.act(self.bn(self.conv(x))))
        y = F.dropout(y, 0.2, training=self.training)  # functional: not a module to lift
        return self.head(self.up(y)).to(x.device)


def _export(m: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    t = trace(m, (x,))
    assert t.tracer == "export"
    return t.gm


def test_standard_modules_lifted_under_original_names() -> None:
    m = ShapeNet()
    gm = _export(m, torch.randn(2, 3, 16, 16))
    calls = {str(n.target): type(gm.get_submodule(str(n.target))) for n in gm.graph.nodes if n.op == "call_module"}
    assert {k: v for k, v in calls.items() if not k.startswith("_nowdl")} == {
        "conv": nn.Conv2d, "bn": nn.BatchNorm2d, "act": nn.ReLU, "drop": nn.Dropout, "up": nn.Upsample,
        "head": nn.Conv2d}
    assert any(isinstance(gm.get_submodule(k), ModeAware) for k in calls if k.startswith("_nowdl"))
    assert not gm.get_submodule("act").inplace, "the graph's copy runs out of place"
    assert m.act.inplace, "the model's module is unchanged"
    assert set(gm.state_dict()) == set(m.state_dict())
    for name, p in m.named_parameters():
        assert gm.get_parameter(name) is p, f"{name} is the model's own parameter"
    assert gm.get_buffer("bn.running_mean") is m.bn.running_mean


def test_guards_and_asserts_dropped_other_shapes_run() -> None:
    m = ShapeNet()
    gm = _export(m, torch.randn(2, 3, 16, 16))
    assert not any("guard" in str(n.target) or "_assert" in str(n.target) for n in gm.graph.nodes)
    assert not any(n.target is torch.ops.aten.to.device for n in gm.graph.nodes)
    gm.eval()
    m.eval()
    x = torch.randn(1, 3, 10, 12)  # another batch and image size (a tile, a stage's micro-batch)
    with torch.no_grad():
        assert torch.allclose(gm(x), m(x), atol=1e-6)


def test_train_and_eval_mode_follow_the_module() -> None:
    torch.manual_seed(0)
    m = ShapeNet()
    x = torch.randn(2, 3, 16, 16)
    gm = _export(m, x)
    for mode in (True, False):
        m.train(mode)
        gm.train(mode)
        torch.manual_seed(3)
        ref = m(x)
        torch.manual_seed(3)
        got = gm(x)
        assert torch.allclose(ref, got, atol=1e-6), f"train={mode}"
    before = m.bn.running_mean.clone()
    gm.train()
    gm(x)
    assert not torch.equal(before, m.bn.running_mean), "training the graph updates the model's statistics"
