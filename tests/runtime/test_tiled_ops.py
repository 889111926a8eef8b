"""Exactness of tiled ops: every tile equals the same region of the unsplit op.

Each worker builds the full input and module from the same seed, computes the unsplit
reference (output, input gradient, parameter gradients, running statistics), then runs the
tiled op on its own tile, sums the weight gradients over the tiles and compares. Many cases
run inside one spawned group (2 or 4 gloo processes) to keep the file fast; each worker
returns {case: max relative error} and the parent asserts.
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

from nowdl.partitioner.spatial.tileable import slice_grid
from nowdl.runtime.spatial import (
    TileTooSmallError,
    halo_exchange,
    sum_weight_grads,
    tile_forward,
)
from nowdl.runtime.spatial.tiles import TileGrid, split_bounds

TOL = 1e-5
D64 = torch.float64


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    if a.shape != b.shape:
        return math.inf
    scale = max(float(b.abs().max()) if b.numel() else 0.0, 1e-12)
    return float((a - b).abs().max()) / scale if a.numel() else 0.0


# (name, module factory, input shape); 2D unless the shape says otherwise
Case = tuple[str, Callable[[], nn.Module], tuple[int, ...]]

CASES_2D: list[Case] = [
    ("conv_k1", lambda: nn.Conv2d(3, 4, 1), (2, 3, 17, 23)),
    ("conv_k3", lambda: nn.Conv2d(3, 4, 3, padding=1), (2, 3, 17, 23)),
    ("conv_k5", lambda: nn.Conv2d(3, 4, 5, padding=2), (2, 3, 17, 23)),
    ("conv_k7", lambda: nn.Conv2d(3, 4, 7, padding=3), (2, 3, 17, 23)),
    ("conv_k3_nopad", lambda: nn.Conv2d(3, 4, 3), (2, 3, 17, 23)),
    ("conv_k3_s2", lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1), (2, 3, 17, 23)),
    ("conv_k4_s2_even", lambda: nn.Conv2d(3, 4, 4, stride=2, padding=1), (2, 3, 16, 20)),
    ("conv_k3_d2", lambda: nn.Conv2d(3, 4, 3, padding=2, dilation=2), (2, 3, 17, 23)),
    ("conv_depthwise", lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4), (2, 4, 17, 23)),
    ("conv_groups2_s2_d2", lambda: nn.Conv2d(4, 6, 5, stride=2, padding=3, dilation=2, groups=2), (2, 4, 19, 21)),
    ("conv_rect_k", lambda: nn.Conv2d(3, 4, (3, 5), stride=(1, 2), padding=(1, 0)), (2, 3, 17, 23)),
    ("conv_same_k4", lambda: nn.Conv2d(3, 2, 4, padding="same", bias=False), (2, 3, 17, 23)),
    ("maxpool_2", lambda: nn.MaxPool2d(2), (2, 3, 17, 23)),
    ("maxpool_3s2p1", lambda: nn.MaxPool2d(3, 2, 1), (2, 3, 17, 23)),
    ("maxpool_ceil_d2", lambda: nn.MaxPool2d(3, 2, 1, dilation=2, ceil_mode=True), (2, 3, 17, 23)),
    ("avgpool_2", lambda: nn.AvgPool2d(2), (2, 3, 17, 23)),
    ("avgpool_3s2p1_incl", lambda: nn.AvgPool2d(3, 2, 1), (2, 3, 17, 23)),
    ("avgpool_3s2p1_excl_ceil", lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False), (2, 3, 17, 23)),
    ("avgpool_divisor", lambda: nn.AvgPool2d(3, 1, 1, divisor_override=5), (2, 3, 17, 23)),
    ("batchnorm", lambda: nn.BatchNorm2d(3), (2, 3, 17, 23)),
    ("batchnorm_cma", lambda: nn.BatchNorm2d(3, momentum=None), (2, 3, 17, 23)),
    ("groupnorm", lambda: nn.GroupNorm(2, 4), (2, 4, 17, 23)),
    ("instancenorm", lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), (2, 3, 17, 23)),
    ("up_nearest_x2", lambda: nn.Upsample(scale_factor=2, mode="nearest"), (2, 3, 17, 23)),
    ("up_nearest_size", lambda: nn.Upsample(size=(40, 31), mode="nearest"), (2, 3, 17, 23)),
    ("up_nearest_exact", lambda: nn.Upsample(scale_factor=1.5, mode="nearest-exact"), (2, 3, 17, 23)),
    ("up_bilinear_ac_false", lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False), (2, 3, 17, 23)),
    ("up_bilinear_ac_true", lambda: nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), (2, 3, 17, 23)),
    ("up_bilinear_size", lambda: nn.Upsample(size=(30, 50), mode="bilinear", align_corners=False), (2, 3, 17, 23)),
    ("convT_k2_s2", lambda: nn.ConvTranspose2d(3, 4, 2, stride=2), (2, 3, 17, 23)),
    ("convT_k3_s2_p1_op1", lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1), (2, 3, 17, 23)),
    ("convT_k4_s2_p1_d2_g", lambda: nn.ConvTranspose2d(4, 6, 3, stride=3, padding=2, dilation=2, groups=2), (2, 4, 13, 15)),
    ("chain", lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, stride=2, padding=1),
        nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False), nn.Conv2d(4, 2, 5, padding=2),
    ), (2, 3, 33, 37)),
]

CASES_3D: list[Case] = [
    ("conv3d_k3", lambda: nn.Conv3d(2, 3, 3, padding=1), (2, 2, 9, 10, 11)),
    ("conv3d_k3_s2", lambda: nn.Conv3d(2, 3, 3, stride=2, padding=1), (1, 2, 9, 10, 11)),
    ("batchnorm3d", lambda: nn.BatchNorm3d(2), (2, 2, 9, 10, 11)),
    ("maxpool3d", lambda: nn.MaxPool3d(2), (1, 2, 9, 10, 11)),
    ("up_trilinear", lambda: nn.Upsample(scale_factor=2, mode="trilinear", align_corners=False), (1, 2, 9, 10, 11)),
]


def _run_case(case: Case, grid_dims: tuple[int, ...], seed: int, dtype: torch.dtype,
              group: Any = None, ranks: list[int] | None = None) -> float:
    _, make, shape = case
    torch.manual_seed(seed)
    ref_mod = make().to(dtype)
    tile_mod = copy.deepcopy(ref_mod)
    x = torch.randn(shape, dtype=dtype)
    xr = x.clone().requires_grad_(True)
    ref = ref_mod(xr)
    g = torch.randn(ref.shape, dtype=dtype)
    ref.backward(g)

    grid = TileGrid.for_rank(shape[2:], grid_dims, ranks=ranks)
    xt = grid.split(x).clone().requires_grad_(True)
    yt, out_grid = tile_forward(tile_mod, xt, grid, group)
    assert out_grid.shape == tuple(ref.shape[2:]), (out_grid.shape, ref.shape)
    yt.backward(out_grid.split(g))
    sum_weight_grads(tile_mod, group)

    errs = [_rel(yt, out_grid.split(ref)), _rel(xt.grad, grid.split(xr.grad))]  # type: ignore[arg-type]
    for p, q in zip(ref_mod.parameters(), tile_mod.parameters(), strict=True):
        errs.append(_rel(q.grad, p.grad))  # type: ignore[arg-type]
    for a, b in zip(ref_mod.buffers(), tile_mod.buffers(), strict=True):
        errs.append(_rel(b.to(D64), a.to(D64)))
    # the gathered output equals the reference everywhere
    errs.append(_rel(out_grid.gather(yt.detach(), group), ref.detach()))
    return max(errs)


def _worker(rank: int, world: int, methods: list[str], dims: int, f32: bool,
            subgroups: bool = False) -> dict[str, float]:
    cases = CASES_2D if dims == 2 else CASES_3D
    out: dict[str, float] = {}
    if subgroups:  # two tile groups of non-adjacent ranks {0, 2} and {1, 3}
        import torch.distributed as dist

        h = _halo_worker(rank, world)
        out["halo/fwd"] = float(h["fwd"])
        out["halo/bwd"] = float(h["bwd"])
        msg = str(h["too_small"])
        out["halo/too_small_message"] = 0.0 if "tile too small" in msg and "fewer parts" in msg else 1.0
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        ranks = [rank % 2, rank % 2 + 2]
        for i, case in enumerate(CASES_2D):
            if case[0] in ("conv_k5", "conv_groups2_s2_d2", "batchnorm", "up_bilinear_ac_true", "chain"):
                for method in ("vertical", "horizontal"):
                    out[f"group{ranks}/{method}/{case[0]}"] = _run_case(
                        case, slice_grid(method, 2, 2), 3000 + i, D64, groups[rank % 2], ranks)
    for method in methods:
        grid_dims = slice_grid(method, world, dims)
        for i, case in enumerate(cases):
            try:
                out[f"{method}{grid_dims}/{case[0]}"] = _run_case(case, grid_dims, 1000 + i, D64)
            except TileTooSmallError:
                out[f"{method}{grid_dims}/{case[0]}"] = -1.0  # skipped: grid too fine for the op
    if f32:
        grid_dims = slice_grid("square", world, dims)
        for i, case in enumerate(cases):
            out[f"f32/{case[0]}"] = _run_case(case, grid_dims, 2000 + i, torch.float32)
    return out


def _check(results: list[dict[str, float]], tol: float = TOL, f32_tol: float = TOL) -> None:
    bad = {}
    for rank, res in enumerate(results):
        for name, err in res.items():
            limit = f32_tol if name.startswith("f32/") else tol
            if not err <= limit:
                bad[f"rank{rank}:{name}"] = err
    assert not bad, f"tiled ops differ from the unsplit op: {bad}"
    assert all(-1.0 not in r.values() for r in results), results


def test_tiled_ops_two_ranks() -> None:
    res = run_workers(_worker, 2, ["vertical", "horizontal"], 2, False, timeout_s=120)
    _check(res)


def test_tiled_ops_four_ranks() -> None:
    res = run_workers(_worker, 4, ["vertical", "horizontal", "square"], 2, True, timeout_s=180)
    _check(res)


def test_tiled_3d_halo_exchange_and_subgroups() -> None:
    """3D depth/square slicing; halo_exchange faces/corners, its adjoint and its error; tile
    groups of non-adjacent ranks."""
    res = run_workers(_worker, 4, ["depth", "square"], 3, False, True, timeout_s=120)
    _check(res)


# ------------------------------------------------------------------------------------------
# halo exchange


def _halo_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, 13, dtype=D64)
    grid = TileGrid.for_rank((11, 13), slice_grid("square", world, 2))
    halo = ((2, 1), (1, 3))
    xt = grid.split(x).clone().requires_grad_(True)
    padded = halo_exchange(xt, grid, halo)
    full_pad = torch.nn.functional.pad(x, (1, 3, 2, 1))
    (r0, r1), (c0, c1) = grid.tile_bounds()
    expect = full_pad[:, :, r0 : r1 + 3, c0 : c1 + 4]
    out["fwd"] = _rel(padded.detach(), expect)
    # backward: d/dx of sum over all ranks of <padded, w> = sum of w over every copy of x
    w = torch.randn(full_pad.shape, dtype=D64)
    padded.backward(w[:, :, r0 : r1 + 3, c0 : c1 + 4])
    xf = x.clone().requires_grad_(True)
    total = torch.zeros((), dtype=D64)
    for cs in grid.all_coords():
        (a0, a1), (b0, b1) = grid.tile_bounds(cs)
        total = total + (torch.nn.functional.pad(xf, (1, 3, 2, 1))[:, :, a0 : a1 + 3, b0 : b1 + 4] * w[:, :, a0 : a1 + 3, b0 : b1 + 4]).sum()
    total.backward()
    out["bwd"] = _rel(xt.grad, grid.split(xf.grad))  # type: ignore[arg-type]
    try:
        halo_exchange(xt, grid, ((6, 6), (1, 1)))
        out["too_small"] = "no error"
    except TileTooSmallError as e:
        out["too_small"] = str(e)
    return out


# ------------------------------------------------------------------------------------------
# geometry (no processes)


@pytest.mark.parametrize("size,parts", [(17, 2), (23, 4), (5, 5), (3, 4), (100, 7)])
def test_split_bounds_uneven(size: int, parts: int) -> None:
    b = [split_bounds(size, parts, i) for i in range(parts)]
    assert b[0][0] == 0 and b[-1][1] == size
    assert all(b[i][1] == b[i + 1][0] for i in range(parts - 1))
    sizes = [hi - lo for lo, hi in b]
    assert max(sizes) - min(sizes) <= 1


def test_tilegrid_neighbours_and_split() -> None:
    grid = TileGrid.for_rank((17, 23), (2, 3), rank=11, ranks=[10, 11, 12, 13, 14, 15])
    assert grid.coords == (0, 1) and grid.rank == 11
    assert grid.bounds(0) == (0, 9) and grid.bounds(1) == (8, 16)
    assert grid.neighbour((1, 1)) == 15 and grid.neighbour((1, -1)) == 13
    assert grid.neighbour((-1, 0)) is None and grid.neighbour((0, 0)) == 11
    x = torch.randn(1, 2, 17, 23)
    assert torch.equal(grid.split(x), x[:, :, 0:9, 8:16])
    with pytest.raises(ValueError, match="ranks"):
        TileGrid((17, 23), (2, 2), (0, 0), (0, 1, 2))


# ------------------------------------------------------------------------------------------
# halo overlap ([Note: halo overlap]): the same results with overlap on and off


_OVERLAP_CASES = ("conv_k3", "conv_k5", "conv_k3_nopad", "conv_k3_s2", "conv_k4_s2_even", "conv_k3_d2",
                  "conv_groups2_s2_d2", "conv_rect_k", "conv_same_k4", "maxpool_3s2p1", "avgpool_3s2p1_incl",
                  "avgpool_3s2p1_excl_ceil", "chain")


def _overlap_worker(rank: int, world: int, methods: list[str]) -> dict[str, float]:
    """Every case with overlap off and on (float64, uneven tiles); counts the ops that took the
    overlapped path (a border frame recomputed after an interior computed before the wait)."""
    from nowdl.runtime.spatial import set_halo_overlap, window_op

    split = {"n": 0, "padded": 0}
    boxes = window_op.border_boxes

    def counting(*args: Any) -> Any:
        r = boxes(*args)
        split["n"] += r is not None
        return r

    window_op.border_boxes = counting  # type: ignore[assignment]
    tile_pad = window_op._tile_pad

    def counting_pad(*args: Any) -> Any:  # the conv ran on its zero-padded tile, no window built
        r = tile_pad(*args)
        split["padded"] += r is not None
        return r

    window_op._tile_pad = counting_pad  # type: ignore[assignment]
    out: dict[str, float] = {}
    by_name = {c[0]: (i, c) for i, c in enumerate(CASES_2D)}
    for on in (False, True):
        set_halo_overlap(on)
        for method in methods:
            grid_dims = slice_grid(method, world, 2)
            for name in _OVERLAP_CASES:
                i, case = by_name[name]
                split["n"] = split["padded"] = 0
                out[f"overlap={on}/{method}{grid_dims}/{name}"] = _run_case(case, grid_dims, 4000 + i, D64)
                if on:
                    out[f"ops overlapped/{method}{grid_dims}/{name}"] = float(split["n"])
                    out[f"ops padded/{method}{grid_dims}/{name}"] = float(split["padded"])
    set_halo_overlap(True)
    return out


def _check_overlap(results: list[dict[str, float]]) -> None:
    counted = [k for k in results[0] if k.startswith("ops overlapped/")]
    # a rank whose window needs nothing from the others (stride 2 on an even tile) has no
    # halo to wait for; some rank of every case must have run the overlapped path
    missing = [k for k in counted if sum(r[k] for r in results) == 0]
    assert counted and not missing, f"no rank overlapped the halo exchange: {missing}"
    # stride-1 convs and a stride-2 conv on even tiles run on the zero-padded tile (no window)
    padded = [k for k in results[0] if k.startswith("ops padded/") and k.split("/")[-1] in ("conv_k3", "conv_k3_d2",
                                                                                             "conv_k4_s2_even")]
    assert padded and all(sum(r[k] for r in results) > 0 for k in padded), padded
    _check([{k: v for k, v in r.items() if not k.startswith("ops ")} for r in results])


def test_halo_overlap_on_and_off_equal_the_unsplit_op() -> None:
    _check_overlap(run_workers(_overlap_worker, 2, ["vertical", "horizontal"], timeout_s=120))


def test_halo_overlap_square_grid_four_ranks() -> None:
    _check_overlap(run_workers(_overlap_worker, 4, ["square"], timeout_s=180))


def _overlap_setting(rank: int, world: int) -> bool:
    from nowdl.runtime.spatial import halo_overlap

    return halo_overlap()


def test_halo_overlap_variable_reaches_ranks_forked_after_import() -> None:
    """NOWDL_HALO_OVERLAP is read when first used, not when nowdl is imported: the test ranks
    are forked from a server that imported nowdl before the variable was given."""
    assert run_workers(_overlap_setting, 2, env={"NOWDL_HALO_OVERLAP": "0"}, init_group=False) == [False, False]
    assert run_workers(_overlap_setting, 2, init_group=False) == [True, True]


@pytest.mark.parametrize("k,s,d,pad,size,parts", [
    (3, 1, 1, 1, 23, 2), (3, 2, 1, 1, 17, 3), (5, 1, 2, 4, 40, 4), (4, 2, 1, 1, 20, 2), (3, 1, 1, 0, 9, 2),
    (2, 2, 1, 0, 16, 2), (7, 3, 1, 3, 50, 5), (3, 1, 1, 1, 4, 4),
])
def test_border_boxes_partition_the_output_tile(k: int, s: int, d: int, pad: int, size: int, parts: int) -> None:
    """Interior + border boxes cover each output pixel once; interior pixels read only this
    tile or padding (so they are final before the halo arrives)."""
    from nowdl.runtime.spatial.tiled_ops import _out_grid, _strided_windows
    from nowdl.runtime.spatial.window_op import border_boxes

    shape = (size, size + 3)
    out_shape = [(n + 2 * pad - d * (k - 1) - 1) // s + 1 for n in shape]
    for coords in [(a, b) for a in range(parts) for b in range(2)]:
        grid = TileGrid(shape, (parts, 2), coords, tuple(range(2 * parts)))
        og = _out_grid(grid, out_shape, "test")
        wins = _strided_windows(grid, og, (k, k), (s, s), (d, d), (pad, pad))
        win = wins[grid.index]
        split = border_boxes(grid, win, ((k, k), (s, s), (d, d)))
        tile_out = og.tile_shape()
        if split is None:  # only when the tile is too thin for any interior output
            assert min(grid.tile_shape()) < d * (k - 1) + 1
            continue
        interior, boxes = split
        cover = torch.zeros(tile_out, dtype=torch.int64)
        for box in [interior, *boxes]:
            cover[box[0][0]:box[0][1], box[1][0]:box[1][1]] += 1
        assert bool((cover == 1).all()), (coords, interior, boxes)
        for dim in range(2):  # the inputs interior outputs read: inside my tile or the padding
            (j0, j1), (w0, _), (t0, t1) = interior[dim], win[dim], grid.tile_bounds()[dim]
            first, last = w0 + j0 * s, w0 + (j1 - 1) * s + d * (k - 1)
            assert first >= t0 or first < 0 or t0 == 0, (coords, dim)
            assert last < t1 or t1 == shape[dim], (coords, dim)


@pytest.mark.parametrize("mode", ["bilinear", "trilinear"])
def test_linear_upsample_tile_holds_two_outputs_at_most(mode: str) -> None:
    """A tile's (bi/tri)linear upsampling interpolates in place: at most 2.5 output tiles live
    at its peak (the composed x0 * (1 - l) + x1 * l held 3.5; ATen's own kernel holds 1), with
    the same values as the composed expression."""
    from nowdl.profiler.memory import AllocTracker
    from nowdl.runtime.spatial.tiled_ops import upsample_tile

    shape = (64, 64) if mode == "bilinear" else (16, 16, 16)
    x = torch.randn(1, 4, *shape)
    up = nn.Upsample(scale_factor=2, mode=mode, align_corners=False)
    grid = TileGrid(shape, (1,) * len(shape), (0,) * len(shape), (0,))
    with AllocTracker() as t:
        y, _ = upsample_tile(x, up, grid)
    assert t.peak <= 2.55 * y.numel() * y.element_size(), t.peak / (y.numel() * y.element_size())
    ref = x
    for i, n in enumerate(shape):  # the composed expression, dim by dim, with ATen's source indices
        src = torch.clamp((torch.arange(2 * n, dtype=torch.float32) + 0.5) * 0.5 - 0.5, min=0)
        i0 = src.long()
        i1 = i0 + (i0 < n - 1).long()
        lam = torch.clamp(src - i0.float(), 0, 1).view((1, 1) + tuple(-1 if j == i else 1 for j in range(len(shape))))
        ref = ref.index_select(2 + i, i0) * (1 - lam) + ref.index_select(2 + i, i1) * lam
    assert torch.equal(y, ref)
