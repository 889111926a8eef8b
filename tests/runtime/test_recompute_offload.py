"""The recompute and offload mechanisms on one process: gradients, buffers and random numbers
equal plain autograd's in the pipeline's order (every forward, then every backward), and the
memory they promise is not held."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from nowdl.errors import NowdlError
from nowdl.profiler.memory import AllocTracker
from nowdl.runtime.pipeline.offload import Offload
from nowdl.runtime.pipeline.recompute import Recompute

CPU = torch.device("cpu")


class EmaCenter(nn.Module):
    """Subtracts a momentum-updated buffer (read in its output), then updates it: the next op saves
    the result, so a recompute that read the updated buffer would save other values."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("center", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x - self.center
        with torch.no_grad():
            self.center.mul_(0.9).add_(0.1 * x.mean())
        return y


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.3),
        nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.GroupNorm(2, 4), EmaCenter(),
        nn.InstanceNorm2d(4, affine=True, track_running_stats=True), nn.Tanh(),
    ).double()


def _xs(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(2, 2, 8, 8, dtype=torch.float64, generator=g) for _ in range(n)]


def _train(model: nn.Module, forward: Callable[[int, torch.Tensor], torch.Tensor],
           before_backward: Callable[[int], None] = lambda i: None) -> torch.Tensor:
    """All forwards, then all backwards (GPipe order); returns a draw of the generator afterwards."""
    torch.manual_seed(5)
    outs = [forward(i, x) for i, x in enumerate(_xs())]
    for i, o in enumerate(outs):
        before_backward(i)
        o.square().mean().backward()
    return torch.rand(4)


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), k
    for (k, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), k


def test_recompute_equals_plain_autograd() -> None:
    """Same gradients, running statistics updated once, the momentum buffer read as in the forward,
    dropout masks replayed and the generator advanced once."""
    plain, mine = _net(), _net()
    after_plain = _train(plain, lambda i, x: plain(x))
    rc = Recompute({0}, CPU)
    after_mine = _train(mine, lambda i, x: rc.forward((0, 0, i), mine, lambda: mine(x)),
                        lambda i: rc.recompute((0, 0, i)))
    assert torch.equal(after_plain, after_mine)
    _assert_same(plain, mine)


def test_torch_checkpoint_updates_running_statistics_twice() -> None:
    """Why nowdl has its own recompute: torch.utils.checkpoint reruns BatchNorm's update."""
    from torch.utils.checkpoint import checkpoint

    plain, ckpt = _net(), _net()
    _train(plain, lambda i, x: plain(x))
    _train(ckpt, lambda i, x: checkpoint(ckpt, x, use_reentrant=False))
    assert not torch.equal(plain.state_dict()["1.running_mean"], ckpt.state_dict()["1.running_mean"])


def test_recompute_keeps_no_saved_activation() -> None:
    """After the forward only the output and the stage's inputs are live, not the activations."""
    x = _xs(1)[0]

    def held_after_forward(run: Callable[[nn.Module], Any]) -> int:
        model = _net()
        with AllocTracker() as tracker:
            out = run(model)
            tracker.poll()
            live = tracker.current
        del out
        return live

    rc = Recompute({0}, CPU)
    plain = held_after_forward(lambda m: m(x))
    recomputed = held_after_forward(lambda m: rc.forward((0, 0, 0), m, lambda: m(x)))
    assert recomputed < plain / 3, (recomputed, plain)


def test_recompute_of_an_unrepeatable_forward_is_refused() -> None:
    class Flaky(nn.Module):
        calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return torch.tanh(x) if self.calls % 2 else x * x

    m = Flaky()
    x = torch.randn(3, requires_grad=True)
    rc = Recompute({0}, CPU)
    y = rc.forward((0, 0, 0), m, lambda: torch.sin(m(x)))
    with pytest.raises(NowdlError, match=r"recompute of stage 0, micro-batch 0 \(replica 0\).*not repeatable"):
        rc.recompute((0, 0, 0))
    del y


def test_offload_equals_plain_autograd_and_counts_bytes() -> None:
    plain, mine = _net(), _net()
    _train(plain, lambda i, x: plain(x))
    off = Offload({0}, CPU)
    off.begin_step()

    def forward(i: int, x: torch.Tensor) -> torch.Tensor:
        with off.saving((0, 0, i), [x], [mine]):
            return mine(x)  # type: ignore[no-any-return]

    _train(mine, forward, lambda i: off.prefetch((0, 0, i)))
    _assert_same(plain, mine)
    # every micro-batch: at least the two convs' outputs (what BatchNorm and GroupNorm save)
    assert off.step_bytes == off.bytes_out >= 3 * 2 * (2 * 4 * 8 * 8 * 8)
    assert off.peak_host_bytes >= off.bytes_out  # nothing came back before the last forward ended
    for i in range(3):
        off.drop((0, 0, i))
    assert off.host_bytes == 0
