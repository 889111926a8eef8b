"""Offload keeps only a window of saved tensors on the device during the backward.

Each saved variable of an offloaded forward holds the pack hook until it is freed, so anything
the hook holds strongly lives as long as the whole graph. On an H200 a strong reference there
kept every tensor fetched back until the backward ended (13 GiB of a 2048² UNet's 13.7 GiB);
this counts the copies alive at each step of the backward of a chain on the CPU path.
"""

from __future__ import annotations

import gc

import torch
from torch import nn

from nowdl.runtime.pipeline.offload import WINDOW, Offload, _Held


def _alive_fetched() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is _Held and o.dev is not None)


def test_copies_fetched_back_die_with_their_node() -> None:
    torch.manual_seed(0)
    layers = 12
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(layers)])
    off = Offload({0}, torch.device("cpu"))
    x = torch.randn(8, 64, requires_grad=True)
    seen: list[int] = []
    for block in model:  # count, as each block's backward starts, the fetched copies still alive
        block[1].register_full_backward_pre_hook(lambda *_: seen.append(_alive_fetched()) or None)
    off.begin_step()
    with off.saving((0, 0, 0), [x], [model]):
        y = model(x)
    off.prefetch((0, 0, 0))
    y.square().sum().backward()
    assert len(seen) == layers
    # a block saves its input and the Linear's output (Linear input, Tanh output): at most the
    # window, the tensors in use and the next block's are on the device, never the whole chain
    assert max(seen) <= 2 * WINDOW + 2, seen
    ref = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(layers)])
    ref.load_state_dict(model.state_dict())
    x2 = x.detach().clone().requires_grad_()
    model.zero_grad()
    ref(x2).square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
