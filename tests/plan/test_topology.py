"""Topology: parsing and validation, placement, links charged per crossing, hierarchical all-reduce, node maps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import nowdl
from nowdl.cli.commands import main
from nowdl.errors import NowdlError, PlanError
from nowdl.partitioner.config.candidate import Candidate, PlanRequest
from nowdl.partitioner.costs.costmodel import Costs, build_problem, grad_sync_s
from nowdl.partitioner.costs.traffic import cross_node_bytes, format_node_map
from nowdl.partitioner.placement.layout import allreduce_s, place
from nowdl.partitioner.spatial.tileable import spatial_rules
from nowdl.plan.topology import (
    BUILTIN_NODES,
    Link,
    NodeSpec,
    Topology,
    make_topology,
    node_spec_for,
)
from nowdl.profiler import DeviceSpec
from nowdl.trace.tracer import trace

ROOT = Path(__file__).resolve().parents[2]
H100_NVLINK = 450e9
TINY = '{"depth": 8, "version": 1, "width": 4, "num_classes": 3}'


def _topo(nodes: int, per: int) -> Topology:
    return make_topology(nodes * per, nodes=nodes, gpus_per_node=per, node=BUILTIN_NODES["dgx-h100"],
                         link_bw=H100_NVLINK)


# ---------------------------------------------------------------- parsing and validation

def test_builtin_nodes_and_defaults() -> None:
    t = make_topology(64, node=node_spec_for("h100", "h100"), link_bw=H100_NVLINK)
    assert (t.nodes, t.gpus_per_node, t.name) == (8, 8, "dgx-h100")
    assert t.intra == Link(450e9, 10e-6) and t.inter == Link(50e9, 20e-6)
    assert [t.node_of(r) for r in (0, 7, 8, 63)] == [0, 0, 1, 7]
    a100 = make_topology(16, node=node_spec_for("a100", "a100"), link_bw=300e9)
    assert (a100.nodes, a100.inter.bw, a100.intra.bw) == (2, 25e9, 300e9)
    # fewer GPUs than a node, or a count the node does not divide: one node holds every rank
    assert make_topology(4, node=BUILTIN_NODES["dgx-h100"], link_bw=H100_NVLINK).nodes == 1
    assert make_topology(12, node=BUILTIN_NODES["dgx-h100"], link_bw=H100_NVLINK).nodes == 1
    assert node_spec_for("v100", "v100") is None  # no default node: one node unless the flags say
    flags = make_topology(12, nodes=3, node=None, link_bw=150e9)
    assert (flags.nodes, flags.gpus_per_node, flags.inter.bw) == (3, 4, 150e9)


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"gpus": 16, "nodes": 3, "gpus_per_node": 8}, "--nodes 3 x --gpus-per-node 8 = 24 GPUs, but --gpus is 16"),
    ({"gpus": 16, "nodes": 3}, "--gpus 16 does not split over --nodes 3"),
    ({"gpus": 12, "gpus_per_node": 8}, "--gpus 12 is not a multiple of --gpus-per-node 8"),
    ({"gpus": 8, "nodes": 0}, "--nodes must be a positive integer"),
])
def test_make_topology_bad_input(kwargs: dict[str, int], needle: str) -> None:
    gpus = kwargs.pop("gpus")
    with pytest.raises(NowdlError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        make_topology(gpus, link_bw=1e9, **kwargs)


def test_plan_request_checks_nodes_times_gpus_per_node() -> None:
    with pytest.raises(NowdlError, match=r"nodes \(2\) x gpus_per_node \(8\) = 16 GPUs, but gpus is 8"):
        PlanRequest(gpus=8, nodes=2, gpus_per_node=8)
    with pytest.raises(NowdlError, match="gpus_per_node must be a positive integer"):
        PlanRequest(gpus=8, gpus_per_node=0)


def test_node_in_a_device_spec_json(tmp_path: Path) -> None:
    spec = {"name": "mygpu", "fp32_flops": 1e13, "bf16_flops": 1e14, "fp16_flops": 1e14, "mem_bw": 1e12,
            "link_bw": 2e11, "memory_bytes": 2**34,
            "node": {"gpus_per_node": 4, "inter_bw": 1e10, "inter_latency_s": 5e-6, "name": "pcie-box"}}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    assert DeviceSpec.load(path).link_bw == 2e11  # the device spec ignores "node"
    node = node_spec_for(str(path), "mygpu")
    assert node == NodeSpec(4, 1e10, 5e-6, name="pcie-box")
    t = make_topology(8, node=node, link_bw=2e11)
    assert (t.nodes, t.intra.bw, t.inter.bw, t.name) == (2, 2e11, 1e10, "pcie-box")
    for bad, needle in (({"gpus_per_node": 0, "inter_bw": 1, "inter_latency_s": 0}, "gpus_per_node"),
                        ({"gpus_per_node": 4, "inter_bw": -1.0, "inter_latency_s": 0}, "inter_bw"),
                        ({"gpus_per_node": 4, "inter_bw": 1e9, "inter_latency_s": 0, "nics": 8}, "unknown field")):
        path.write_text(json.dumps({**spec, "node": bad}))
        with pytest.raises(NowdlError, match=needle):
            node_spec_for(str(path), "mygpu")


def test_cli_bad_topology_exits_2_writing_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    rc = main(["plan", "resnet", "--model-args", TINY, "--input", "1x3x16x16", "--gpus", "16", "--nodes", "3",
               "--gpus-per-node", "8", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert err.startswith("nowdl plan: error: nodes (3) x gpus_per_node (8) = 24 GPUs, but gpus is 16")
    assert err.count("\n") == 1


# ---------------------------------------------------------------- placement

def test_placement_keeps_master_pairs_inside_a_node() -> None:
    cand = Candidate(4, 2, "1f1b", 2, 1, 1, 0, 0, "square")
    lay = place(cand, _topo(2, 2))
    assert [lay.rank_of[(0, j, 0)] for j in range(4)] == [0, 2, 3, 1]  # slots 0 and 3 share node 0
    assert not any(lay.master_cross(s) for s in range(4))
    one = place(cand, _topo(1, 4))
    assert [one.rank_of[(0, j, 0)] for j in range(4)] == [0, 1, 2, 3]  # one node: as before


def test_placement_keeps_tile_groups_inside_a_node() -> None:
    # 4 copies of [4 tiles, 1, 1]: numbered in order, copy 1's tiles would be ranks 6-9 (nodes 0 and 1)
    cand = Candidate(3, 2, "1f1b", 1, 4, 4, 1, 0, "square")
    lay = place(cand, _topo(3, 8))
    assert not lay.tiles_cross(0)
    for d in range(4):
        assert len({lay.node(r) for r in lay.group(d, 0, 0)}) == 1
    assert sorted(lay.rank_of.values()) == list(range(24))
    # a group larger than a node spans whole nodes
    big = place(Candidate(1, 1, "1f1b", 1, 2, 16, 1, 0, "square"), _topo(4, 8))
    assert big.tiles_cross(0) and big.group(1, 0, 0) == list(range(16, 32))


# ---------------------------------------------------------------- costs per crossing

def _costs(topo: Topology | None) -> Costs:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    x = torch.empty(1, 3, 64, 64, device="meta")
    t = trace(model, (x,))
    prof = nowdl.profile(model, x, mode="estimate", device_spec="h100", cache=False, progress=False)
    return Costs(profile=prof, rules=spatial_rules(t.gm), link_bw=H100_NVLINK, mem_cap=None, topology=topo)


def test_halo_and_boundaries_charged_at_the_link_they_cross() -> None:
    cand = Candidate(2, 2, "1f1b", 1, 1, 4, 1, 0, "square")  # 4 tiles, then 1 rank: 5 ranks
    inside = build_problem(_costs(_topo(1, 5)), cand, "memory")  # all on one node
    assert inside.stages[0].variant == "tiled4" and inside.stages[1].link_s_per_byte == 2 / H100_NVLINK
    cand2 = Candidate(2, 2, "1f1b", 1, 2, 4, 1, 0, "square")  # [4 tiles, 1] x dp 2 = 10 ranks
    split = build_problem(_costs(_topo(5, 2)), cand2, "memory")  # 2 GPUs per node: the tiles span 2 nodes
    assert split.stages[0].variant == "tiled4-inter"
    inter, intra = split.variants["tiled4-inter"], split.variants["tiled4"]
    topo = _topo(5, 2)
    halo_nodes = [i for i, (a, b) in enumerate(zip(inter.time, intra.time, strict=True)) if a != b]
    assert halo_nodes  # the three convs (their halos), nothing else
    for i in halo_nodes:
        extra = inter.time[i] - intra.time[i]
        hb = (extra - 2 * (topo.inter.latency_s - topo.intra.latency_s)) / (2 * (1 / topo.inter.bw - 1 / topo.intra.bw))
        assert hb > 0  # time = 2 x halo bytes / bandwidth + 2 x latency, at the inter-node link
    assert split.stages[0].link_s_per_byte == split.stages[1].link_s_per_byte == 2 / topo.inter.bw
    same = build_problem(_costs(None), cand2, "memory")  # no topology: one flat node, as before topologies
    assert same.stages[0].variant == "tiled4" and same.stages[1].link_s_per_byte == 2 / H100_NVLINK


def test_hierarchical_all_reduce() -> None:
    topo = _topo(4, 8)
    b = 1e9
    assert allreduce_s(b, [8], topo) == pytest.approx(2 * 7 / 8 * b / 450e9)  # one node: the ring of before
    assert allreduce_s(b, [1], topo) == 0.0
    want = 2 * 3 / 4 * b / 450e9 + 2 * 1 / 2 * (b / 4) / 50e9 + 2 * 1 * 20e-6  # 4 + 4 over 2 nodes
    assert allreduce_s(b, [4, 4], topo) == pytest.approx(want)
    one_per_node = 2 * 3 / 4 * b / 50e9 + 2 * 3 * 20e-6  # 4 nodes, 1 each: a ring across nodes
    assert allreduce_s(b, [1, 1, 1, 1], topo) == pytest.approx(one_per_node)
    assert allreduce_s(b, [4, 4], topo) < one_per_node
    costs = _costs(topo)
    dp8 = Candidate(1, 1, "1f1b", 1, 32, 1, 0, 0, "square")  # 32 copies, 8 per node
    assert grad_sync_s(costs, dp8, [b]) == pytest.approx(allreduce_s(b, [8, 8, 8, 8], topo))
    flat = _costs(None)
    dp4 = Candidate(1, 1, "1f1b", 1, 4, 1, 0, 0, "square")
    assert grad_sync_s(flat, dp4, [b]) == 2 * (4 - 1) / 4 * b / H100_NVLINK  # unchanged on one node


# ---------------------------------------------------------------- the plan and nowdl show

def test_node_map_in_the_plan_json_and_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert main(["plan", "resnet", "--model-args", TINY, "--input", "1x3x16x16", "--gpus", "4", "--nodes", "2",
                 "--gpus-per-node", "2", "--stages", "4", "--replicas", "2", "--dp", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "topology: 2 nodes x 2 GPUs" in printed and "bytes per step crossing nodes" in printed
    d = json.loads(out.read_text())
    assert d["version"] == 3
    topo = d["topology"]
    assert (topo["nodes"], topo["gpus_per_node"], topo["node_of_rank"]) == (2, 2, [0, 0, 1, 1])
    assert topo["together"] == [[0, 1], [2, 3]]  # the MASTER pairs (slots 0+3, 1+2)
    assert [s["ranks"] for s in d["stages"]] == [[0], [2], [3], [1]]
    assert topo["cross_node_bytes"]["master"] == 0 and topo["cross_node_bytes"]["boundary"] > 0
    plan = nowdl.Plan.load(out)
    assert cross_node_bytes(plan) == topo["cross_node_bytes"]
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "node 0: ranks 0,1: dp0/r0:s0, dp0/r0:s3, dp0/r1:s0, dp0/r1:s3" in shown
    assert "node 1: ranks 2,3:" in shown
    assert "bytes per step crossing node boundaries: halo 0 B, boundary" in shown and "master 0 B" in shown
    # a hand-edited map that launchers could not produce
    topo["node_of_rank"] = [0, 1, 0, 1]
    out.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"puts rank 1 on node 1, but launchers put rank 1 on node 1 // 2 = 0"):
        nowdl.Plan.load(out)
    topo["node_of_rank"] = [0, 0, 1, 1]
    topo["gpus_per_node"] = 1
    out.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"topology.nodes 2 x gpus_per_node 1 = 2 GPUs, but config.gpus is 4"):
        nowdl.Plan.load(out)


def test_plans_without_topology_load_as_one_node(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "v1.json"
    assert main(["plan", "resnet", "--model-args", TINY, "--input", "1x3x16x16", "--gpus", "2", "--stages", "2",
                 "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    del d["topology"]
    d["version"] = 1
    out.write_text(json.dumps(d))
    capsys.readouterr()
    plan = nowdl.Plan.load(out)
    assert plan.topology == {} and cross_node_bytes(plan)["total"] == 0
    assert "one node holds every rank" in format_node_map(plan)
    assert main(["show", str(out)]) == 0
    assert "node 0: ranks 0,1: dp0:s0, dp0:s1" in capsys.readouterr().out


def test_the_64_h100_experiments_keep_their_halos_where_the_node_map_says() -> None:
    plan = nowdl.Plan.load(ROOT / "experiments" / "unet_8192_64gpu_h100.json")
    topo = plan.topology
    assert (topo["nodes"], topo["gpus_per_node"]) == (8, 8)
    groups = [[r.rank for r in plan.ranks if r.dp == d] for d in range(plan.config["dp"])]
    assert all(len({topo["node_of_rank"][r] for r in g}) == 1 for g in groups)  # every tile group in one node
    assert cross_node_bytes(plan)["halo"] == 0 and topo["cross_node_bytes"]["halo"] == 0
    text = format_node_map(plan)
    assert "node 0: ranks 0-7: dp0:s0 tiles 0-3, dp1:s0 tiles 0-3" in text and "halo 0 B" in text
    big = nowdl.Plan.load(ROOT / "experiments" / "unet_16384_64gpu_h100.json")
    assert big.stages[0].parts == 16 and big.topology["nodes"] == 8
    assert "node 1: ranks 8-15: dp0:s0 tiles 8-15" in format_node_map(big)  # 16 tiles fill two nodes, by rows
    # only the middle row boundary of the 4 x 4 grid crosses: 10 of the 42 neighbouring tile pairs (4 vertical, 6 diagonal)
    per_rank = big.stages[0].predicted["halo_bytes"]
    m, dp = big.config["micro_batches"], big.config["dp"]
    assert cross_node_bytes(big)["halo"] == pytest.approx(per_rank * 16 * 10 / 42 * m * dp)
