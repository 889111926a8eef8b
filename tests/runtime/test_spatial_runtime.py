"""Whole-model exactness of spatial stages: tiles across ranks train exactly what one device trains.

Each case trains 3 Adam steps with 2-6 gloo processes (one per rank of the plan) through
``nowdl.compile(...).train_step`` and compares the loss of every step and every parameter (and
BatchNorm running statistics when there is one copy of each stage) with one process running the
same micro-batches with gradient accumulation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.distributed import run_workers
from helpers.reference import train_reference
from helpers.staging import staged_worker
from torch import nn

import nowdl

STEPS = 3
LR = 1e-2


class ConvNet(nn.Module):
    """No norms: runs of conv/ReLU/pool that halo fusion can fuse, then a classifier head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.a1 = nn.ReLU()
        self.c2 = nn.Conv2d(4, 4, 3, padding=2, dilation=2)
        self.a2 = nn.ReLU()
        self.p = nn.MaxPool2d(3, 2, 1)
        self.c3 = nn.Conv2d(4, 6, 3, stride=2, padding=1)
        # a heavy head: balancing memory keeps every conv in the spatial stage
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(96, 2048), nn.ReLU(),
                                  nn.Linear(2048, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.c3(self.p(self.a2(self.c2(self.a1(self.c1(x)))))))


class FuncNet(nn.Module):
    """Functional ops inside a spatial stage: F.max_pool2d, F.interpolate (bilinear), cat, sigmoid."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.c3 = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.c1(x))
        b = self.c2(F.max_pool2d(a, 2))
        up = F.interpolate(b, scale_factor=2, mode="bilinear", align_corners=False)
        return torch.sigmoid(self.c3(torch.cat([a, up], dim=1)))


class ExportNet(nn.Module):
    """Only torch.export traces it (a branch on the shape); its graph holds ATen ops: a channel
    pad, a scale-2 nearest upsample, in-place ReLU and add_, a channel cat, BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.c2 = nn.Conv2d(6, 4, 3, padding=1)
        self.c3 = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2 == 0:
            x = x * 0.5
        a = self.act(self.bn(self.c1(x)))
        b = F.pad(self.pool(a), (0, 0, 0, 0, 1, 1))  # pads channels only
        b = self.c2(b)
        b += 1.0
        up = F.interpolate(b, scale_factor=2, mode="nearest")
        return self.c3(F.relu(torch.cat([a, up], dim=1), inplace=True))


def _make(name: str) -> nn.Module:
    """Models without a bias right before a norm (see tests/runtime/test_training.py: Adam amplifies the
    round-off of such zero-gradient biases)."""
    torch.manual_seed(0)
    if name == "monai_unet":
        from monai.networks.nets import UNet

        return UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1,
                    bias=False)
    if name == "monai_unet3d":
        from monai.networks.nets import UNet

        return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8), strides=(2,), num_res_units=0,
                    bias=False)
    if name == "resnet_bn":
        return nowdl.models.resnet(depth=8, version=1, num_classes=3, width=4, conv_bias=False)
    if name == "funcnet":
        return FuncNet()
    if name == "exportnet":
        return ExportNet()
    if name == "convnet":  # float64: fused runs recompute overlaps in another summation order, and Adam
        return ConvNet().double()  # turns float32 round-off on near-zero gradients into visible steps
    raise ValueError(name)


_SHAPES = {"funcnet": (1, 14, 18), "exportnet": (1, 12, 16), "monai_unet": (1, 16, 16), "monai_unet3d": (1, 8, 8, 8), "resnet_bn": (3, 17, 15), "convnet": (3, 15, 13)}


def _data(name: str, total: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(total, *_SHAPES[name], generator=g, dtype=torch.float64 if name == "convnet" else torch.float32)
    if name.startswith("monai") or name in ("funcnet", "exportnet"):
        return x, torch.randn(total, 2, *_SHAPES[name][1:], generator=g)
    return x, torch.randint(0, 3, (total,), generator=g)


def _loss(name: str) -> nn.Module:
    return nn.MSELoss() if name.startswith("monai") or name in ("funcnet", "exportnet") else nn.CrossEntropyLoss()


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)


