"""Sequential tiles: T sub-tiles per rank, one after another, train exactly what one process trains.

Plans are made by hand: the planner's plan for the same request, with ``tiles_per_gpu`` set on
the stages in the plan JSON. Every case runs 2 Adam steps in float64 and compares the losses and
every parameter with one process running the same micro-batches (1e-9); parameters after Adam
steps depend on every weight gradient, so this checks the backward as well as the forward.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed import run_workers
from helpers.norm_nets import NormNet
from torch import nn

import nowdl
from nowdl.runtime.spatial.sequential import sub_grid
from nowdl.runtime.training.metrics import peak_of

STEPS = 2
NORMS = ("bn", "in", "gn")  # 3 Adam steps: the running statistics of step 1 feed nothing before step 3


def _steps(name: str) -> int:
    return 3 if name in NORMS else STEPS


class Stack(nn.Module):
    """Convs (stride 1, stride 2, dilated), max and average pools, bilinear and nearest upsampling,
    a transposed conv and channel concatenation: the ops a spatial stage may hold."""

    def __init__(self, dims: int) -> None:
        super().__init__()
        conv, convt = (nn.Conv2d, nn.ConvTranspose2d) if dims == 2 else (nn.Conv3d, nn.ConvTranspose3d)
        mp, ap = (nn.MaxPool2d, nn.AvgPool2d) if dims == 2 else (nn.MaxPool3d, nn.AvgPool3d)
        self.c1 = conv(1, 3, 3, padding=1)
        self.c2 = conv(3, 3, 3, padding=2, dilation=2)
        self.p1 = mp(2)
        self.c3 = conv(3, 4, 3, stride=2, padding=1)
        self.p2 = ap(3, 1, 1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear" if dims == 2 else "trilinear")
        self.ct = convt(4, 3, 2, stride=2)
        self.up2 = nn.Upsample(scale_factor=2, mode="nearest")
        self.head = conv(10, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.c2(torch.relu(self.c1(x))))
        b = self.p2(torch.relu(self.c3(self.p1(a))))  # 1/4 of the image
        u = self.up(self.ct(b))  # 1/4 -> 1/2 -> 1
        return self.head(torch.cat([a, u, self.up2(self.up2(b))], dim=1))


class WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(1, 2, 3, padding=1)
        self.bn = nn.BatchNorm2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.c(x))


def _make(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    torch.manual_seed(0)
    if name in ("bn", "in", "gn"):
        return NormNet(name).double(), (1, 24, 20)
    if name == "stack2d":
        return Stack(2).double(), (1, 64, 20)
    if name == "stack3d":
        return Stack(3).double(), (1, 64, 12, 12)
    if name == "unet":
        return nowdl.models.unet(1, 2, depth=2, base_width=4).double(), (1, 96, 32)
    if name == "unet32":
        return nowdl.models.unet(1, 2, depth=2, base_width=4), (1, 96, 32)
    if name == "unet3d":
        return nowdl.models.unet3d(1, 2, depth=1, base_width=4, norm=False).double(), (1, 32, 8, 8)
    if name == "norm":
        return WithNorm().double(), (1, 32, 16)
    if name == "inplace":  # norms followed by in-place ReLUs: the layer-wise backward's leaves stay untouched
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(inplace=True),
                             nn.Conv2d(4, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(inplace=True),
                             nn.Conv2d(4, 2, 1)).double(), (1, 24, 20)
    raise ValueError(name)


def _data(name: str, step: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = _make(name)[1]
    g = torch.Generator().manual_seed(10 + step)
    dt = torch.float32 if name.endswith("32") else torch.float64
    total *= 2 if name == "bn" else 1  # BatchNorm: 2 samples per micro-batch
    x = torch.randn(total, *shape, generator=g, dtype=dt)
    return x, torch.randn(total, 2, *shape[1:], generator=g, dtype=dt)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def _plan(name: str, path: Path, gpus: int, cfg: dict[str, Any], tiles: dict[int, int], schedule: str = "") -> None:
    """The planner's plan for ``cfg`` with ``tiles_per_gpu`` (and ``norm_schedule``, if given) set by
    hand, saved at ``path``."""
    model, _ = _make(name)
    cm = nowdl.compile(model, gpus=gpus, mode="estimate", optimizer=_adam, loss_fn=nn.MSELoss(), cache=False,
                       progress=False, **cfg)
    x, y = _data(name, 0, 1)  # one micro-batch of one sample
    d = json.loads(cm.plan(x, target=y).to_json())
    for s, t in tiles.items():
        d["stages"][s]["tiles_per_gpu"] = t
        if schedule:
            d["stages"][s]["norm_schedule"] = schedule
    path.write_text(json.dumps(d))


def _train(name: str, path: str, total: int) -> tuple[list[float], dict[str, torch.Tensor], list[int]]:
    cm = nowdl.compile(_make(name)[0], plan=path, mode="estimate", optimizer=_adam, loss_fn=nn.MSELoss(), cache=False,
                       progress=False, timeout_s=120)
    losses = [cm.train_step(*_data(name, step, total)) for step in range(_steps(name))]
    eng = cm._trainer.engine
    seq = [s for (_, s), t in eng.tiled.items() if t.sequential is not None and _windowed(t.sequential)
           and (t.sequential.host_meter[1] > 0) == (t.sequential.norm_schedule == "layerwise")]  # the schedule ran
    return losses, cm.state_dict(), seq


def _windowed(seq: Any) -> bool:
    """Whether some sub-tile's window is smaller than its rank's window (else the case shows nothing)."""
    return any(any((sl.stop - sl.start) < size for sl, size in zip(sub.ins[0][2:], full, strict=True))
               for lay in seq._layouts.values() for sub in lay.subs
               for full in [[b - a for a, b in lay.in_windows[0][seq.ranks.index(seq.rank)]]])


def _worker(rank: int, world: int, name: str, path: str, total: int) -> tuple[list[float], dict[str, torch.Tensor],
                                                                              list[int]]:
    return _train(name, path, total)


def _reference(name: str, total: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    from helpers.reference import train_reference

    model = _make(name)[0]
    return train_reference(model, _adam(model.parameters()), nn.MSELoss(), lambda step: _data(name, step, total),
                           total, _steps(name))


def _check(got: tuple[list[float], dict[str, torch.Tensor], list[int]], name: str, total: int) -> None:
    losses, sd, seq = got
    assert seq, "no stage ran sequential tiles on sub-windows smaller than its rank's window"
    ref_losses, ref_sd = _reference(name, total)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-9, atol=1e-12)
    for k, v in ref_sd.items():
        torch.testing.assert_close(sd[k], v, rtol=1e-9, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")


ONE = {"stages": 1, "spatial_parts": 1, "micro_batches": 1, "dp": 1, "replicas": 1}


@pytest.mark.parametrize("tiles", [2, 4])
@pytest.mark.parametrize("name", ["stack2d", "stack3d", "unet", "unet3d"])
def test_sequential_tiles_on_one_rank_are_exact(name: str, tiles: int, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    _plan(name, path, 1, ONE, {0: tiles})
    _check(_train(name, str(path), 1), name, 1)


@pytest.mark.parametrize(("name", "slice_", "tiles"), [("stack2d", "horizontal", 2), ("unet", "horizontal", 4),
                                                       ("stack3d", "depth", 4), ("unet3d", "depth", 2)])
def test_sequential_tiles_on_two_ranks_are_exact(name: str, slice_: str, tiles: int, tmp_path: Path) -> None:
    """Each rank's tile cut again into T sub-tiles; the margins cross ranks by one deep halo exchange."""
    path = tmp_path / "plan.json"
    _plan(name, path, 2, {**ONE, "spatial_parts": 2, "slice": slice_, "micro_batches": 2, "schedule": "gpipe"},
          {0: tiles})
    results = run_workers(_worker, 2, name, str(path), 2, timeout_s=300)
    assert results[0][0] == results[1][0]
    _check(results[0], name, 2)


