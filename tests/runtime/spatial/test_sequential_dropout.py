"""Dropout on sequential and plain spatial tiles: masks keyed by image coordinates ([Note: keyed dropout]).

Every sub-tile, margin, statistics pass and recomputation draws the same mask for the same
pixel, so a spatial stage (sequential tiles or one tile per rank) trains exactly what one process trains with
:class:`KeyedDropout` in place of torch's dropout, its generator seeded alike (float64, 3 Adam
steps, every parameter and buffer to 1e-9).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from helpers.distributed import run_workers
from helpers.reference import train_reference
from torch import nn

import nowdl
from nowdl.errors import NowdlError
from nowdl.runtime.spatial import dropout
from nowdl.runtime.spatial.dropout import (
    KeyedDropout,
    keyed_dropout,
    keyed_graph,
    keyed_mask,
    keyed_run,
)
from nowdl.runtime.spatial.reach import refuse_sequential
from nowdl.trace.exported import ModeAware

STEPS = 3
ONE = {"stages": 1, "spatial_parts": 1, "micro_batches": 1, "dp": 1, "replicas": 1}


class DropNet(nn.Module):
    """Dropout between convs at two resolutions (elementwise and whole channels); with ``norm``,
    a GroupNorm right after a dropout, so its statistics passes rerun the dropout; c0 and c1 make
    a run halo fusion may fuse (a dropout in training ends it)."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.c0, self.r0 = nn.Conv2d(1, 4, 3, padding=1), nn.ReLU()
        self.c1 = nn.Conv2d(4, 4, 3, padding=1)
        self.d1 = nn.Dropout(0.3)
        self.n1 = nn.GroupNorm(2, 4) if norm else nn.Identity()
        self.c2 = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.d2 = nn.Dropout2d(0.25)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.c3 = nn.Conv2d(8, 4, 3, padding=1)
        self.d3 = nn.Dropout(0.5)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.n1(self.d1(self.c1(self.r0(self.c0(x))))))
        b = self.up(self.d2(torch.relu(self.c2(a))))
        return self.head(self.d3(torch.relu(self.c3(torch.cat([a, b], dim=1)))))


def _make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return DropNet(norm=name == "drop_gn").double()


