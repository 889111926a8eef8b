"""Statistics passes: whole-image norms and poolings of an image streamed in windows equal the
whole-image forward ([Note: statistics passes]); the ops no pass can fix are named, alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.distributed import run_workers
from helpers.norm_nets import norm_net, stream_worker
from helpers.predict_models import reference

import nowdl
from nowdl.partitioner.costs.inference import node_forward_s
from nowdl.plan.purpose import format_whole_image_ops
from nowdl.profiler import get_device_spec
from nowdl.runtime.predict.runner import plan_for
from nowdl.runtime.spatial.statistics.accumulate import Statistics, StatOp

zarr = pytest.importorskip("zarr")


def _chunks(x: torch.Tensor, cuts: tuple[list[int], list[int]]) -> list[tuple[torch.Tensor, tuple[int, int]]]:
    """``x`` cut at ``cuts`` (row and column borders) into chunks, with their starts."""
    rows, cols = cuts
    return [(x[:, :, r0:r1, c0:c1], (r0, c0)) for r0, r1 in zip(rows, rows[1:], strict=False)
            for c0, c1 in zip(cols, cols[1:], strict=False)]


@pytest.mark.parametrize("reduce,shape", [("instance", (2, 6)), ("group", (2, 3)), ("batch", (6,))])
def test_chunked_moments_equal_the_whole_tensors(reduce: str, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 13, 10, generator=g) * 3 + 1000  # a large mean: shifted sums keep the variance
    op = StatOp("n", 1, reduce, shape, (13, 10))
    st = Statistics()
    for chunk, start in _chunks(x, ([0, 4, 5, 13], [0, 7, 10])):
        st.add(op, chunk, start, (13, 10))
    st.finish([op], {}, torch.device("cpu"))
    mean, var = st.held["n"]
    xd = x.double()
    want = {"instance": xd.reshape(2, 6, -1), "group": xd.reshape(2, 3, -1),
            "batch": xd.transpose(0, 1).reshape(6, -1)}[reduce]
    torch.testing.assert_close(mean, want.mean(-1), rtol=0, atol=1e-9)
    torch.testing.assert_close(var, want.var(-1, unbiased=False), rtol=1e-7, atol=0)
    y = st.apply_norm(op, x, torch.linspace(0.5, 1.5, 6), torch.linspace(-1, 1, 6), 1e-5)
    # x * scale + shift in float32, as ATen's CPU norms: about one rounding of x's 1000 (6e-5) off
    ref = {"instance": lambda: F.instance_norm(xd, weight=torch.linspace(0.5, 1.5, 6).double(),
                                               bias=torch.linspace(-1, 1, 6).double(), eps=1e-5),
           "group": lambda: F.group_norm(xd, 3, torch.linspace(0.5, 1.5, 6).double(), torch.linspace(-1, 1, 6).double()),
           "batch": lambda: F.batch_norm(xd, None, None, torch.linspace(0.5, 1.5, 6).double(),
                                         torch.linspace(-1, 1, 6).double(), training=True)}[reduce]()
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("how,bins", [("avg", (3, 4)), ("avg", (1, 1)), ("max", (3, 2))])
def test_chunked_pools_equal_adaptive_pooling(how: str, bins: tuple[int, int]) -> None:
    x = torch.randn(1, 3, 13, 10, generator=torch.Generator().manual_seed(1))
    op = StatOp("p", 1, how, (1, 3, *bins), (13, 10))
    st = Statistics()
    for chunk, start in _chunks(x, ([0, 6, 13], [0, 3, 4, 10])):
        st.add(op, chunk, start, (13, 10))
    st.finish([op], {"p": (13, 10)}, torch.device("cpu"))
    pool = F.adaptive_avg_pool2d if how == "avg" else F.adaptive_max_pool2d
    torch.testing.assert_close(st.pooled(op, x), pool(x, bins), rtol=0, atol=1e-6)


def _source(d: Path, shape: tuple[int, ...]) -> tuple[str, np.ndarray]:
    img = np.random.default_rng(3).random(shape).astype(np.float32)
    zarr.save_array(str(d / "in.zarr"), img)
    return f"zarr:{d / 'in.zarr'}", img


@pytest.mark.parametrize("name,passes,named", [
    ("group", 2, ""),  # two GroupNorms in a chain
    ("se", 2, ""),  # a squeeze-and-excitation gate and a 3x2 average pooling, then an InstanceNorm
    ("se-max", 2, ""),  # the 3x2 pooling a maximum
    ("fbn", 0, ""),  # F.batch_norm in eval: a per-channel affine map
    ("aligned", 1, "whole-image op (1: up)"),  # align_corners=True: computed over each window, named alone
])
def test_one_process_streams_exactly(tmp_path: Path, name: str, passes: int, named: str) -> None:
    src, img = _source(tmp_path, (1, 64, 96))
    (line, got), = stream_worker(0, 1, [name], src, str(tmp_path), {}, (32, 48))
    assert "9 window(s)" in line and (f"{passes} statistics pass(es)" in line) == (passes > 0)
    diff = np.abs(got - reference(norm_net(name), img)).max()
    if named:
        assert f"NOT exact: computed over each window for {named};" in line and diff > 1e-3
        assert "n1" not in line.split(";")[0]  # the GroupNorm is gathered exactly: not named
    else:
        assert "exact (margin" in line and "NOT" not in line and diff <= 1e-5


def test_a_one_window_image_after_a_streamed_one_uses_its_own_statistics(tmp_path: Path) -> None:
    """The same window engine: the statistics of the streamed image must not stay on."""
    net = norm_net("group")
    cm = nowdl.compile(net, gpus=1, progress=False, cache=False)
    for k, shape in enumerate([(1, 64, 48), (1, 32, 48)]):  # 3 windows of 32x48, then one
        (tmp_path / str(k)).mkdir()
        src, img = _source(tmp_path / str(k), shape)
        summary = cm.predict(src, tmp_path / f"{k}.zarr", window=(32, 48))
        assert summary.windows == (3 if k == 0 else 1) and summary.passes == (2 if k == 0 else 0)
        got = np.asarray(zarr.open_array(str(tmp_path / f"{k}.zarr" / "0"))[:])
        np.testing.assert_allclose(got, reference(net, img), atol=1e-5, rtol=0)


def test_the_inference_plan_records_passes_and_their_cost() -> None:
    cm = nowdl.compile(norm_net("se"), gpus=1, mode="estimate", cache=False, progress=False)
    plan = cm.plan(torch.empty((1, 1, 64, 64), device="meta"), train=False)
    rec = plan.config["statistics_passes"]
    assert rec["passes"] == 2 and len(rec["prefix"]) == 2 and 0 < rec["prefix"][0] < rec["prefix"][1] <= 1
    assert rec["seconds_per_window"] == pytest.approx(sum(rec["prefix"]) * plan.predicted["step_s"], rel=1e-3)
    assert [o["pass"] for o in plan.config["whole_image_ops"]] == [1, 1, 2]
    assert "2 statistics pass(es) before the writing pass" in format_whole_image_ops(plan)


def test_pass_cost_counts_the_tiled_runtime_per_op() -> None:
    """On 2 tiles with the spec's ``tile_op_s`` ([Note: tiled runtime overhead]): each node's
    forward is its profiled time over 2 plus its kind's overhead, the stage's forward their sum,
    and pass k's prefix the share of the nodes it runs (GroupNet: c1, n1; then up to n2)."""
    spec = dataclasses.replace(get_device_spec("cpu"), tile_op_s={"conv": 1e-3, "norm": 2e-3})
    x = torch.empty((1, 1, 64, 64), device="meta")
    cm = nowdl.compile(norm_net("group"), gpus=2, stages=1, spatial_parts=2, slice="vertical", micro_batches=1,
                       replicas=1, dp=1, mode="estimate", device_spec=spec, cache=False, progress=False)
    plan = cm.plan(x, train=False, single=True)
    prof = cm.profile(x)
    t = node_forward_s(plan, cm.trace(x).gm, prof, spec.tile_op_s)
    fwd = {n.name: n.fwd_s / 2 for n in prof.nodes}
    extra = {"c1": 1e-3, "c2": 1e-3, "c3": 1e-3, "n1": 2e-3, "n2": 2e-3}  # max_pool2d, interpolate: none set
    assert t == pytest.approx({n: v + extra.get(n, 0.0) for n, v in fwd.items()}, rel=1e-12, abs=1e-15)
    assert plan.stages[0].predicted["fwd_s"] == pytest.approx(sum(t.values()), rel=1e-9)
    rec = plan.config["statistics_passes"]
    assert rec["forward_s"] == pytest.approx(plan.predicted["step_s"], rel=1e-12)
    total = sum(t.values())
    first = (t["c1"] + t["n1"]) / total
    second = sum(t[n] for n in ("c1", "n1", "relu", "max_pool2d", "c2", "n2")) / total
    assert rec["prefix"] == pytest.approx([first, second], abs=6e-5)  # rounded to 4 places
    assert rec["seconds_per_window"] == pytest.approx(rec["forward_s"] * (first + second), rel=1e-3)


