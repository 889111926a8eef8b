"""One-sample norms ([Note: one-sample norms]): a BatchNorm after global pooling, at batch 1.

A net with an ASPP-style pooling branch (global average pooling, a 1x1 conv and a BatchNorm,
upsampled back), as fx traces it (the BatchNorm met when the plan profiles it) and as torch.export
traces it (met by the tracer: the graph is for inference only and carries the error that names
the BatchNorm): an inference plan and ``eval_step`` take one sample and equal the model in eval
mode; a training plan takes micro-batches of 2 samples, or names the BatchNorm where it cannot.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nowdl
from nowdl.trace.norm_batch import one_value_norms_in_eval
from nowdl.trace.tracer import trace


class PoolBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.bn(self.c(x)))
        p = F.interpolate(self.pool(a), size=a.shape[2:], mode="bilinear", align_corners=False)
        return self.out(torch.cat([a, p], dim=1))


class Branchy(PoolBranch):
    """The same net with a Python branch on the input's width, which fx cannot trace."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError("even widths only")
        return super().forward(x)


def _net(kind: str = "fx") -> nn.Module:
    torch.manual_seed(0)
    m = PoolBranch() if kind == "fx" else Branchy()
    with torch.no_grad():  # running statistics other than the defaults, so that eval mode shows
        for bn in (m.bn, m.pool[2]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    return m


KINDS = ["fx", "export"]


def test_one_sample_traces_for_inference_and_names_the_batchnorm() -> None:
    t = trace(_net("export"), (torch.randn(1, 3, 8, 8),))
    assert t.tracer == "export" and t.one_sample is not None and t.one_sample.node == "pool.2"
    assert "[1, 4, 1, 1]" in str(t.one_sample) and "2 or more samples" in str(t.one_sample)
    assert trace(_net("export"), (torch.randn(2, 3, 8, 8),)).one_sample is None
    assert trace(_net("fx"), (torch.randn(1, 3, 8, 8),)).tracer == "fx"


def test_the_switch_normalises_one_value_per_channel_as_eval_does() -> None:
    bn = nn.BatchNorm2d(4)
    bn.running_var.fill_(4.0)
    x = torch.randn(1, 4, 1, 1)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(x)
    with one_value_norms_in_eval():
        torch.testing.assert_close(bn(x), x / (4.0 + bn.eps) ** 0.5)
        torch.testing.assert_close(bn(torch.ones(2, 4, 1, 1)), torch.zeros(2, 4, 1, 1))  # two values: batch stats
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(x)


@pytest.mark.parametrize("kind", KINDS)
def test_eval_step_takes_one_sample(kind: str) -> None:
    m = _net(kind).double()
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    cm = nowdl.compile(m, gpus=1, progress=False, cache=False, mode="estimate")
    got = cm.eval_step(x)
    assert cm.eval_plan(x[:1]).model["inputs"][0][0] == 1
    with torch.no_grad():
        torch.testing.assert_close(got, m.eval()(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_training_plans_two_samples_after_an_inference_plan(kind: str) -> None:
    x1 = torch.randn(1, 3, 8, 8)
    cm = nowdl.compile(_net(kind), gpus=2, stages=2, progress=False, cache=False, mode="estimate", global_batch=4)
    assert cm.plan(x1, train=False).model["inputs"][0][0] == 1
    plan = cm.plan(x1)  # the graph traced for inference does not train: 2 samples per micro-batch
    assert plan.model["inputs"][0][0] >= 2
    pinned = nowdl.compile(_net(kind), gpus=2, stages=2, progress=False, cache=False, mode="estimate", global_batch=4,
                           micro_batches=4, replicas=1, dp=1)
    pinned.plan(x1, train=False)
    with pytest.raises(nowdl.OneSampleNormError, match="pool.2") as e:
        pinned.plan(x1)
    assert e.value.node == "pool.2" and "eval mode" in str(e.value)