def test_sequential_tiles_in_a_pipeline_with_multi_resolution_inputs(tmp_path: Path) -> None:
    """UNet in 3 pipeline stages, the first and last (the decoder, fed skips at 3 resolutions) on
    sequential tiles: input gradients cross the pipeline."""
    path = tmp_path / "plan.json"
    _plan("unet", path, 3, {**ONE, "stages": 3, "micro_batches": 2, "schedule": "1f1b"}, {0: 2, 2: 4})
    results = run_workers(_worker, 3, "unet", str(path), 2, timeout_s=300)
    assert sorted({s for r in results for s in r[2]}) == [0, 2]
    _check((results[0][0], {k: v for r in results for k, v in r[1].items()}, results[0][2] or [0]), "unet", 2)


@pytest.mark.parametrize(("name", "tiles", "schedule"), [("bn", 4, "passes"), ("in", 4, "passes"), ("gn", 4, "passes"),
                                                      ("in", 9, "passes"), ("bn", 4, "layerwise"),
                                                      ("in", 4, "layerwise"), ("gn", 4, "layerwise"),
                                                      ("inplace", 4, "layerwise")])
def test_sequential_tiles_with_norms_on_one_rank_are_exact(name: str, tiles: int, schedule: str,
                                                           tmp_path: Path) -> None:
    """BatchNorm (2 samples per micro-batch), InstanceNorm (running statistics tracked) and
    GroupNorm normalise every sub-tile with the whole image's statistics, gathered by statistics
    passes or layer-wise ([Note: layer-wise norms]): 3 Adam steps equal one process, every
    parameter and buffer (running statistics, batches tracked) to 1e-9."""
    path = tmp_path / "plan.json"
    _plan(name, path, 1, ONE, {0: tiles}, schedule)
    _check(_train(name, str(path), 1), name, 1)


