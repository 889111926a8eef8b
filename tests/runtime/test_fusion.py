"""Halo fusion: a fused run of ops equals the unsplit chain, with one exchange each way.

Each worker builds the chain and the full input from a seed, computes the unsplit reference
(output, input gradient, parameter gradients), runs :func:`fused_forward` on its tile, sums
the weight gradients over the tiles and compares. Many (chain, grid) cases run inside one
spawned group (2 or 4 gloo processes); each worker returns {case: max relative error} and
{case: exchange counts}, and the parent asserts.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.distributed import run_workers
from torch import nn

from nowdl.runtime.spatial import TileTooSmallError, exchange, sum_weight_grads, tile_forward
from nowdl.runtime.spatial.fusion import chain_geometry, fusable, fused_forward
from nowdl.runtime.spatial.tiles import TileGrid

TOL = 1e-5
D64 = torch.float64

# name -> (chain factory, input shape)
Chain = tuple[Callable[[], list[nn.Module]], tuple[int, ...]]

CHAINS: dict[str, Chain] = {
    "conv3_relu_conv3": (lambda: [nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 3, padding=1)], (2, 3, 13, 17)),
    "conv_s2_prelu_conv_d2": (lambda: [nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.PReLU(4),
                                       nn.Conv2d(4, 3, 3, padding=2, dilation=2)], (2, 3, 13, 17)),
    "conv_maxpool_conv": (lambda: [nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(3, 2, 1),
                                   nn.Conv2d(4, 3, 3, padding=1)], (2, 3, 13, 17)),
    "conv_avgpool_excl_ceil": (lambda: [nn.Conv2d(3, 4, 3, padding=1), nn.Sigmoid(),
                                        nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False),
                                        nn.Conv2d(4, 2, 1)], (2, 3, 13, 17)),
    # leading pointwise op (on the exact tile), depthwise convs, avg pool with divisor
    "tanh_depthwise_avgdiv": (lambda: [nn.Tanh(), nn.Conv2d(4, 4, 3, padding=1, groups=4), nn.GELU(),
                                       nn.Conv2d(4, 4, 5, padding=2, groups=4),
                                       nn.AvgPool2d(3, 1, 1, divisor_override=5)], (2, 4, 13, 17)),
    # max pool first (fetch filled with -inf), 'same' even kernel, 'valid'
    "maxpool_same_valid": (lambda: [nn.MaxPool2d(3, 2, 1, dilation=2, ceil_mode=True),
                                    nn.Conv2d(3, 4, 4, padding="same", bias=False),
                                    nn.Conv2d(4, 2, 3, padding="valid")], (2, 3, 17, 19)),
    # fused halo of 6 px: on 4-5 px tiles the window reaches two tiles away
    "deep_k5x3": (lambda: [nn.Conv2d(3, 3, 5, padding=2), nn.ReLU(), nn.Conv2d(3, 3, 5, padding=2),
                           nn.ReLU(), nn.Conv2d(3, 2, 5, padding=2)], (2, 3, 13, 17)),
    # padding wider than a tile: an intermediate region of the last row tile is empty on (4, 1)
    "empty_region": (lambda: [nn.Conv2d(2, 3, 1), nn.Conv2d(3, 3, 1, padding=6), nn.Conv2d(3, 2, 1)], (2, 2, 13, 9)),
    "conv1d": (lambda: [nn.Conv1d(2, 3, 5, padding=2), nn.Tanh(), nn.AvgPool1d(3, 2, 1),
                        nn.Conv1d(3, 2, 3, padding=2, dilation=2)], (2, 2, 29)),
    "conv3d": (lambda: [nn.Conv3d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool3d(3, 2, 1),
                        nn.Conv3d(3, 2, 3, padding=1)], (2, 2, 9, 6, 7)),
}


def _rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return math.inf
    a, b = a.detach(), b.detach()
    if a.shape != b.shape:
        return math.inf
    scale = max(float(b.abs().max()) if b.numel() else 0.0, 1e-12)
    return float((a - b).abs().max()) / scale if a.numel() else 0.0


def _count_exchanges() -> dict[str, int]:
    """Count every halo exchange forward and backward (in this worker only)."""
    calls = {"fwd": 0, "bwd": 0}
    forward, backward = exchange._post_exchange, exchange._post_slabs

    # one-tile grids are a fused run's padding of its recomputed regions: no messages
    def counting_fetch(x: Any, grid: TileGrid, *args: Any, **kwargs: Any) -> Any:  # every exchange's forward
        calls["fwd"] += len(grid.ranks) > 1
        return forward(x, grid, *args, **kwargs)

    def counting_backward(slabs: Any, like: Any, grid: TileGrid, *args: Any, **kwargs: Any) -> Any:  # every backward
        calls["bwd"] += len(grid.ranks) > 1
        return backward(slabs, like, grid, *args, **kwargs)

    exchange._post_exchange = counting_fetch  # type: ignore[assignment]
    exchange._post_slabs = counting_backward  # type: ignore[assignment]
    return calls


def _run(name: str, grid_dims: tuple[int, ...], seed: int, dtype: torch.dtype,
         calls: dict[str, int]) -> tuple[float, tuple[int, int]]:
    make, shape = CHAINS[name]
    torch.manual_seed(seed)
    ref = nn.Sequential(*make()).to(dtype)
    mods = copy.deepcopy(ref)
    x = torch.randn(shape, dtype=dtype)
    xr = x.clone().requires_grad_(True)
    y = ref(xr)
    g = torch.randn(y.shape, dtype=dtype)
    y.backward(g)

    grid = TileGrid.for_rank(shape[2:], grid_dims)
    xt = grid.split(x).clone().requires_grad_(True)
    calls["fwd"] = calls["bwd"] = 0
    yt, og = fused_forward(list(mods), xt, grid)
    assert og.shape == tuple(y.shape[2:]), (og.shape, y.shape)
    yt.backward(og.split(g))
    counts = (calls["fwd"], calls["bwd"])
    sum_weight_grads(mods)
    errs = [_rel(yt, og.split(y)), _rel(xt.grad, grid.split(xr.grad))]  # type: ignore[arg-type]
    errs += [_rel(q.grad, p.grad) for p, q in zip(ref.parameters(), mods.parameters(), strict=True)]
    errs.append(_rel(og.gather(yt.detach()), y))
    return max(errs), counts


Case = tuple[str, tuple[int, ...], bool]  # (chain name, grid, float32)


def _worker(rank: int, world: int, cases: list[Case]) -> dict[str, Any]:
    calls = _count_exchanges()
    errs: dict[str, float] = {}
    counts: dict[str, tuple[int, int]] = {}
    for i, (name, grid_dims, f32) in enumerate(cases):
        key = f"{'f32/' if f32 else ''}{name}{grid_dims}"
        errs[key], counts[key] = _run(name, grid_dims, 100 + i, torch.float32 if f32 else D64, calls)
    # the unfused chain exchanges once per conv/pool (3 here), each way
    make, shape = CHAINS["conv_maxpool_conv"]
    torch.manual_seed(0)
    grid = TileGrid.for_rank(shape[2:], (world, 1))
    xt = grid.split(torch.randn(shape)).clone().requires_grad_(True)
    calls["bwd"] = 0
    yt, _ = tile_forward(nn.Sequential(*make()), xt, grid)
    yt.sum().backward()
    counts["unfused"] = (-1, calls["bwd"])
    return {"errs": errs, "counts": counts}


def _check(results: list[dict[str, Any]]) -> None:
    bad = {f"rank{r}:{k}": e for r, res in enumerate(results) for k, e in res["errs"].items() if not e <= TOL}
    assert not bad, f"fused chains differ from the unsplit chain: {bad}"
    for res in results:
        counts = res["counts"]
        assert counts.pop("unfused") == (-1, 3), "unfused reference should exchange 3 times"
        wrong = {k: c for k, c in counts.items() if c != (1, 1)}
        assert not wrong, f"expected one exchange forward and one backward per fused run: {wrong}"


def test_fused_two_ranks() -> None:
    """Vertical (1, 2) and horizontal (2, 1) grids, 1D and 3D depth grids, a float32 case."""
    cases: list[Case] = [(name, grid, False) for name in ("conv3_relu_conv3", "conv_s2_prelu_conv_d2", "conv_maxpool_conv",
                                              "conv_avgpool_excl_ceil", "tanh_depthwise_avgdiv",
                                              "maxpool_same_valid") for grid in ((1, 2), (2, 1))]
    cases += [("conv1d", (2,), False), ("conv3d", (2, 1, 1), False), ("conv3_relu_conv3", (1, 2), True)]
    _check(run_workers(_worker, 2, cases, timeout_s=120))


def test_fused_four_ranks() -> None:
    """Square (2, 2), (1, 4) and (4, 1) grids with uneven tiles, windows two tiles deep, empty
    intermediate regions, 3D (2, 1, 2) / (4, 1, 1), float32."""
    cases: list[Case] = [(name, (2, 2), False) for name in ("conv_s2_prelu_conv_d2", "conv_maxpool_conv",
                                                "conv_avgpool_excl_ceil", "tanh_depthwise_avgdiv",
                                                "maxpool_same_valid")]
    cases += [("deep_k5x3", (1, 4), False), ("deep_k5x3", (4, 1), False), ("empty_region", (4, 1), False),
              ("conv1d", (4,), False), ("conv3d", (2, 1, 2), False), ("conv3d", (4, 1, 1), False),
              ("conv_maxpool_conv", (2, 2), True), ("tanh_depthwise_avgdiv", (2, 2), True)]
    _check(run_workers(_worker, 4, cases, timeout_s=120))


# ------------------------------------------------------------------------------------------
# no processes


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_fused_single_tile_matches_chain() -> None:
    """A one-tile grid needs no peers: the image-boundary padding of every op is exact."""
    for i, name in enumerate(CHAINS):
        make, shape = CHAINS[name]
        torch.manual_seed(i)
        ref = nn.Sequential(*make()).to(D64)
        x = torch.randn(shape, dtype=D64)
        grid = TileGrid(shape[2:], (1,) * (len(shape) - 2), (0,) * (len(shape) - 2), (0,))
        y, og = fused_forward(list(ref), x, grid)
        assert og.shape == tuple(ref(x).shape[2:])
        assert _rel(y, ref(x)) <= TOL, name


def test_chain_geometry_conv3x3_twice() -> None:
    chain = [nn.Conv2d(1, 1, 3, padding=1), nn.ReLU(), nn.Conv2d(1, 1, 3, padding=1)]
    geo = chain_geometry(chain, (16, 16), (1, 4))
    assert geo["halo"] == ((0, 0), (2, 2))
    assert geo["exchanges_unfused"] == 2 and geo["exchanges_fused"] == 1
    # interior tile: conv1 computes 16 x 6 instead of 16 x 4, conv2 exactly 16 x 4
    assert geo["extra_fraction"] == pytest.approx((96 + 64) / 128 - 1)
    geo = chain_geometry(chain, (16, 16), (2, 2))
    assert geo["halo"] == ((2, 2), (2, 2))
    assert geo["extra_fraction"] == pytest.approx((81 + 64) / 128 - 1)  # 9 x 9 instead of 8 x 8
    one = chain_geometry(chain[:1], (16, 16), (2, 2))
    assert one["halo"] == ((1, 1), (1, 1)) and one["extra_fraction"] == 0.0
    assert chain_geometry([nn.ReLU()], (16, 16), (2, 2))["exchanges_fused"] == 0


def test_fusable_and_errors() -> None:
    assert fusable(nn.Conv2d(2, 2, 3, padding="same", dilation=2, groups=2))
    assert fusable(nn.Sequential(nn.Conv3d(1, 1, 3), nn.PReLU(), nn.AvgPool3d(2)))
    assert fusable(nn.Dropout().eval()) and not fusable(nn.Dropout())
    for m in (nn.BatchNorm2d(3), nn.Upsample(scale_factor=2), nn.ConvTranspose2d(1, 1, 2),
              nn.Conv2d(1, 1, 3, padding_mode="reflect"), nn.MaxPool2d(2, return_indices=True),
              nn.GroupNorm(1, 2), nn.Linear(2, 2)):
        assert not fusable(m), m
    grid = TileGrid((13, 17), (1, 1), (0, 0), (0,))
    x = torch.randn(1, 3, 13, 17)
    with pytest.raises(NotImplementedError, match=r"#1 BatchNorm2d is not fusable"):
        fused_forward([nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3)], x, grid)
    with pytest.raises(NotImplementedError, match=r"#2 Dropout.*training mode"):
        fused_forward([nn.Dropout(), nn.Conv2d(3, 3, 3), nn.Dropout()], x, grid)
    with pytest.raises(TileTooSmallError, match=r"#1 Conv2d.*size 5 into 2.*4 tiles"):
        chain_geometry([nn.Conv2d(3, 3, 3, stride=4, padding=1)] * 2, (13, 17), (1, 4))
    with pytest.raises(ValueError, match=r"3 spatial dims but the tiles have 2"):
        chain_geometry([nn.Conv3d(3, 3, 3)], (13, 17), (1, 4))