def _check_ranks(tmp_path: Path, world: int, names: list[str], slice_: str) -> None:
    pytest.importorskip("monai")
    src, img = _source(tmp_path, (1, 128, 192))
    pins = {"stages": 1, "spatial_parts": world, "slice": slice_, "micro_batches": 1, "replicas": 1, "dp": 1}
    got = run_workers(stream_worker, world, names, src, str(tmp_path), pins, (64, 96), timeout_s=600)[0]
    for name, (line, out) in zip(names, got, strict=True):
        assert "exact (margin" in line and "NOT" not in line and "statistics pass(es)" in line, line
        assert int(line.split(" window(s)")[0].rsplit(" ", 1)[1]) >= 6
        np.testing.assert_allclose(out, reference(norm_net(name), img), atol=1e-4, rtol=0)


def test_two_ranks_stream_a_monai_unet_and_a_squeeze_excite_net_exactly(tmp_path: Path) -> None:
    _check_ranks(tmp_path, 2, ["monai", "se"], "vertical")


def _sequential_worker(rank: int, world: int, source: str, out: str, pins: dict[str, Any]
                       ) -> tuple[str, list[int], np.ndarray | None]:
    cm = nowdl.compile(norm_net("monai"), gpus=world, progress=False, cache=False, tiles_per_gpu=2, **pins)
    line = cm.predict(source, f"{out}/monai.zarr", window=(64, 96)).line()
    plan = plan_for(cm, torch.empty((1, 1, 64, 96), device="meta"))
    got = np.asarray(zarr.open_array(f"{out}/monai.zarr/0")[:]) if rank == 0 else None
    return line, [st.tiles_per_gpu for st in plan.stages], got


@pytest.mark.parametrize("world", [1, 2])
def test_sequential_tiles_stream_exactly(tmp_path: Path, world: int) -> None:
    """An inference plan whose spatial stage runs 2 sub-tiles per rank: the statistics passes reach
    its InstanceNorms ([Note: sequential tiles in statistics passes]), the output is the
    whole-image forward's and the summary says exact."""
    pytest.importorskip("monai")
    src, img = _source(tmp_path, (1, 128, 192))
    pins = {} if world == 1 else {"stages": 1, "spatial_parts": 2, "slice": "vertical", "micro_batches": 1,
                                  "replicas": 1, "dp": 1}
    line, tiles, got = run_workers(_sequential_worker, world, src, str(tmp_path), pins, timeout_s=600)[0]
    assert tiles == [2]
    assert "exact (margin" in line and "NOT" not in line and "6 statistics pass(es)" in line, line
    np.testing.assert_allclose(got, reference(norm_net("monai"), img), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_four_ranks_stream_a_monai_unet_exactly(tmp_path: Path) -> None:
    _check_ranks(tmp_path, 4, ["monai", "group"], "square")