@pytest.mark.parametrize("schedule", ["passes", "layerwise"])
@pytest.mark.parametrize("name", NORMS)
def test_sequential_tiles_with_norms_on_two_ranks_are_exact(name: str, schedule: str, tmp_path: Path) -> None:
    """2 ranks, 2 sub-tiles each, 2 micro-batches in flight (GPipe): statistics and gradient means
    combine over the sub-tiles and the tile group."""
    path = tmp_path / "plan.json"
    _plan(name, path, 2, {**ONE, "spatial_parts": 2, "slice": "horizontal", "micro_batches": 2, "schedule": "gpipe"},
          {0: 2}, schedule)
    results = run_workers(_worker, 2, name, str(path), 2, timeout_s=300)
    assert results[0][0] == results[1][0]
    _check(results[0], name, 2)


def test_sub_grid_layout() -> None:
    assert sub_grid((1, 1), (64, 64), 4) == (2, 2)  # one rank: along every spatial dim
    assert sub_grid((1, 1), (64, 20), 4) == (4, 1)
    assert sub_grid((2, 2), (64, 64), 4) == (2, 2)
    assert sub_grid((1, 2), (64, 64), 4) == (1, 4)
    assert sub_grid((1, 2), (64, 256), 6) == (1, 6)
    assert sub_grid((2, 1, 1), (32, 8, 8), 2) == (2, 1, 1)
    assert sub_grid((1, 1, 1), (32, 8, 8), 8) == (8, 1, 1)


def _bf16_worker(rank: int, world: int, path: str) -> list[float]:
    cm = nowdl.compile(_make("unet32")[0], plan=path, mode="estimate", optimizer=_adam, loss_fn=nn.MSELoss(), cache=False,
                       progress=False, timeout_s=120, precision="bf16")
    return [cm.train_step(*_data("unet32", step, 2)) for step in range(STEPS)]


