"""Window geometry of tiled ops: pure arithmetic on shapes and modules, no tensors moved.

Shared by the planner (``nowdl.partitioner.search.halo_fusion`` prices halo fusion with
:func:`chain_geometry`) and the runtime (``nowdl.runtime.spatial`` and ``nowdl.runtime.spatial.fusion``
run the ops), so it sits below both as a leaf module: it imports only torch.

* :func:`split_bounds`: how a dim of ``size`` pixels is cut into tiles (the first
  ``size % parts`` tiles are one pixel larger).
* conv/pool output sizes and paddings (``conv_pads``, ``pool_out_size``, ``ntuple``), and the
  pointwise modules a tile runs as they are (``POINTWISE``).
* halo fusion (see :mod:`nowdl.runtime.spatial.fusion` for the exactness argument): which modules can
  sit in a fused run (:func:`fusable`), each op's window along each dim walked back from the
  final output tile (``chain_steps``, ``_walk``, ``chain_windows``), and what fusing a run costs
  (:func:`chain_geometry`). Along each spatial dim, from the last op back::

    op j output region [o0, o1)  ->  op j input window W = [o0*s - lo, (o1 - 1)*s - lo + d*(k - 1) + 1)
                                     op j-1 output region = W clipped to [0, size of that tensor)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["TileTooSmallError", "split_bounds", "ntuple", "conv_pads", "pool_out_size", "POINTWISE", "Span", "fusable",
           "ChainStep", "flatten_sequential", "chain_steps", "chain_windows", "chain_geometry"]


class TileTooSmallError(ValueError):
    """A tile is too small for the halo or output split an op needs."""


def split_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of tile ``index`` when ``size`` pixels are cut into ``parts`` tiles.

    The first ``size % parts`` tiles get one extra pixel, so tiles differ by at most one.
    """
    if parts < 1:
        raise ValueError(f"cannot cut a dim of size {size} into {parts} tiles (need >= 1)")
    if not 0 <= index < parts:
        raise IndexError(f"tile index {index} is outside a dim cut into {parts} tiles")
    base, rem = divmod(size, parts)
    start = index * base + min(index, rem)
    return start, start + base + (1 if index < rem else 0)


def ntuple(v: Any, n: int) -> tuple[int, ...]:
    """``v`` (a module's kernel_size, stride, ...) as ``n`` ints: ``n`` values as given, or one repeated."""
    if isinstance(v, (tuple, list)):
        if len(v) != n:
            raise ValueError(f"expected {n} values, got {tuple(v)}")
        return tuple(int(x) for x in v)
    return (int(v),) * n