def _total(cfg: dict[str, Any]) -> int:
    return int(cfg["micro_batches"] * cfg.get("dp", 1) * cfg.get("replicas", 1))


def _worker(rank: int, world: int, name: str, cfg: dict[str, Any], tiled_input: bool
            ) -> tuple[list[float], dict[str, torch.Tensor], list[tuple[int, list[int], int]]]:
    opts = {k: v for k, v in cfg.items() if not k.startswith("_")}
    cm = nowdl.compile(_make(name), gpus=world, mode="estimate", optimizer=_adam, loss_fn=_loss(name), cache=False,
                       progress=False, timeout_s=90, **opts)
    losses = []
    for step in range(STEPS):
        x, y = _data(name, _total(cfg), step)
        if tiled_input:  # every rank reads only its tile, from an array on disk
            path = f"{cfg['_dir']}/x{step}.npy"
            if rank == 0:
                np.save(path, x.numpy())
            torch.distributed.barrier()
            tiles = nowdl.TiledInput.from_array(np.load(path, mmap_mode="r"), dtype=x.dtype)
            losses.append(cm.train_step(tiles, y))
        else:
            losses.append(cm.train_step(x, y))
    plan = cm._trainer.plan
    assert plan is not None
    return losses, cm.state_dict(), [(s.parts, s.grid, len(s.fused)) for s in plan.stages]