def test_sequential_tiles_under_bf16_autocast(tmp_path: Path) -> None:
    """bf16 composes with sequential tiles on 2 ranks: losses within 2e-2 (relative) of one process
    under the same autocast (see tests/runtime/spatial/test_spatial_precision.py for the tolerance)."""
    path = tmp_path / "plan.json"
    _plan("unet32", path, 2, {**ONE, "spatial_parts": 2, "slice": "horizontal", "micro_batches": 2,
                              "schedule": "gpipe"}, {0: 2})
    losses = run_workers(_bf16_worker, 2, str(path), timeout_s=300)[0]
    model = _make("unet32")[0]
    opt = _adam(model.parameters())
    ref = []
    for step in range(STEPS):
        x, y = _data("unet32", step, 2)
        opt.zero_grad()
        acc = 0.0
        for xc, yc in zip(x.chunk(2), y.chunk(2), strict=True):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pred = model(xc)
            loss = nn.MSELoss()(pred.float(), yc)
            (loss / 2).backward()
            acc += float(loss.detach())
        opt.step()
        ref.append(acc / 2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=2e-2, atol=0.0)


@pytest.mark.parametrize("tiles", [2, 4])
def test_sequential_tiles_inference_runs_forward_only(tiles: int) -> None:
    """An inference plan whose stage runs ``tiles`` sub-tiles per GPU (one process, float64):
    ``eval_step`` equals the plain model's forward (1e-9), and its measured peak (static bytes +
    the aten tracker's peak + the input) stays under the plan's prediction and below the
    one-tile plan's, as the plan predicts."""
    torch.manual_seed(0)
    model = nowdl.models.unet(3, 2, depth=2, base_width=8).double().eval()
    x = torch.randn(1, 3, 256, 256, dtype=torch.float64)
    with torch.no_grad():
        ref = model(x)
    peaks = []
    for t in (1, tiles):
        cm = nowdl.compile(nowdl.models.unet(3, 2, depth=2, base_width=8).double(), gpus=1, mode="estimate",
                           cache=False, progress=False, tiles_per_gpu=t)
        cm.load_state_dict(model.state_dict())
        out = cm.eval_step(x)
        torch.testing.assert_close(out, ref, rtol=0.0, atol=1e-9)
        runner = cm._train().evaluator().last
        assert runner.plan.config["inference"] and [s.tiles_per_gpu for s in runner.plan.stages] == [t]
        eng = runner.engine
        assert [tl.sequential is not None for tl in eng.tiled.values()] == ([True] if t > 1 else [])
        _, peak = peak_of(lambda cm=cm: cm.eval_step(x), [eng.stages[s].module for _, s in eng.held], None)
        measured, predicted = peak + x.numel() * x.element_size(), runner.plan.ranks[0].predicted_peak_bytes
        assert 0.7 * predicted <= measured <= predicted * 1.001
        peaks.append(measured)
    assert peaks[1] < 0.8 * peaks[0]


def test_sequential_tiles_with_norms_peak_memory_matches_the_plan() -> None:
    """A GroupNorm net at 128² trained with 1 and 4 sub-tiles: the measured peak (static bytes + the
    aten tracker's peak) is within ±10% of the plan's, and 4 sub-tiles hold less than 1 (one
    sub-tile's recomputed graph lives at a time through the statistics passes)."""
    x, y = torch.randn(1, 1, 128, 128), torch.randn(1, 2, 128, 128)
    peaks = []
    for t in (1, 4):
        torch.manual_seed(0)
        cm = nowdl.compile(NormNet("gn"), gpus=1, mode="estimate", device_spec="cpu", optimizer=_adam,
                           loss_fn=nn.MSELoss(), cache=False, progress=False, **ONE, tiles_per_gpu=t)
        cm.train_step(x, y)
        eng = cm._trainer.engine
        assert [tl.sequential is not None for tl in eng.tiled.values()] == ([True] if t > 1 else [])
        _, peak = peak_of(lambda cm=cm: cm.train_step(x, y), [eng.stages[s].module for _, s in eng.held],
                          eng.optimizer)
        predicted = cm._trainer.plan.ranks[0].predicted_peak_bytes
        assert 0.9 * predicted <= peak <= 1.1 * predicted, (t, peak, predicted)
        peaks.append(peak)
    assert peaks[1] < 0.8 * peaks[0]


