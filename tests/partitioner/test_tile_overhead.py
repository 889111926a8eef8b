"""The spatial runtime's work per tiled op in the cost model (costs/tile_overhead.py, DeviceSpec.tile_op_s)."""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest
import torch

import nowdl
from nowdl.errors import NowdlError
from nowdl.partitioner.config.candidate import Candidate
from nowdl.partitioner.costs.costmodel import Costs, build_problem, stage_sums
from nowdl.partitioner.costs.tied import tied_nodes
from nowdl.partitioner.spatial.tileable import spatial_rules
from nowdl.profiler.devices import BUILTIN_SPECS, DeviceSpec

FWD = {"conv": 1e-3, "pool": 2e-3, "upsample": 3e-3, "norm": 4e-3}
BWD = {"conv": 5e-3, "pool": 6e-3, "upsample": 7e-3, "norm": 8e-3}


@cache
def _costs() -> Costs:
    x = torch.empty(1, 3, 64, 64, device="meta")
    cm = nowdl.compile(nowdl.models.unet(depth=2, base_width=8, norm=True), gpus=2, mode="estimate",
                       progress=False, cache=False)
    t = cm.trace(x)
    prof = cm.profile(x)
    return Costs(profile=prof, rules=spatial_rules(t.gm, prof.out_ranks()), link_bw=450e9, mem_cap=None,
                 tied=tied_nodes(t.gm))


def _kinds(costs: Costs) -> list[str]:
    rules = [costs.rules.get(n.name) for n in costs.profile.nodes]
    return [r.kind for r in rules if r is not None and r.tileable and r.kind in FWD]


def test_tiled_stage_and_its_recompute_pay_the_runtime_per_tiled_op() -> None:
    """[Note: tiled runtime overhead]: on a 2-part stage every conv, pool, upsample and norm node
    gains its kind's forward + backward seconds, the recompute gains the forward ones again, and
    the stage's fwd_s / bwd_s figures hold them; elementwise ops and one-part stages gain nothing."""
    plain = _costs()
    charged = dataclasses.replace(plain, tile_op_s=FWD, tile_op_bwd_s=BWD)
    kinds = _kinds(plain)
    assert {"conv", "pool", "upsample", "norm"} <= set(kinds)
    fwd, bwd = sum(FWD[k] for k in kinds), sum(BWD[k] for k in kinds)
    cand = Candidate(1, 2, "gpipe", 1, 1, 2, 1, 0, "square", recompute=(0,))
    times = {}
    for name, costs in (("plain", plain), ("charged", charged)):
        p = build_problem(costs, cand, "throughput")
        key = p.stages[0].variant
        base = p.variants[key.split("+rc")[0]]
        times[name] = (sum(base.time), sum(p.variants[key].time) - sum(base.time))
    assert times["charged"][0] - times["plain"][0] == pytest.approx(fwd + bwd, rel=1e-9)
    assert times["charged"][1] - times["plain"][1] == pytest.approx(fwd, rel=1e-9)
    split = [0] * len(plain.profile.nodes)
    s0, s1 = stage_sums(plain, cand, split)[0], stage_sums(charged, cand, split)[0]
    assert s1["fwd_s"] - s0["fwd_s"] == pytest.approx(fwd, rel=1e-9)
    assert s1["bwd_s"] - s0["bwd_s"] == pytest.approx(bwd, rel=1e-9)
    one_part = Candidate(1, 2, "gpipe", 1, 1, 1, 0, 0, "square")
    assert build_problem(charged, one_part, "throughput").variants["plain"].time == \
        build_problem(plain, one_part, "throughput").variants["plain"].time


def test_inference_tiles_pay_the_forward_only() -> None:
    """An inference plan has no backward: only ``tile_op_s`` is charged."""
    plain = dataclasses.replace(_costs(), inference=True)
    charged = dataclasses.replace(plain, tile_op_s=FWD, tile_op_bwd_s=BWD)
    cand = Candidate(1, 1, "gpipe", 1, 1, 2, 1, 0, "square")
    split = [0] * len(plain.profile.nodes)
    added = stage_sums(charged, cand, split)[0]["fwd_s"] - stage_sums(plain, cand, split)[0]["fwd_s"]
    assert added == pytest.approx(sum(FWD[k] for k in _kinds(plain)), rel=1e-9)
    assert stage_sums(charged, cand, split)[0]["bwd_s"] == pytest.approx(stage_sums(plain, cand, split)[0]["bwd_s"],
                                                                         rel=1e-9)


def test_spec_carries_tile_op_seconds_and_refuses_bad_ones() -> None:
    d = {**BUILTIN_SPECS["h100"].to_dict(), "tile_op_s": {"conv": 4e-4}, "tile_op_bwd_s": {"norm": 1e-4}}
    spec = DeviceSpec.from_dict(d)
    assert spec.tile_op_s == {"conv": 4e-4} and spec.tile_op_bwd_s == {"norm": 1e-4}
    assert DeviceSpec.from_json(spec.to_json()) == spec
    assert "tile_op_s" not in BUILTIN_SPECS["h100"].to_dict()
    for bad in ({"relu": 1e-4}, {"conv": -1.0}, {"conv": True}, 1e-4):
        with pytest.raises(NowdlError, match="tile_op_s"):
            DeviceSpec.from_dict({**d, "tile_op_s": bad})


def test_a_tiled_upsampling_is_charged_its_selections() -> None:
    """[Note: tiled upsampling bytes]: on a 2-part stage a bilinear upsampling's workspace gains
    its last dim's input and a second output tile, a nearest one the input only; a transposed
    convolution (kind upsample too) and every other node gain nothing."""
    from torch import nn

    from nowdl.partitioner.costs.tile_overhead import tile_op_bytes

    for mode, extra in (("bilinear", 0.5 + 1.0), ("nearest", 0.5)):
        net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Upsample(scale_factor=2, mode=mode),
                            nn.Conv2d(4, 2, 3, padding=1))
        x = torch.empty(1, 3, 32, 32, device="meta")
        cm = nowdl.compile(net, gpus=2, mode="estimate", progress=False, cache=False)
        t, prof = cm.trace(x), cm.profile(x)
        costs = Costs(profile=prof, rules=spatial_rules(t.gm, prof.out_ranks()), link_bw=450e9, mem_cap=None,
                      tied=tied_nodes(t.gm))
        two = build_problem(costs, Candidate(1, 1, "gpipe", 1, 1, 2, 1, 0, "square"), "throughput")
        one = build_problem(costs, Candidate(1, 1, "gpipe", 1, 1, 1, 0, 0, "square"), "throughput")
        tiled, plain = two.variants[two.stages[0].variant].workspace, one.variants["plain"].workspace
        for i, n in enumerate(prof.nodes):
            gained = tiled[i] - plain[i] / 2
            if "Upsample" in n.target:
                assert gained == pytest.approx(extra * n.out_bytes / 2, rel=1e-9), (mode, gained)
            else:
                assert gained == pytest.approx(0.0, abs=1e-6), (mode, n.name)
    costs = _costs()  # the built-in UNet: its up path is transposed convolutions
    ups = [n for n in costs.profile.nodes if getattr(costs.rules.get(n.name), "kind", "") == "upsample"]
    assert ups and all("ConvTranspose" in n.target for n in ups)
    assert all(tile_op_bytes(costs.rules[n.name], 2, n.target, n.out_bytes, (1, 8, 16, 16), n.out_shape) == 0.0
               for n in ups)
