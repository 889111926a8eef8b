"""Whole values on tiles ([Note: whole values on tiles]): sizes read off tiles, pooled branches.

A net with a squeeze-and-excitation gate (a spatial mean, keepdim), a pooled vector broadcast
back (a mean without keepdim, indexed to (N, C, 1, 1)), a 2x2 adaptive average pooling upsampled
to the size read off a tile (bins that straddle uneven tiles) and a BatchNorm on a pooled value
trains on 3 uneven tiles exactly as one process does, in float64.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from helpers.distributed import run_workers
from helpers.reference import train_reference
from torch import nn

import nowdl
from nowdl.partitioner.spatial import pooled_groups, spatial_rules

STEPS = 2


class PooledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.fc1 = nn.Conv2d(8, 4, 1)
        self.fc2 = nn.Conv2d(4, 8, 1)
        self.pool2 = nn.AdaptiveAvgPool2d(2)
        self.p = nn.Conv2d(8, 4, 1, bias=False)
        self.pbn = nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(12, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.bn1(self.c1(x)))
        a = a * torch.sigmoid(self.fc2(torch.relu(self.fc1(a.mean((2, 3), keepdim=True)))))
        v = a.mean(dim=(-2, -1))
        a = a + v[:, :, None, None]
        p = F.interpolate(torch.relu(self.pbn(self.p(self.pool2(a)))), size=a.shape[2:], mode="bilinear",
                          align_corners=False)
        return self.c2(torch.cat([a, p], dim=1))


def _make() -> nn.Module:
    torch.manual_seed(0)
    return PooledNet().double()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return (torch.randn(4, 3, 12, 22, generator=g, dtype=torch.float64),
            torch.randn(4, 2, 12, 22, generator=g, dtype=torch.float64))


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def test_rules_name_shapes_pools_and_their_branches() -> None:
    gm = fx.symbolic_trace(PooledNet())
    r = spatial_rules(gm)
    kinds = {n: r[n].kind for n in r}
    assert kinds["mean"] == kinds["mean_1"] == kinds["pool2"] == "pooled"
    assert {kinds[n] for n in ("fc1", "fc2", "sigmoid", "getitem", "p", "pbn", "relu_2")} == {"whole"}, kinds
    assert kinds["getattr_1"] == kinds["getitem_1"] == "shape"
    assert all(rule.tileable for rule in r.values())
    groups = {g[0]: set(g) for g in pooled_groups(gm, r)}
    assert {"mul", "fc2"} <= groups["mean"] and "interpolate" in groups["pool2"]


def test_a_pool_whose_branch_reaches_the_output_ends_the_region() -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3, padding=1)
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.c(x).mean((2, 3)))

    r = spatial_rules(fx.symbolic_trace(Head()))
    assert not r["mean"].tileable and not r["fc"].tileable


def _worker(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor], list[int]]:
    cm = nowdl.compile(_make(), gpus=world, stages=1, spatial_parts=world, slice="vertical", micro_batches=2, dp=1,
                       replicas=1, mode="estimate", optimizer=_sgd, loss_fn=nn.MSELoss(), cache=False, progress=False,
                       timeout_s=60)
    losses = [cm.train_step(*_data(s)) for s in range(STEPS)]
    plan = cm._trainer.plan
    assert plan is not None
    return losses, cm.state_dict(), [s.parts for s in plan.stages]


def test_pooled_branches_train_on_uneven_tiles_exactly() -> None:
    results = run_workers(_worker, 3, timeout_s=300)
    model = _make()
    ref_losses, ref_sd = train_reference(model, _sgd(model.parameters()), nn.MSELoss(), _data, 2, STEPS)
    losses, sd, parts = results[0]
    assert parts == [3], parts
    assert all(r[0] == losses for r in results), "the ranks report other losses"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-12, atol=1e-12)
    for k, ref in ref_sd.items():  # weights and running statistics (pbn's too: one copy on every tile)
        torch.testing.assert_close(sd[k], ref, rtol=1e-10, atol=1e-11, msg=lambda m, k=k: f"{k}: {m}")