def test_sequential_tiles_with_norms_under_bf16_against_the_same_plan_without() -> None:
    """BatchNorm under bf16 autocast on 1 rank: 4 sub-tiles (float64 statistics; xhat and the
    gradient terms in float32) against the same plan with 1, both autocast, zero targets (the loss
    is the output's square): losses within 2e-3 (relative) and every parameter and buffer within
    5e-3 after 2 Adam steps (measured: 1.4e-4 and 1.3e-3; statistics 3% off give 3% and 3e-2)."""
    got = []
    for t in (1, 4):
        torch.manual_seed(0)
        cm = nowdl.compile(NormNet("bn"), gpus=1, mode="estimate", optimizer=_adam, loss_fn=nn.MSELoss(), cache=False,
                           progress=False, precision="bf16", **ONE, tiles_per_gpu=t)
        gen = torch.Generator().manual_seed(1)
        data = [(torch.randn(2, 1, 64, 64, generator=gen), torch.zeros(2, 2, 64, 64)) for _ in range(STEPS)]
        losses = [cm.train_step(x, y) for x, y in data]
        seq = [tl.sequential for tl in cm._trainer.engine.tiled.values() if tl.sequential is not None]
        assert len(seq) == (t > 1) and all(_windowed(s) for s in seq)
        got.append((losses, cm.state_dict()))
    (l1, sd1), (l4, sd4) = got
    torch.testing.assert_close(torch.tensor(l4), torch.tensor(l1), rtol=2e-3, atol=0.0)
    for k, v in sd1.items():
        torch.testing.assert_close(sd4[k], v, rtol=0.0, atol=5e-3, msg=lambda m, k=k: f"{k}: {m}")


def test_layerwise_schedule_runs_each_node_once_and_keeps_the_pass_boundaries() -> None:
    """NormNet's norms at forward levels 1, 2, 3 ([Note: layer-wise norms]): each node runs in one
    forward pass (the norm of level k in pass k + 1); host memory keeps what a later pass reads
    (the skip ``relu`` from pass 2 until pass 3 reads it), and nothing the stage's input gives;
    the backward runs one segment per backward level."""
    import torch.fx as fx

    from nowdl.runtime.spatial.statistics import layerwise as lw
    from nowdl.runtime.spatial.statistics import seq_norms as sn

    gm = fx.symbolic_trace(NormNet("in"))
    plan = lw.layer_plan(gm, sn.norm_levels(gm, sn.seq_norm_nodes(gm)))
    assert plan.passes == 3
    runs = {k: sorted(v - {"x"}) for k, v in plan.compute.items()}
    assert runs == {1: ["c1", "n1"], 2: ["c2", "n1", "n2", "relu"], 3: ["c3", "cat", "n2", "n3", "relu_1", "up"],
                    4: ["head", "n3", "output", "relu_2"]}
    assert {k: sorted(v) for k, v in plan.store.items()} == {1: ["c1"], 2: ["c2", "relu"], 3: ["c3"]}
    assert {k: sorted(v) for k, v in plan.keep.items()} == {1: ["c1"], 2: ["c2", "relu"], 3: ["c3"]}
    # the backward ([Note: layer-wise backward]): segments by backward level, each started from the
    # norms' outputs and the skip relu kept from the forward
    assert {k: sorted(v) for k, v in plan.segment.items()} == {0: ["head", "output", "relu_2"], 1: [
        "c3", "cat", "n3", "relu_1", "up"], 2: ["c2", "n2", "relu"], 3: ["c1", "n1"]}
    assert plan.sums == {j: plan.segment[j] for j in (1, 2, 3)} and sorted(plan.boundary) == ["n1", "n2", "n3", "relu"]