def _reference(name: str, total: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _make(name)
    return train_reference(model, _adam(model.parameters()), _loss(name), lambda step: _data(name, total, step), total,
                           STEPS)


def _compare(name: str, world: int, cfg: dict[str, Any], *, tiled_input: bool = False, staged: bool = False
             ) -> list[tuple[int, list[int], int]]:
    """Train on ``world`` ranks (``staged``: every exchange through host staging) against one process."""
    results = run_workers(staged_worker(_worker) if staged else _worker, world, name, cfg, tiled_input, timeout_s=300)
    ref_losses, ref_sd = _reference(name, _total(cfg))
    losses, sd, layout = results[0]
    for r, res in enumerate(results):
        assert res[0] == losses, f"rank {r} reports another loss"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    one_copy = cfg.get("dp", 1) == 1 and cfg.get("replicas", 1) == 1
    assert set(sd) == set(ref_sd)
    for k, ref in ref_sd.items():
        if not ref.is_floating_point() or (not one_copy and "running" in k):
            continue
        torch.testing.assert_close(sd[k], ref, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert any(p > 1 for p, _, _ in layout), f"the plan has no spatial stage: {layout}"
    return layout


def test_resnet_spatial_stem_then_pipeline_uneven_tiles() -> None:
    """A 17x15 image cut 2x1 (uneven tiles: 9 + 8 rows), BatchNorm statistics over both tiles; host
    staged (halos, statistics, the tiles' weight gradients, tiles to a plain stage)."""
    layout = _compare("resnet_bn", 3, {"stages": 2, "spatial_parts": 2, "spatial_stages": 1, "slice": "horizontal",
                                       "micro_batches": 2, "dp": 1, "replicas": 1, "schedule": "1f1b"}, staged=True)
    assert [(p, g) for p, g, _ in layout] == [(2, [2, 1]), (1, [])]


def test_monai_unet_spatial_encoder_and_decoder_with_tiled_skips() -> None:
    """Encoder and mirrored decoder spatial (2 tiles each), the bottom a pipeline stage."""
    layout = _compare("monai_unet", 5, {"stages": 3, "spatial_parts": 2, "spatial_stages": 1, "slice": "vertical",
                                        "micro_batches": 2, "dp": 1, "replicas": 1, "schedule": "1f1b"})
    assert [p for p, _, _ in layout] == [2, 1, 2]


def test_monai_unet_fully_spatial_square() -> None:
    """The whole UNet on 2x2 tiles; the loss is computed on the gathered output; host staged."""
    layout = _compare("monai_unet", 4, {"stages": 1, "spatial_parts": 4, "slice": "square", "micro_batches": 2,
                                        "dp": 1, "replicas": 1, "schedule": "gpipe"}, staged=True)
    assert [(p, g) for p, g, _ in layout] == [(4, [2, 2])]


def test_spatial_with_master() -> None:
    _compare("resnet_bn", 4, {"stages": 2, "spatial_parts": 2, "spatial_stages": 1, "slice": "vertical",
                              "micro_batches": 2, "dp": 1, "replicas": 2, "schedule": "1f1b"})


def test_halo_fusion_forced_through_the_engine_and_tiled_input(tmp_path: Any) -> None:
    """Forced fusion (the seeds' --fused-layers) of conv-relu-conv-relu-pool-conv, fed from disk tiles."""
    layout = _compare("convnet", 3, {"stages": 2, "spatial_parts": 2, "spatial_stages": 1, "slice": "square",
                                     "micro_batches": 2, "dp": 1, "replicas": 1, "schedule": "1f1b",
                                     "halo_fusion": 4, "_dir": str(tmp_path)}, tiled_input=True)
    assert layout[0][2] >= 1, f"no fused chain in the spatial stage: {layout}"


def test_functional_pool_interpolate_and_cat_on_square_tiles() -> None:
    _compare("funcnet", 4, {"stages": 1, "spatial_parts": 4, "slice": "square", "micro_batches": 2, "dp": 1,
                            "replicas": 1, "schedule": "gpipe"})


def test_exported_graph_with_aten_ops_on_square_tiles() -> None:
    """A model only torch.export traces runs wholly on 2x2 tiles: its ATen pad, upsample, cat and
    pointwise ops, the lifted conv/BN/pool modules, BN statistics over all tiles."""
    from nowdl.trace.tracer import trace

    assert trace(ExportNet(), (torch.randn(2, *_SHAPES["exportnet"]),)).tracer == "export"
    layout = _compare("exportnet", 4, {"stages": 1, "spatial_parts": 4, "slice": "square", "micro_batches": 2,
                                       "dp": 1, "replicas": 1, "schedule": "gpipe"})
    assert [(p, g) for p, g, _ in layout] == [(4, [2, 2])]


def test_3d_volume_depth_slices() -> None:
    _compare("monai_unet3d", 2, {"stages": 1, "spatial_parts": 2, "slice": "depth", "micro_batches": 1, "dp": 1,
                                 "replicas": 1, "schedule": "gpipe"})


@pytest.mark.slow
def test_spatial_times_data_parallel() -> None:
    _compare("resnet_bn", 6, {"stages": 2, "spatial_parts": 2, "spatial_stages": 1, "slice": "square",
                              "micro_batches": 2, "dp": 2, "replicas": 1, "schedule": "1f1b"})


@pytest.mark.slow
def test_different_parts_for_successive_spatial_stages() -> None:
    """Stage 0 on 3 tiles, stage 1 on 2 (tiles re-cut between them), then a plain stage."""
    layout = _compare("resnet_bn", 6, {"stages": 3, "spatial_parts": [3, 2], "slice": "vertical", "micro_batches": 2,
                                       "dp": 1, "replicas": 1, "schedule": "1f1b"})
    assert [p for p, _, _ in layout] == [3, 2, 1]


# ---- planning and set-up errors (no processes) -------------------------------------------------


def test_planner_names_the_op_that_ends_a_spatial_region() -> None:
    model = nowdl.models.resnet(depth=8, version=1, num_classes=3, width=4, conv_bias=False)
    cm = nowdl.compile(model, gpus=2, stages=1, spatial_parts=2, dp=1, replicas=1, mode="estimate", cache=False,
                       progress=False)
    with pytest.raises(nowdl.NowdlError, match=r"Node 'pool' ends the spatial region: AdaptiveAvgPool2d needs the whole"):
        cm.plan(torch.empty(1, 3, 32, 32, device="meta"))


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"spatial_parts": [1, 2]}, "parts \\(>= 2\\) of each spatial stage"),
    ({"spatial_parts": [2, 2, 2], "spatial_stages": 2}, "names 3 spatial stages but spatial_stages is 2"),
    ({"spatial_parts": "4"}, "spatial_parts must be an int or a list"),
    ({"halo_fusion": "always"}, "halo_fusion must be 'auto', 'off' or an integer"),
    ({"halo_fusion": 1}, "halo_fusion must be"),
])
def test_bad_spatial_arguments(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(nowdl.NowdlError, match=needle):
        nowdl.compile(_make("convnet"), gpus=8, **kwargs)


def _convnet_plan(**kw: Any) -> tuple[Any, Any]:
    x = torch.empty(1, *_SHAPES["convnet"], dtype=torch.float64, device="meta")
    cm = nowdl.compile(_make("convnet"), gpus=3, stages=2, spatial_parts=2, spatial_stages=1, slice="square",
                       micro_batches=2, dp=1, replicas=1, mode="estimate", cache=False, progress=False, **kw)
    return cm.plan(x), cm.trace(x).gm


def test_halo_fusion_policies_in_the_plan() -> None:
    forced, _ = _convnet_plan(halo_fusion=2)
    assert forced.stages[0].fused == [["c1", "a1", "c2", "a2"], ["p", "c3"]]
    assert forced.config["halo_fusion"] == 2
    whole, _ = _convnet_plan(halo_fusion=4)
    assert whole.stages[0].fused == [["c1", "a1", "c2", "a2", "p", "c3"]]
    off, _ = _convnet_plan(halo_fusion="off")
    assert all(not s.fused for s in off.stages)
    # auto: fused only where the cost model says so; on these tiny tiles the exchange latency dominates
    auto, _ = _convnet_plan()
    assert auto.stages[0].fused, "tiny tiles: one exchange instead of four should pay off"
    assert nowdl.Plan.from_json(forced.to_json()).stages[0].fused == forced.stages[0].fused


def test_tiled_stage_refuses_untileable_nodes_and_bad_chains() -> None:
    from nowdl.codegen import build_stages
    from nowdl.runtime.spatial.stage import TiledStage

    plan, gm = _convnet_plan(halo_fusion="off")
    stages = build_stages(gm, plan)
    with pytest.raises(nowdl.NowdlError, match=r"stage 1 is spatial but node\(s\) 'head_0' \(AdaptiveAvgPool2d needs"):
        TiledStage(stages[1], [1, 2], [0, 1], 0, None)
    with pytest.raises(nowdl.NowdlError, match="must feed only"):
        TiledStage(stages[0], [1, 2], [0, 1], 0, None, fused=[["c1", "c2"]])
    with pytest.raises(nowdl.NowdlError, match="names nodes that are not in the stage"):
        TiledStage(stages[0], [1, 2], [0, 1], 0, None, fused=[["c1", "nope"]])


def test_tiled_input_reads_only_the_asked_region() -> None:
    full = torch.arange(2 * 3 * 5 * 4, dtype=torch.float32).reshape(2, 3, 5, 4)
    seen: list[tuple[slice, ...]] = []

    def read(idx: tuple[slice, ...]) -> torch.Tensor:
        seen.append(idx)
        return full[idx]

    ti = nowdl.TiledInput(full.shape, read)
    assert ti.meta().shape == full.shape and ti.meta().device.type == "meta"
    second = ti.rows(1, 2)
    assert torch.equal(second.read([(1, 4), (2, 4)]), full[1:2, :, 1:4, 2:4])
    assert seen[-1] == (slice(1, 2), slice(None), slice(1, 4), slice(2, 4))
    assert torch.equal(nowdl.TiledInput.from_array(full.numpy()).read(), full)
    with pytest.raises(ValueError, match="returned shape"):
        nowdl.TiledInput(full.shape, lambda idx: full).read([(0, 2), (0, 2)])
