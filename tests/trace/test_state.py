"""kept_state (nowdl.trace.state): runs leave the modules' tensors and train/eval flags as they were."""

from __future__ import annotations

import torch
from torch import nn

from nowdl.trace.state import kept_state


class Swaps(nn.Module):
    """A BatchNorm whose running statistics move in training and whose weight the forward writes,
    and a buffer replaced by a new tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(2)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1  # a new tensor under the same name
        self.bn.weight.mul_(2.0)  # a parameter written in place (the runs are under no_grad)
        return self.bn(x)


def test_restore_puts_tensors_and_flags_back() -> None:
    m = Swaps().eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    count = m.count
    with kept_state(m) as restore:
        m.train()
        with torch.no_grad():
            m(torch.randn(4, 2, 3, 3) + 5)
        assert not torch.equal(m.bn.running_mean, before["bn.running_mean"]), "training moved the statistics"
        assert not torch.equal(m.bn.weight, before["bn.weight"])
        assert m.count is not count
        restore()
        assert torch.equal(m.bn.running_mean, before["bn.running_mean"])
        assert torch.equal(m.bn.weight, before["bn.weight"])
        assert m.count is count and m.training is False
        m.train()
        with torch.no_grad():
            m(torch.randn(4, 2, 3, 3))
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert m.count is count
    assert not m.training and not m.bn.training
