"""Property: random stacks of conv, transposed conv, pool, upsample and norm ops (random kernels,
strides, dilations, paddings, odd sizes, tile counts and slice shapes, 2D and 3D) give, run on
tiles by :class:`nowdl.runtime.spatial.stage.TiledStage` (what the runtime runs for a spatial
stage), the same forward output, input gradient, weight gradients and running statistics as the
untiled stack (float64, 1e-9), or are refused naming the op: by the planner's spatial rules
when the stage is built, or as a tile too small for the op.

Hypothesis draws the cases here; one group of 4 gloo ranks runs them all (a process group per
case would cost seconds each), with tile groups of 2, 3 and 4 ranks.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.fx as fx
from helpers.distributed import run_workers
from helpers.properties import count, examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from nowdl.errors import NowdlError
from nowdl.geometry import TileTooSmallError
from nowdl.partitioner.spatial.tileable import slice_grid

TOL = 1e-9
D64 = torch.float64
Op = tuple[str, dict[str, Any]]
Case = dict[str, Any]


@st.composite
def _op(draw: st.DrawFn, dims: int, c: int) -> tuple[Op, int]:
    kind = draw(st.sampled_from(["conv", "conv", "pool", "up", "convT", "norm", "relu", "refused"]))
    if kind == "conv":
        k, s, d = draw(st.integers(1, 5)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
        out = draw(st.integers(1, 4))
        groups = c if out == c and draw(st.booleans()) else 1
        return ("conv", {"c": c, "out": out, "k": k, "s": s, "d": d, "p": draw(st.integers(0, (d * (k - 1)) // 2 + 1)),
                         "groups": groups, "bias": draw(st.booleans())}), out
    if kind == "pool":
        k = draw(st.integers(1, 3))
        mx = draw(st.booleans())
        return ("pool", {"max": mx, "k": k, "s": draw(st.integers(1, 3)), "p": draw(st.integers(0, k // 2)),
                         "d": draw(st.integers(1, 2)) if mx else 1, "ceil": draw(st.booleans()),
                         "incl": draw(st.booleans())}), c
    if kind == "up":
        mode = draw(st.sampled_from(["nearest", "nearest-exact", "linear"]))
        scale = draw(st.sampled_from([2, 3] if mode != "nearest-exact" else [1.5, 2]))
        return ("up", {"mode": mode, "scale": scale, "ac": mode == "linear" and draw(st.booleans())}), c
    if kind == "convT":
        k, s = draw(st.integers(1, 4)), draw(st.integers(1, 3))
        out = draw(st.integers(1, 3))
        return ("convT", {"c": c, "out": out, "k": k, "s": s, "p": draw(st.integers(0, k - 1)),
                          "op": draw(st.integers(0, s - 1))}), out
    if kind == "norm":
        which = draw(st.sampled_from(["batch", "group", "instance"]))
        return ("norm", {"which": which, "c": c, "groups": draw(st.sampled_from([1, c])),
                         "track": draw(st.booleans())}), c
    if kind == "relu":
        return ("relu", {}), c
    # ops the planner does not tile: the stage must be refused, naming them
    return ("refused", {"c": c, "what": draw(st.sampled_from(["reflect", "bicubic"] if dims == 2 else ["reflect"]))}), c


def build(case: Case) -> nn.Sequential:
    """The stack of a case (seeded: every rank builds the same weights)."""
    torch.manual_seed(case["seed"])
    n = case["dims"]
    conv, convT, bn, inorm = ((nn.Conv2d, nn.ConvTranspose2d, nn.BatchNorm2d, nn.InstanceNorm2d) if n == 2
                              else (nn.Conv3d, nn.ConvTranspose3d, nn.BatchNorm3d, nn.InstanceNorm3d))
    mods: list[nn.Module] = []
    for kind, a in case["ops"]:
        if kind == "conv":
            mods.append(conv(a["c"], a["out"], a["k"], a["s"], a["p"], a["d"], a["groups"], a["bias"]))
        elif kind == "convT":
            mods.append(convT(a["c"], a["out"], a["k"], a["s"], a["p"], a["op"]))
        elif kind == "pool" and a["max"]:
            mods.append((nn.MaxPool2d if n == 2 else nn.MaxPool3d)(a["k"], a["s"], a["p"], a["d"], ceil_mode=a["ceil"]))
        elif kind == "pool":
            mods.append((nn.AvgPool2d if n == 2 else nn.AvgPool3d)(a["k"], a["s"], a["p"], ceil_mode=a["ceil"],
                                                                   count_include_pad=a["incl"]))
        elif kind == "up":
            mode = {2: "bilinear", 3: "trilinear"}[n] if a["mode"] == "linear" else a["mode"]
            mods.append(nn.Upsample(scale_factor=a["scale"], mode=mode, align_corners=a["ac"] if a["mode"] == "linear"
                                    else None))
        elif kind == "norm" and a["which"] == "batch":
            mods.append(bn(a["c"], track_running_stats=a["track"]))
        elif kind == "norm" and a["which"] == "group":
            mods.append(nn.GroupNorm(a["groups"], a["c"]))
        elif kind == "norm":
            mods.append(inorm(a["c"], affine=True, track_running_stats=a["track"]))
        elif kind == "relu":
            mods.append(nn.ReLU())
        elif a["what"] == "reflect":
            mods.append(conv(a["c"], a["c"], 3, padding=1, padding_mode="reflect"))
        else:
            mods.append(nn.Upsample(scale_factor=2, mode="bicubic", align_corners=False))
    return nn.Sequential(*mods).to(D64)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    dims = draw(st.sampled_from([2, 2, 3]))
    method, parts = draw(st.sampled_from([("vertical", 2), ("horizontal", 2), ("vertical", 3), ("horizontal", 3),
                                          ("square", 4)] if dims == 2 else
                                         [("depth", 2), ("depth", 3), ("vertical", 2), ("square", 4)]))
    c = draw(st.integers(1, 3))
    ops: list[Op] = []
    for _ in range(draw(st.integers(1, 4))):
        op, c = draw(_op(dims, c))
        ops.append(op)
    size = [draw(st.integers(4, 21 if dims == 2 else 9)) for _ in range(dims)]
    case = {"dims": dims, "method": method, "parts": parts, "batch": draw(st.integers(1, 2)),
            "cin": ops[0][1].get("c", c) if ops else c, "size": size, "ops": ops, "seed": draw(st.integers(0, 999))}
    case["cin"] = _in_channels(ops, c)
    return case


def _in_channels(ops: list[Op], last: int) -> int:
    for _, a in ops:
        if "c" in a:
            return int(a["c"])
    return last


def _runs(case: Case) -> bool:
    """The untiled stack runs on the case's input (else hypothesis draws another case)."""
    try:
        with torch.no_grad():
            y = build(case)(torch.zeros(case["batch"], case["cin"], *case["size"], dtype=D64))
    except (RuntimeError, ValueError):
        return False
    return y.numel() > 0 and all(s >= 1 for s in y.shape[2:])