def _data(step: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """2 samples per micro-batch (the sample index keys the mask); the CPU generator seeded per step."""
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randn(2 * total, 1, 32, 16, generator=g, dtype=torch.float64)
    y = torch.randn(2 * total, 2, 32, 16, generator=g, dtype=torch.float64)
    torch.manual_seed(100 + step)  # the dropout seeds of this step, drawn alike by the ranks and the reference
    return x, y


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def _plan(name: str, path: Path, gpus: int, cfg: dict[str, Any], tiles: int, schedule: str | None = None) -> None:
    cm = nowdl.compile(_make(name), gpus=gpus, mode="estimate", optimizer=_adam, loss_fn=nn.MSELoss(), cache=False,
                       progress=False, **cfg)
    x, y = _data(0, 1)
    d = json.loads(cm.plan(x, target=y).to_json())  # a micro-batch of 2 samples
    d["stages"][0]["tiles_per_gpu"] = tiles
    if schedule is not None:
        d["stages"][0]["norm_schedule"] = schedule
    path.write_text(json.dumps(d))


#: losses, state, per tiled stage (sequential, keyed dropouts, fused runs), per stage whether host memory was kept
Result = tuple[list[float], dict[str, torch.Tensor], list[tuple[bool, int, int]], list[bool]]


def _train(rank: int, world: int, name: str, path: str, total: int, ckpt: bool = False) -> Result:
    cm = nowdl.compile(_make(name), plan=path, mode="estimate", optimizer=_adam, loss_fn=nn.MSELoss(), cache=False,
                       progress=False, timeout_s=120, activation_checkpointing=ckpt)
    losses = [cm.train_step(*_data(step, total)) for step in range(STEPS)]
    tiled = cm._trainer.engine.tiled.values()
    return losses, cm.state_dict(), [(t.sequential is not None, len(t.keyed), 0 if t.sequential else len(t._chains))
                                     for t in tiled], [bool(t.sequential and t.sequential.host_meter[1]) for t in tiled]


def _check(got: Result, name: str, total: int, sequential: bool = True, fused: int = 0) -> None:
    losses, sd, tiled, _ = got
    assert tiled == [(sequential, 3, fused)], f"not a stage with 3 keyed dropout nodes and {fused} fused runs: {tiled}"
    model = keyed_dropout(_make(name))
    ref_losses, ref_sd = train_reference(model, _adam(model.parameters()), nn.MSELoss(), lambda s: _data(s, total),
                                         total, STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-9, atol=1e-12)
    for k, v in ref_sd.items():
        torch.testing.assert_close(sd[k], v, rtol=1e-9, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize(("name", "tiles", "schedule"), [("drop", 4, None), ("drop_gn", 4, "passes"),
                                                       ("drop_gn", 4, "layerwise"), ("drop_gn", 9, None)])
def test_dropout_on_sequential_tiles_on_one_rank_is_exact(name: str, tiles: int, schedule: str | None,
                                                           tmp_path: Path) -> None:
    """The GroupNorm net's statistics in passes or layer-wise from host memory ([Note: layer-wise
    norms]): every pass, kept value and backward segment applies the same keyed masks."""
    path = tmp_path / "plan.json"
    _plan(name, path, 1, ONE, tiles, schedule)
    got = _train(0, 1, name, str(path), 1)
    assert got[3] == [schedule == "layerwise"], got[3]  # the layer-wise schedule ran (and only when pinned)
    _check(got, name, 1)


def test_dropout_on_sequential_tiles_on_two_ranks_is_exact(tmp_path: Path) -> None:
    """2 ranks, 2 sub-tiles each, 2 micro-batches in flight (GPipe), a GroupNorm after a dropout."""
    path = tmp_path / "plan.json"
    _plan("drop_gn", path, 2, {**ONE, "spatial_parts": 2, "slice": "horizontal", "micro_batches": 2,
                               "schedule": "gpipe"}, 2)
    results = run_workers(_train, 2, "drop_gn", str(path), 2, timeout_s=300)
    assert results[0][0] == results[1][0]
    _check(results[0], "drop_gn", 2)


def test_dropout_on_plain_spatial_tiles_is_exact_under_recompute(tmp_path: Path) -> None:
    """2 ranks, one tile each (tiles_per_gpu=1): each rank's tile takes the whole image's mask
    there; the stage recomputed in backward (2 micro-batches in flight) draws the same seeds; c0
    and c1 fused (one halo exchange), the dropout after them run node by node."""
    path = tmp_path / "plan.json"
    _plan("drop_gn", path, 2, {**ONE, "spatial_parts": 2, "slice": "horizontal", "micro_batches": 2,
                               "schedule": "gpipe", "halo_fusion": 2}, 1)
    results = run_workers(_train, 2, "drop_gn", str(path), 2, True, timeout_s=300)
    assert results[0][0] == results[1][0]
    _check(results[0], "drop_gn", 2, sequential=False, fused=1)


def test_keyed_mask_is_a_function_of_image_coordinates(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = keyed_mask((2, 3, 20, 24), 0.4, seed=7)
    part = keyed_mask((2, 3, 8, 9), 0.4, seed=7, origin=(5, 11))
    assert torch.equal(part, whole[:, :, 5:13, 11:20])
    monkeypatch.setattr(dropout, "_CHUNK", 200)  # hashed 1 or 2 rows at a time: the same mask
    assert torch.equal(keyed_mask((2, 3, 20, 24), 0.4, seed=7), whole)
    assert torch.equal(keyed_mask((2, 3, 8, 9), 0.4, seed=7, origin=(5, 11)), part)
    assert not torch.equal(whole, keyed_mask((2, 3, 20, 24), 0.4, seed=8))
    ch = keyed_mask((2, 3, 20, 24), 0.4, seed=7, channels=True)
    assert ch.shape == (2, 3, 1, 1) and torch.equal(ch, keyed_mask((2, 3, 4, 4), 0.4, seed=7, origin=(9, 9),
                                                                   channels=True))
    with pytest.raises(NowdlError, match="origin"):
        keyed_mask((1, 1, 4, 4), 0.5, seed=1, origin=(1,))


@pytest.mark.parametrize(("p", "channels"), [(0.1, False), (0.5, False), (0.3, True)])
def test_keyed_dropout_honours_p_and_draws_a_new_mask_per_call(p: float, channels: bool) -> None:
    """The keep rate is 1 - p (within 5 standard deviations), the kept values are scaled by
    1 / (1 - p), and each call (micro-batch) draws a new seed, so a new mask."""
    torch.manual_seed(0)
    drop = KeyedDropout(p, channels)
    x = torch.ones(4, 300, 20, 20, dtype=torch.float64) if channels else torch.ones(2, 4, 200, 200, dtype=torch.float64)
    a, b = drop(x), drop(x)
    keep = (a != 0).double()
    n = x.shape[0] * x.shape[1] if channels else x.numel()
    assert abs(float(keep.mean()) - (1 - p)) < 5 * ((p * (1 - p) / n) ** 0.5)
    assert torch.allclose(a[a != 0], torch.full_like(a[a != 0], 1 / (1 - p)))
    assert not torch.equal(a, b)
    drop.eval()
    assert drop(x) is x


class _Functional(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.dropout2d(F.dropout(x, 0.5, True), p=0.25)
        return torch.ops.aten.dropout.default(y, 0.5, True)


def test_functional_and_exported_dropout_in_a_stage_graph_are_keyed_by_window_origin() -> None:
    """``F.dropout`` / ``F.dropout2d`` nodes and an exported graph's ATen dropout (a ``ModeAware``
    module, [Note: exported graphs]) are keyed too: a window at an origin draws the whole image's
    mask there; in eval mode the exported one is the identity."""
    gm = fx.symbolic_trace(_Functional())
    aten = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.dropout.default)
    gm.add_submodule("mode", mode := ModeAware(aten.target, 2))
    aten.op, aten.target = "call_module", "mode"
    gm.recompile()
    gm, keyed = keyed_graph(gm)
    names = [k.node for k in keyed]
    assert names == ["dropout", "dropout2d", aten.name]
    x = torch.ones(1, 2, 12, 10, dtype=torch.float64)
    seeds = dict(zip(names, (3, 4, 5), strict=True))
    with keyed_run(seeds, {}):
        whole = gm(x)
    with keyed_run(seeds, dict.fromkeys(names, (4, 2))):
        part = gm(x[:, :, 4:10, 2:9])
    assert torch.equal(part, whole[:, :, 4:10, 2:9]) and bool((whole == 0).any())
    mode.eval()
    assert [k.live()[1] for k in keyed] == [True, True, False]


def test_alpha_dropout_stays_refused_on_sequential_tiles() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.AlphaDropout(0.2)))
    with pytest.raises(NowdlError, match="AlphaDropout"):
        refuse_sequential(gm, 0, 4)
    refuse_sequential(fx.symbolic_trace(nn.Sequential(nn.Conv2d(1, 1, 3), nn.Dropout(0.2))), 0, 4)
