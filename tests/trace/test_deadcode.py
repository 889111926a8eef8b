"""Unused computations are dropped from traced graphs only where that changes nothing."""

from __future__ import annotations

import torch
from torch import nn

from nowdl.trace.tracer import trace


class _Heads(nn.Module):
    """Computes a head it throws away (as MONAI's BasicUNetPlusPlus without deep supervision)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Conv2d(1, 4, 3, padding=1)
        self.dead_head = nn.Conv2d(4, 2, 1)
        self.dead_norm = nn.BatchNorm2d(4)  # updates running statistics: kept
        self.dead_drop = nn.Dropout(0.5)  # draws random numbers: kept
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.body(x))
        _unused = [self.dead_head(y), torch.sigmoid(y) * 2, self.dead_norm(y), self.dead_drop(y),
                   torch.nn.functional.conv2d(y, self.dead_head.weight)]
        return self.head(y)


def _targets(t: object) -> list[str]:
    """Each call's target, and for nowdl's ATen wrappers (ModeAware) the op they call."""
    gm = t.gm  # type: ignore[attr-defined]
    return [str(getattr(gm.get_submodule(n.target), "op", n.target)) if n.op == "call_module" else str(n.target)
            for n in gm.graph.nodes if n.op != "get_attr"]


def test_dead_pure_nodes_go_and_stateful_or_random_ones_stay() -> None:
    for tracer in ("fx", "export"):
        m = _Heads()
        t = trace(m, (torch.randn(2, 1, 8, 8),), tracer=tracer)
        names = _targets(t)
        assert "dead_head" not in names and not any("sigmoid" in n or "conv2d" in n for n in names), (tracer, names)
        # fx keeps the modules; export keeps the ATen calls (the dead norm's were not lifted)
        assert any("norm" in n for n in names) and any("drop" in n for n in names), (tracer, names)
        x = torch.randn(2, 1, 8, 8)
        m.eval()
        t.gm.eval()
        torch.testing.assert_close(t.gm(x), m(x))
        assert "dead_head.weight" in dict(m.named_parameters())  # the model itself is untouched


def test_running_statistics_of_a_dead_norm_still_follow_the_model() -> None:
    m = _Heads()
    t = trace(m, (torch.randn(2, 1, 8, 8),), tracer="fx")
    before = m.dead_norm.running_mean.clone()
    t.gm.train()
    t.gm(torch.randn(2, 1, 8, 8))
    assert not torch.equal(m.dead_norm.running_mean, before)