def conv_pads(conv: nn.Module, n: int, k: Sequence[int], d: Sequence[int]) -> list[tuple[int, int]]:
    """``(before, after)`` zero padding of ``conv`` per spatial dim (numbers, 'same' or 'valid'),
    given its kernel ``k`` and dilation ``d``."""
    p = conv.padding
    if p == "valid":
        return [(0, 0)] * n
    if p == "same":
        out = []
        for i in range(n):
            total = d[i] * (k[i] - 1)
            out.append((total // 2, total - total // 2))
        return out
    return [(q, q) for q in ntuple(p, n)]


def pool_out_size(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    """Output size of a pooling along one dim, as torch computes it (``ceil_mode`` included)."""
    num = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil else 0)
    out = num // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


POINTWISE: tuple[type, ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Identity,
    nn.PReLU, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
)
"""Modules a tile runs as they are: each output pixel reads only the same input pixel."""


# ------------------------------------------------------------------------------------------
# halo fusion: which runs fuse, and their windows

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_MAXPOOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)
_AVGPOOLS = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
_NDIM: dict[type, int] = {t: i + 1 for ts in (_CONVS, _MAXPOOLS, _AVGPOOLS) for i, t in enumerate(ts)}

Span = tuple[int, int]
"""``[start, stop)`` along one dim, in the coordinates of one (intermediate) image."""


def _stochastic(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.dropout._DropoutNd) and module.training and module.p > 0


def fusable(module: nn.Module) -> bool:
    """Whether ``module`` can sit inside a fused run (:func:`fused_forward`).

    True for Conv1d/2d/3d with zero padding, MaxPool (without indices), AvgPool and the
    pointwise modules (``POINTWISE``); an ``nn.Sequential`` when all its children
    are. False for norms (statistics need exact tiles), upsampling, transposed convs, and
    dropout in training mode (it is fine at the start of a run, before the first conv/pool,
    which :func:`fused_forward` accepts).
    """
    if isinstance(module, nn.Sequential):
        return all(fusable(m) for m in module)
    if isinstance(module, _CONVS):
        return module.padding_mode == "zeros"
    if isinstance(module, _MAXPOOLS):
        return not module.return_indices
    if isinstance(module, _AVGPOOLS):
        return True
    if _stochastic(module):
        return False
    return isinstance(module, POINTWISE)


# ------------------------------------------------------------------------------------------
# geometry


@dataclass(frozen=True)
class ChainStep:
    """One op of a fused run: its kind and window parameters, its full in/out spatial shapes."""

    module: nn.Module
    kind: str  # "conv" | "max" | "avg" | "point"
    k: tuple[int, ...]
    s: tuple[int, ...]
    d: tuple[int, ...]
    lo: tuple[int, ...]  # padding before the image, per dim
    pad: tuple[int, ...]  # avg pool: symmetric padding (the divisor's bounds)
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    @property
    def windowed(self) -> bool:
        return self.kind != "point"


def flatten_sequential(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """``modules`` in order, every (nested) ``nn.Sequential`` replaced by its children."""
    out: list[nn.Module] = []
    for m in modules:
        out.extend(flatten_sequential(m) if isinstance(m, nn.Sequential) else [m])
    return out


def _name(j: int, m: nn.Module) -> str:
    return f"#{j} {type(m).__name__}"


def chain_steps(modules: Sequence[nn.Module], shape: Sequence[int], grid: Sequence[int], where: str) -> list[ChainStep]:
    """The run's ops with every intermediate full spatial shape; validates the chain."""
    n = len(shape)
    cur = tuple(int(v) for v in shape)
    steps: list[ChainStep] = []
    seen_windowed = False
    for j, m in enumerate(modules):
        name = _name(j, m)
        ones = (1,) * n
        nd = _NDIM.get(type(m)) or next((v for t, v in _NDIM.items() if isinstance(m, t)), n)
        if nd != n:
            raise ValueError(
                f"{where}: {name} works on {nd} spatial dims but the tiles have {n} "
                f"(image {tuple(shape)}); use a {n}D op or tile a {nd}D tensor"
            )
        if isinstance(m, _CONVS):
            if m.padding_mode != "zeros":
                raise NotImplementedError(
                    f"{where}: {name}(padding_mode={m.padding_mode!r}) is not fusable (only 'zeros'); "
                    f"end the fused run before it"
                )
            k, s, d = ntuple(m.kernel_size, n), ntuple(m.stride, n), ntuple(m.dilation, n)
            pads = conv_pads(m, n, k, d)
            out = tuple((cur[i] + pads[i][0] + pads[i][1] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(n))
            step = ChainStep(m, "conv", k, s, d, tuple(p[0] for p in pads), ones, cur, out)
        elif isinstance(m, _MAXPOOLS + _AVGPOOLS):
            is_max = isinstance(m, _MAXPOOLS)
            if is_max and m.return_indices:
                raise NotImplementedError(f"{where}: {name}(return_indices=True) is not fusable (indices are tile-local)")
            k = ntuple(m.kernel_size, n)
            s = ntuple(m.stride if m.stride not in (None, (), []) else m.kernel_size, n)
            p = ntuple(m.padding, n)
            d = ntuple(getattr(m, "dilation", 1), n) if is_max else ones
            out = tuple(pool_out_size(cur[i], k[i], s[i], p[i], d[i], bool(m.ceil_mode)) for i in range(n))
            step = ChainStep(m, "max" if is_max else "avg", k, s, d, p, p, cur, out)
        elif isinstance(m, POINTWISE):
            if _stochastic(m) and seen_windowed:
                raise NotImplementedError(
                    f"{where}: {name}(p={getattr(m, 'p', None)}) in training mode after the first conv/pool "
                    f"of a fused run would drop overlapping pixels differently on each rank; end the fused "
                    f"run before it, move it before the first conv/pool, or put it in eval mode"
                )
            step = ChainStep(m, "point", ones, ones, ones, (0,) * n, (0,) * n, cur, cur)
        else:
            raise NotImplementedError(
                f"{where}: {name} is not fusable (conv, max/avg pool and pointwise ops are; norms, "
                f"upsampling and transposed convs need exact tiles); end the fused run before it "
                f"and run it with tile_forward"
            )
        for i in range(n):
            if step.out_shape[i] < int(grid[i]):
                raise TileTooSmallError(
                    f"{where}: {name} turns spatial dim {i} of size {cur[i]} into {step.out_shape[i]}, which "
                    f"cannot be cut into {grid[i]} tiles (run input {tuple(shape)}); use fewer parts or "
                    f"end the spatial region before this op"
                )
        seen_windowed = seen_windowed or step.windowed
        steps.append(step)
        cur = step.out_shape
    return steps


def _clip(w: Span, size: int) -> Span:
    a = min(max(w[0], 0), size)
    return a, max(a, min(w[1], size))


def _walk(steps: Sequence[ChainStep], i: int, out: Span) -> list[tuple[Span, Span]]:
    """Per step along dim ``i``: (unclipped input window, clipped input region) for the final
    output region ``out``. An empty output region gives an empty window."""
    res: list[tuple[Span, Span]] = [((0, 0), (0, 0))] * len(steps)
    o0, o1 = out
    for j in range(len(steps) - 1, -1, -1):
        st = steps[j]
        if not st.windowed:
            w = (o0, o1)
        elif o1 <= o0:
            w = (o0 * st.s[i] - st.lo[i],) * 2
        else:
            w = (o0 * st.s[i] - st.lo[i], (o1 - 1) * st.s[i] - st.lo[i] + st.d[i] * (st.k[i] - 1) + 1)
        r = _clip(w, st.in_shape[i])
        res[j] = (w, r)
        o0, o1 = r
    return res


def chain_windows(steps: Sequence[ChainStep], out_shape: Sequence[int],
           grid: Sequence[int]) -> list[list[list[tuple[Span, Span]]]]:
    """``plans[dim][coord][step]``: every tile's windows and regions, per dim, for the final
    output ``out_shape`` cut into ``grid`` tiles."""
    return [
        [_walk(steps, i, split_bounds(out_shape[i], grid[i], c)) for c in range(grid[i])]
        for i in range(len(grid))
    ]


def chain_geometry(modules: Sequence[nn.Module], shape: Sequence[int], grid: Sequence[int]) -> dict[str, Any]:
    """What fusing ``modules`` costs on a ``shape`` image cut into ``grid`` tiles (pure).

    ``grid`` may be shorter than ``shape`` (leading dims uncut). Returns:

    * ``halo``: per spatial dim ``(lo, hi)``, the deepest part of the fused window fetched from
      other tiles (in-image, beyond the tile), over all tiles; ``(0, 0)`` along uncut dims.
    * ``exchanges_unfused``: exchanges of the unfused chain (one per conv/pool).
    * ``exchanges_fused``: 1 (0 for a pointwise-only chain).
    * ``extra_fraction``: for the worst (usually an interior) tile, output elements of the
      chain's conv/pool ops computed beyond its exact output tiles, over those exact tiles'
      elements (spatial only; 0 for a single windowed op).

    Raises the same errors as :func:`fused_forward`.
    """
    shp = tuple(int(v) for v in shape)
    gd = (1,) * (len(shp) - len(grid)) + tuple(int(g) for g in grid)
    if len(gd) != len(shp) or any(g < 1 for g in gd):
        raise ValueError(
            f"chain_geometry: grid {tuple(grid)} does not fit shape {shp}: it needs at most one "
            f"entry per spatial dim, each at least one tile"
        )
    steps = chain_steps(flatten_sequential(modules), shp, gd, "chain_geometry")
    windowed = [j for j, st in enumerate(steps) if st.windowed]
    n = len(shp)
    if not windowed:
        return {"halo": ((0, 0),) * n, "exchanges_unfused": 0, "exchanges_fused": 0, "extra_fraction": 0.0}
    plans = chain_windows(steps, steps[-1].out_shape, gd)
    first = windowed[0]
    halo: list[tuple[int, int]] = []
    for i in range(n):
        lo = hi = 0
        for c in range(gd[i]):
            t0, t1 = split_bounds(shp[i], gd[i], c)
            r0, r1 = plans[i][c][first][1]  # the in-image part of the fetched window
            lo, hi = max(lo, t0 - r0), max(hi, r1 - t1)
        halo.append((lo, hi))
    extra = 0.0
    for cs in itertools.product(*(range(g) for g in gd)):  # every tile, row-major
        computed = exact = 0
        for j in windowed:
            out = steps[j].out_shape
            tile = math.prod(b - a for a, b in (split_bounds(out[i], gd[i], cs[i]) for i in range(n)))
            exact += tile
            if j + 1 < len(steps):
                computed += math.prod(plans[i][cs[i]][j + 1][1][1] - plans[i][cs[i]][j + 1][1][0] for i in range(n))
            else:
                computed += tile
        if exact:
            extra = max(extra, computed / exact - 1.0)
    return {
        "halo": tuple(halo),
        "exchanges_unfused": len(windowed),
        "exchanges_fused": 1,
        "extra_fraction": extra,
    }