def _rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    a, b = a.detach().to(D64), b.detach().to(D64)
    if a.shape != b.shape:
        return math.inf
    # relative to the reference's largest value, with a floor of 1e-3: the values here are O(1)
    # and some are zero but for rounding (the bias gradient of a norm feeding a norm, the running
    # mean of normalised data), which only an absolute comparison can judge
    scale = max(float(b.abs().max()) if b.numel() else 0.0, 1e-3)
    return float((a - b).abs().max()) / scale if a.numel() else 0.0


def _run_case(case: Case, rank: int, group: Any, ranks: list[int]) -> tuple[str, Any]:
    from nowdl.codegen.stage import StageModule
    from nowdl.runtime.spatial import sum_weight_grads
    from nowdl.runtime.spatial.stage import TiledStage

    ref_mod = build(case)
    gm = fx.symbolic_trace(copy.deepcopy(ref_mod))
    out_name = [n for n in gm.graph.nodes if n.op == "output"][0].args[0].name
    stage = StageModule(index=0, module=gm, inputs=["x"], outputs=[out_name])
    grid_dims = slice_grid(case["method"], case["parts"], case["dims"])
    try:
        tiled = TiledStage(stage, grid_dims, ranks, rank, group)
    except NowdlError as e:
        return "refused", str(e)
    torch.manual_seed(case["seed"] + 1)
    x = torch.randn(case["batch"], case["cin"], *case["size"], dtype=D64)
    xr = x.clone().requires_grad_(True)
    ref = ref_mod(xr)
    g = torch.randn(ref.shape, dtype=D64)
    ref.backward(g)
    grid = tiled.grid_of(case["size"])
    xt = grid.split(x).clone().requires_grad_(True)
    try:
        (yt,), (og,) = tiled([xt], [case["size"]])
    except TileTooSmallError as e:
        return "too small", str(e)
    yt.backward(og.split(g))
    sum_weight_grads(gm, group)
    errs = [_rel(yt, og.split(ref)), _rel(xt.grad, grid.split(xr.grad))]  # type: ignore[arg-type]
    errs += [_rel(q.grad, p.grad) for p, q in zip(ref_mod.parameters(), gm.parameters(), strict=True)]
    errs += [_rel(b, a) for a, b in zip(ref_mod.buffers(), gm.buffers(), strict=True)]
    return "ok", max(errs, default=0.0)


