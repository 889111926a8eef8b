"""A recomputed stage's saved-tensor hooks in the cost model ([Note: recompute hooks] in costs/levers.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import nowdl
from nowdl.errors import NowdlError
from nowdl.partitioner.config.candidate import Candidate
from nowdl.partitioner.costs.costmodel import Costs, build_problem, stage_sums
from nowdl.partitioner.costs.levers import LEVER_KEYS, lever_figures
from nowdl.partitioner.costs.tied import tied_nodes
from nowdl.partitioner.spatial.tileable import spatial_rules
from nowdl.profiler.devices import BUILTIN_SPECS, DeviceSpec


def _costs(model: nn.Module, x: torch.Tensor) -> Costs:
    cm = nowdl.compile(model, gpus=2, mode="estimate", progress=False, cache=False)
    t = cm.trace(x)
    prof = cm.profile(x)
    return Costs(profile=prof, rules=spatial_rules(t.gm, prof.out_ranks()), link_bw=450e9, mem_cap=None,
                 tied=tied_nodes(t.gm))


def test_profile_counts_the_tensors_each_node_saves() -> None:
    """The accounting run counts what autograd saves: a conv its input and weight, a ReLU its result."""
    costs = _costs(nn.Sequential(nn.Conv2d(1, 2, 3, bias=False), nn.ReLU()), torch.randn(1, 1, 8, 8))
    by_target = {n.target.rsplit(".", 1)[-1]: n.saved_tensors for n in costs.profile.nodes if n.op == "call_module"}
    assert by_target == {"Conv2d": 2, "ReLU": 1}


def test_recompute_pays_its_hooks_per_saved_tensor() -> None:
    """A recomputed stage's time per micro-batch grows by saved tensors x ``recompute_tensor_s``
    (and its ``recompute_s`` figure with it); a stage not recomputed does not change."""
    costs = _costs(nowdl.models.resnet(depth=8, version=1, width=4, num_classes=10, conv_bias=False),
                   torch.empty(1, 3, 32, 32, device="meta"))
    charged = dataclasses.replace(costs, recompute_tensor_s=1e-3)
    n = len(costs.profile.nodes)
    split = [0 if i < n // 2 else 1 for i in range(n)]
    cand = Candidate(2, 4, "1f1b", 1, 1, 1, 0, 0, "square", recompute=(0,))
    tensors = sum(node.saved_tensors for node, s in zip(costs.profile.nodes, split, strict=True) if s == 0)
    assert tensors > 10
    figures = []
    for c in (costs, charged):
        p = build_problem(c, cand, "throughput")
        times = [sum(t for t, s in zip(p.variants[p.stages[k].variant].time, split, strict=True) if s == k)
                 for k in (0, 1)]
        rc = lever_figures(p, cand, split, stage_sums(c, cand, split), None)
        figures.append((times, [f["recompute_s"] for f in rc]))
    (t0, r0), (t1, r1) = figures
    assert t1[0] - t0[0] == pytest.approx(tensors * 1e-3, rel=1e-9)
    assert r1[0] - r0[0] == pytest.approx(tensors * 1e-3, rel=1e-9)
    assert t1[1] == t0[1] and r1[1] == r0[1] == 0.0
    assert "recompute_s" in LEVER_KEYS


def test_spec_carries_recompute_tensor_seconds() -> None:
    d = {**BUILTIN_SPECS["h100"].to_dict(), "recompute_tensor_s": 2e-5}
    assert DeviceSpec.from_json(DeviceSpec.from_dict(d).to_json()).recompute_tensor_s == 2e-5
    with pytest.raises(NowdlError, match="recompute_tensor_s"):
        DeviceSpec.from_dict({**d, "recompute_tensor_s": -1.0})
