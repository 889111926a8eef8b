"""Which values share memory, read from an exported graph's recorded fake values
(nowdl.trace.aliasing): the same answer as the fake run, node for node."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from nowdl.trace.aliasing import recorded_view_parents
from nowdl.trace.exported import normalize_exported
from nowdl.trace.functional import _view_parents


class Aliases(nn.Module):
    """Views, values returned as they are by eager PyTorch (dropout p = 0, ``to`` the same dtype,
    Identity, Flatten), writes in place through them, a functional conv on a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.drop = nn.Dropout(0.0)
        self.act = nn.ReLU(inplace=True)
        self.same = nn.Identity()
        self.flat = nn.Flatten(2)
        self.w = nn.Parameter(torch.randn(4, 4, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.conv(x)
        b = self.act(self.drop(a))  # the write reaches a through the dropout in eager PyTorch
        c = torch.nn.functional.dropout(b, 0.0, True).to(torch.float32)
        v = c[:, :2]
        v.mul_(2.0)  # a write through a view: c sees it
        d = torch.nn.functional.conv2d(self.same(c), self.w)
        e = self.flat(d).transpose(1, 2).contiguous()
        if e.shape[-1] > 3:  # fx cannot trace a branch on a shape: an export graph
            e = e + 1
        return e.sum(-1) + a.mean()


def _names(parent: dict[fx.Node, fx.Node | None]) -> dict[str, str | None]:
    return {n.name: (p.name if p is not None else None) for n, p in parent.items()}


def _exported(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    ep = torch.export.export(model, (x,), strict=False)
    gm = ep.module()
    assert isinstance(gm, fx.GraphModule)
    return normalize_exported(gm, model)


def test_recorded_aliasing_equals_the_fake_run() -> None:
    torch.manual_seed(0)
    model = Aliases()
    x = torch.randn(1, 2, 6, 6)
    gm = _exported(model, x)
    recorded = recorded_view_parents(gm)
    assert recorded is not None, "every node of an exported graph has a recorded value"
    ran = _view_parents(gm, (x,))
    assert _names(recorded) == _names(ran)
    shared = {k: v for k, v in _names(recorded).items() if v is not None}
    assert shared.get("drop") == "conv", shared  # dropout p = 0 returns its input itself


def test_eval_mode_dropout_is_its_input() -> None:
    torch.manual_seed(0)
    model = Aliases()
    x = torch.randn(1, 2, 6, 6)
    gm = _exported(model, x)
    model.eval()  # the lifted Dropout is the model's own module: it now returns its input
    model.drop.p = 0.5
    recorded = recorded_view_parents(gm)
    assert recorded is not None
    assert _names(recorded) == _names(_view_parents(gm, (x,)))


def test_an_fx_graph_has_no_recorded_values() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(inplace=True)))
    assert recorded_view_parents(gm) is None