def _worker(rank: int, world: int, all_cases: list[Case]) -> list[tuple[int, str, Any]]:
    import torch.distributed as dist

    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: None}
    out = []
    for i, case in enumerate(all_cases):
        parts = case["parts"]
        if rank < parts:
            out.append((i, *_run_case(case, rank, groups[parts], list(range(parts)))))
    return out


def _names_an_op(case: Case, msg: str) -> bool:
    names = {type(m).__name__ for m in build(case)} | {str(i) for i in range(len(case["ops"]))}
    return any(n in msg for n in names)


DRAWN: list[Case] = []


@settings(max_examples=examples(90))
@given(cases())
def _draw(case: Case) -> None:
    if _runs(case):
        DRAWN.append(case)


def test_tiled_stacks_equal_the_untiled_stack_or_are_refused() -> None:
    DRAWN.clear()
    _draw()
    assert len(DRAWN) >= examples(90) // 2, len(DRAWN)  # most drawn stacks are valid networks
    results = run_workers(_worker, 4, DRAWN, timeout_s=600)
    bad, kinds = [], {"ok": 0, "refused": 0, "too small": 0}
    for rank, res in enumerate(results):
        for i, kind, val in res:
            kinds[kind] += rank == 0
            case = DRAWN[i]
            if kind == "ok" and not val <= TOL:
                bad.append(f"rank {rank}: error {val:.3g} for {case}")
            elif kind != "ok" and not _names_an_op(case, str(val)):
                bad.append(f"rank {rank}: {kind} without naming the op ({val}) for {case}")
            elif kind == "refused" and not any(op[0] == "refused" for op in case["ops"]):
                bad.append(f"rank {rank}: a tileable stack was refused ({val}) for {case}")
            elif kind == "ok" and any(op[0] == "refused" for op in case["ops"]):
                bad.append(f"rank {rank}: an untileable op ran on tiles for {case}")
        if rank == 0:
            assert len(res) == len(DRAWN)
    for _ in DRAWN:
        count("tiled stacks")
    for kind, n in kinds.items():
        for _ in range(n):
            count(f"tiled stacks ({kind})")
    assert not bad, "\n".join(bad[:10])
