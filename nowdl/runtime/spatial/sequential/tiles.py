"""Sequential tiles: a spatial stage runs T tiles one after another on each GPU, exactly.

[Note: sequential tiles] A spatial stage with ``parts = P`` and ``tiles_per_gpu = T`` cuts the
image into P x T tiles. The plan's ``grid`` gives each GPU's region (as without sequential
tiles); each GPU region is cut again into T *sub-tiles* along the dims the grid cuts (along
every spatial dim when P = 1). T's prime factors go, largest first, to the cut dim whose
sub-tiles are then the longest (T = 4 on a 2 x 2 grid: 2 x 2 sub-tiles per GPU; on a 1 x 2
grid: 1 x 4; on one GPU of a 64 x 64 image: 2 x 2)::

    P = 2 (grid 1 x 2), T = 2                  each sub-tile's window: its region plus the
    +-------+-------+-------+-------+          stage's reach (clipped at the image border,
    | g0 s0 | g0 s1 | g1 s0 | g1 s1 |          aligned to the stage's strides)
    +-------+-------+-------+-------+               [=====|  g0 s1  |=====)

Streaming-CNN-like, every sub-tile runs the WHOLE stage (the plain fx module, not the tiled
ops) on a window of the stage's inputs: its region plus a margin of the stage's reach on every
cut side ([Note: stage reach] in :mod:`nowdl.runtime.spatial.reach`), and keeps only its
region of every output. The margin's values come from the GPU's own input tile and, across
GPUs, from ONE deep halo exchange per stage input (:func:`fetch_window`: the GPU's window is the
union of its sub-tiles' windows). Sub-tiles overlap only in their margins; a pixel computed near
a cut edge of a window may be wrong (the window's zero padding is not the image) and is never
kept: every kept output pixel is computed from the same input values by the same ops as on the
whole image, so forward and backward are exact (float64: to rounding).

The forward keeps no activations (each sub-tile runs under ``no_grad``); only the GPU's input
window and output tiles stay between forward and backward. The backward recomputes each
sub-tile with autograd, seeds it with its region of the output gradient, and sums the window
gradients (overlapping margins add up) and the weight gradients over the sub-tiles (returned
once, then summed over the tile group); the halo part of the input gradient goes back to the
neighbouring GPUs. Autocast is re-entered in the recomputation. BatchNorm (training),
InstanceNorm and GroupNorm normalise every sub-tile with the whole image's statistics, gathered
in statistics passes ([Note: sequential norms]) or layer-wise from host memory ([Note:
layer-wise norms], [Note: layer-wise backward]; the plan's ``norm_schedule``); predict's
statistics passes over an image's windows take them over the whole image instead ([Note:
sequential tiles in statistics passes] in ``seq_stream``). Dropout draws masks keyed by image
coordinates, the same in every pass and margin ([Note: keyed dropout] in
:mod:`nowdl.runtime.spatial.dropout`). Alpha dropout, global pooling and norm modules of other
types are refused when the stage is built (:func:`nowdl.runtime.spatial.reach.refuse_sequential`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nowdl.codegen.stage import StageModule
from nowdl.errors import NowdlError
from nowdl.geometry import split_bounds
from nowdl.runtime.spatial.dropout import draw_seeds, keyed_graph
from nowdl.runtime.spatial.exchange import Window, fetch_window
from nowdl.runtime.spatial.precision import autocast_off
from nowdl.runtime.spatial.reach import node_reach, refuse_sequential, stage_reach
from nowdl.runtime.spatial.sequential.step import SubTilesRun, extent
from nowdl.runtime.spatial.statistics import seq_norms as sn
from nowdl.runtime.spatial.statistics.seq_stream import StreamHook, stream_forward
from nowdl.runtime.spatial.tiles import TileGrid

__all__ = ["SequentialTiles", "grid_index", "sub_grid"]

Slices = tuple[slice, ...]


def sub_grid(grid: Sequence[int], shape: Sequence[int], tiles: int) -> tuple[int, ...]:
    """Sub-tiles per spatial dim of each GPU region (product ``tiles``): T's prime factors, largest
    first, each to the cut dim (grid > 1; every spatial dim if none is cut) with the longest
    sub-tiles (ties: the first such dim)."""
    cut = [d for d, g in enumerate(grid) if g > 1] or list(range(len(grid)))
    factors: list[int] = []
    t, p = tiles, 2
    while t > 1:
        while t % p == 0:
            factors.append(p)
            t //= p
        p += 1
    counts = [1] * len(grid)
    for f in sorted(factors, reverse=True):
        d = max(cut, key=lambda i: (shape[i] / (grid[i] * counts[i]), -i))
        counts[d] *= f
    return tuple(counts)


@dataclass(frozen=True)
class _Sub:
    ins: tuple[Slices, ...]  # per input: its part of the GPU window
    outs: tuple[tuple[Slices, Slices], ...]  # per output: (crop of the window's output, place in the tile)
    chunks: dict[str, Slices]  # per norm: its chunk of the norm's input on the window ([Note: sequential norms])
    origins: dict[str, tuple[int, ...]]  # per keyed dropout: the window's start on the image ([Note: keyed dropout])
    spans: dict[str, tuple[tuple[int, int], ...]]  # per norm: its chunk in the stage's pixels at the norm's resolution


@dataclass(frozen=True)
class _Layout:
    in_windows: tuple[tuple[Window, ...], ...]  # per input: every GPU's window
    out_shapes: tuple[tuple[int, ...], ...]
    heads: tuple[tuple[int, ...], ...]  # per output: (N, C) of the traced shape
    subs: tuple[_Sub, ...]
    norm_sizes: dict[str, tuple[int, ...]]  # per norm: its input's spatial size on the whole image


def _box(spans: Sequence[tuple[int, int]]) -> Slices:
    return (slice(None), slice(None)) + tuple(slice(a, b) for a, b in spans)


class SequentialTiles:
    """Runs a spatial stage as T sequential sub-tiles per GPU ([Note: sequential tiles]).

    Args:
        stage: the stage (its fx module runs whole on each sub-tile's window).
        grid: the plan's tile grid (GPUs per spatial dim).
        ranks, rank, group: the tile group (as :class:`nowdl.runtime.spatial.stage.TiledStage`).
        tiles_per_gpu: T, the sub-tiles each GPU runs one after another.
        norm_schedule: "passes" ([Note: sequential norms]) or "layerwise" ([Note: layer-wise norms]).

    Raises:
        NowdlError: a node cannot run on sequential tiles (named, with the fix).
    """

    def __init__(self, stage: StageModule, grid: Sequence[int], ranks: Sequence[int], rank: int,
                 group: dist.ProcessGroup | None, tiles_per_gpu: int, norm_schedule: str = "passes") -> None:
        if tiles_per_gpu < 1:
            raise NowdlError(f"stage {stage.index}: tiles_per_gpu={tiles_per_gpu} must be >= 1")
        if norm_schedule not in ("passes", "layerwise"):
            raise NowdlError(f"stage {stage.index}: norm_schedule={norm_schedule!r} is neither 'passes' nor 'layerwise'")
        self.norm_schedule = norm_schedule
        refuse_sequential(stage.module, stage.index, tiles_per_gpu)
        self.stage, self.grid, self.ranks, self.rank, self.group = stage, tuple(grid), tuple(ranks), rank, group
        self.tiles = tiles_per_gpu
        self.module, self.keyed = keyed_graph(stage.module)  # dropout keyed by image coordinates
        self.params = [p for p in stage.module.parameters() if p.requires_grad]
        self._layouts: dict[Any, _Layout] = {}
        self.norms = {n.name: stage.module.get_submodule(str(n.target)) for n in stage.module.graph.nodes
                      if n.name in set(sn.seq_norm_nodes(stage.module))}
        self._levels: dict[frozenset[str], Any] = {}  # active norms -> their NormLevels
        self.external: StreamHook | None = None  # predict's statistics passes ([Note: sequential tiles in statistics passes])
        self.host_meter = [0, 0]  # bytes kept in host memory now and at most ([Note: layer-wise norms])

    def _grid(self, n: int) -> tuple[int, ...]:
        return (1,) * (n - len(self.grid)) + self.grid

    def __call__(self, tiles: Sequence[Tensor], shapes: Sequence[Sequence[int]]) -> tuple[list[Tensor], list[TileGrid]]:
        """The stage's output tiles of this GPU (and their grids) from its input tiles."""
        n = len(shapes[0])
        grid = self._grid(n)
        key = tuple((tuple(t.shape[:2]), tuple(s)) for t, s in zip(tiles, shapes, strict=True))
        if key not in self._layouts:
            self._layouts[key] = self._layout(tiles, [tuple(int(v) for v in s) for s in shapes])
        lay = self._layouts[key]
        wins = []
        for t, shape, ws in zip(tiles, shapes, lay.in_windows, strict=True):
            g = TileGrid.for_rank(shape, grid, self.rank, self.ranks)
            wins.append(fetch_window(t, g, ws, self.group))
        hook = self.external
        if hook is not None and hook.current > 0:
            with torch.no_grad():
                outs = stream_forward(self.stage.module, hook, lay.subs, wins, lay.heads,
                                      [extent(lay, o, self) for o in range(len(lay.out_shapes))], lay.norm_sizes)
        else:
            seeds = draw_seeds(self.keyed, self.ranks, self.group, tiles[0].device) if self.keyed else {}
            outs = SubTilesRun.apply(self, lay, seeds, len(wins), *wins, *self.params)
        ogrids = [TileGrid.for_rank(s, grid, self.rank, self.ranks) for s in lay.out_shapes]
        return list(outs), ogrids

    # ------------------------------------------------------------------------------------------
    # geometry

    def norm_passes(self, lay: _Layout) -> sn.NormPasses | None:
        """The statistics passes' state for one micro-batch (None: no norm takes image statistics now)."""
        gm = self.stage.module
        active = frozenset(n for n, m in self.norms.items() if sn.image_stats(m))
        if not active:
            return None
        if active not in self._levels:
            self._levels[active] = sn.norm_levels(gm, sorted(active))
        return sn.NormPasses(gm, self._levels[active], [sub.chunks for sub in lay.subs], lay.norm_sizes, self.group,
                          len(self.ranks) == 1)

    def _out_shapes(self, tiles: Sequence[Tensor], shapes: Sequence[tuple[int, ...]]
                    ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]], dict[str, tuple[int, ...]]]:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with torch.no_grad(), autocast_off(tiles[0]), FakeTensorMode(allow_non_fake_inputs=True):  # shapes only
            fake = [torch.empty((1, t.shape[1]) + s, dtype=t.dtype) for t, s in zip(tiles, shapes, strict=True)]
            run = sn.ShapeRun(self.stage.module, list(self.norms))
            outs = run.run(*fake)
        return ([tuple(int(v) for v in o.shape[2:]) for o in outs], [tuple(int(v) for v in o.shape[:2]) for o in outs],
                run.sizes)

    def _layout(self, tiles: Sequence[Tensor], shapes: Sequence[tuple[int, ...]]) -> _Layout:
        n = len(shapes[0])
        grid = self._grid(n)
        ref = tuple(max(s[d] for s in shapes) for d in range(n))
        in_f = [tuple(self._ratio(r, v, "input") for r, v in zip(ref, s, strict=True)) for s in shapes]
        reach = stage_reach(self.stage.module, [tuple(Fraction(f) for f in fs) for fs in in_f])
        n_scale, n_reach, _ = node_reach(self.stage.module, [tuple(Fraction(f) for f in fs) for fs in in_f])
        out_shapes, heads, norm_sizes = self._out_shapes(tiles, shapes)
        for s, f in zip(out_shapes, reach.out_scale, strict=True):
            if any(abs(Fraction(r) / fd - v) >= 1 for r, fd, v in zip(ref, f, s, strict=True)):
                raise NowdlError(f"stage {self.stage.index}: an output of spatial shape {s} is not the input {ref} "
                                 f"scaled by {[str(x) for x in f]} (an op crops or pads the image): sequential tiles "
                                 "cannot place it; use tiles_per_gpu=1 for this stage")
        sub = sub_grid(grid, ref, self.tiles)
        gpu_wins: list[tuple[tuple[int, int], ...]] = []
        mine: list[tuple[tuple[tuple[int, int], ...], list[list[tuple[int, int]]], dict[str, list[tuple[int, int]]]]] = []
        me = TileGrid.for_rank(ref, grid, self.rank, self.ranks).coords
        for cq in TileGrid.for_rank(ref, grid, self.ranks[0], self.ranks).all_coords():
            boxes = []
            for cj in TileGrid(tuple(sub), tuple(sub), (0,) * n, tuple(range(math.prod(sub)))).all_coords():
                regions = [[self._region(s[d], grid[d], cq[d], sub[d], cj[d]) for d in range(n)] for s in out_shapes]
                chunks = {nm: [_chunk(sz[d], grid[d], cq[d], sub[d], cj[d]) for d in range(n)]
                          for nm, sz in norm_sizes.items()}
                needs = [(chunks[nm], n_scale[nm], n_reach[nm]) for nm in norm_sizes]
                win = tuple(self._window(d, ref[d], regions, reach, needs) for d in range(n))
                boxes.append(win)
                if cq == me:
                    mine.append((win, [list(r) for r in regions], chunks))
            gpu_wins.append(tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(n)))
        in_windows = tuple(tuple(tuple(self._to_input(w[d], ref[d], f[d], s[d]) for d in range(n)) for w in gpu_wins)
                           for f, s in zip(in_f, shapes, strict=True))
        my_win = [iw[grid_index(me, grid)] for iw in in_windows]
        subs = []
        for win, regions, chunks in mine:
            ins = tuple(_box([(a - w0, b - w0) for (a, b), (w0, _) in zip(
                [self._to_input(win[d], ref[d], f[d], s[d]) for d in range(n)], gw, strict=True)])
                for f, s, gw in zip(in_f, shapes, my_win, strict=True))
            outs = []
            for o, (s, f) in enumerate(zip(out_shapes, reach.out_scale, strict=True)):
                start = [Fraction(win[d][0]) / f[d] for d in range(n)]
                if any(v.denominator != 1 for v in start):
                    raise NowdlError(f"stage {self.stage.index}: a window starting at {[w[0] for w in win]} does not "
                                     f"start on a whole pixel of output {o}: use tiles_per_gpu=1 for this stage")
                tile = TileGrid.for_rank(s, grid, self.rank, self.ranks).tile_bounds()
                crop = _box([(a - int(st), b - int(st)) for (a, b), st in zip(regions[o], start, strict=True)])
                place = _box([(a - t0, b - t0) for (a, b), (t0, _) in zip(regions[o], tile, strict=True)])
                outs.append((crop, place))
            subs.append(_Sub(ins, tuple(outs), {nm: self._in_window(nm, ch, win, n_scale[nm])
                                                for nm, ch in chunks.items()},
                             {k.node: self._origin(k.node, win, n_scale.get(k.node)) for k in self.keyed},
                             {nm: tuple((a, b) for a, b in ch) for nm, ch in chunks.items()}))
        return _Layout(in_windows, tuple(out_shapes), tuple(heads), tuple(subs), norm_sizes)

    def _in_window(self, node: str, chunk: Sequence[tuple[int, int]], win: Sequence[tuple[int, int]],
                   scale: Sequence[Fraction]) -> Slices:
        """A norm's chunk in the pixels of its input on the sub-tile's window."""
        spans = []
        for (a, b), (w0, _), f in zip(chunk, win, scale, strict=True):
            start = Fraction(w0) / f
            if start.denominator != 1:
                raise NowdlError(f"stage {self.stage.index}: norm {node!r} runs at a resolution where a window "
                                 f"starting at {w0} is not on a whole pixel: use tiles_per_gpu=1 for this stage")
            spans.append((a - int(start), b - int(start)) if a < b else (0, 0))
        return _box(spans)

    def _origin(self, node: str, win: Sequence[tuple[int, int]], scale: Sequence[Fraction] | None) -> tuple[int, ...]:
        """A dropout node's window origin on the image, in its pixels (none: not an image value)."""
        start = [Fraction(w0) / f for (w0, _), f in zip(win, scale, strict=True)] if scale is not None else []
        if any(v.denominator != 1 for v in start):
            raise NowdlError(f"stage {self.stage.index}: dropout {node!r} runs at a resolution where a window starting "
                             f"at {[w[0] for w in win]} is not on a whole pixel: use tiles_per_gpu=1 for this stage")
        return tuple(int(v) for v in start)

    def _ratio(self, ref: int, size: int, what: str) -> int:
        q = max(1, round(ref / size))
        if size not in (ref // q, -(-ref // q)):
            raise NowdlError(f"stage {self.stage.index}: {what} size {size} is not the finest input size {ref} divided "
                             "by a whole factor: sequential tiles cannot align it; use tiles_per_gpu=1 for this stage")
        return q

    def _region(self, size: int, parts: int, c: int, sub: int, j: int) -> tuple[int, int]:
        t0, t1 = split_bounds(size, parts, c)
        if t1 - t0 < sub:
            raise NowdlError(f"stage {self.stage.index}: a GPU's tile of {t1 - t0} px (of {size} cut into {parts}) "
                             f"cannot be cut into {sub} sequential tiles: use a smaller tiles_per_gpu or a larger image")
        a, b = split_bounds(t1 - t0, sub, j)
        return t0 + a, t0 + b

    @staticmethod
    def _window(d: int, size: int, regions: Sequence[Sequence[tuple[int, int]]], reach: Any,
                needs: Sequence[tuple[Sequence[tuple[int, int]], Sequence[Fraction], Sequence[Fraction]]] = ()
                ) -> tuple[int, int]:
        """The sub-tile's window along dim ``d`` (reference pixels): every output region plus the
        reach, and every norm's chunk plus the norm's reach (``needs``: chunk, scale, reach); its start
        a multiple of the alignment, its length too unless it ends at the border."""
        lo = min(math.floor(r[d][0] * f[d]) for r, f in zip(regions, reach.out_scale, strict=True)) - reach.reach[d]
        hi = max(math.ceil(r[d][1] * f[d]) for r, f in zip(regions, reach.out_scale, strict=True)) + reach.reach[d]
        for chunk, f, r in needs:
            if chunk[d][0] < chunk[d][1]:
                lo = min(lo, math.floor(chunk[d][0] * f[d] - r[d]))
                hi = max(hi, math.ceil(chunk[d][1] * f[d] + r[d]))
        a = reach.align[d]
        lo = max(0, lo) // a * a
        hi = lo + -(-(hi - lo) // a) * a
        return lo, min(hi, size)

    @staticmethod
    def _to_input(w: tuple[int, int], ref: int, f: int, size: int) -> tuple[int, int]:
        return w[0] // f, (size if w[1] >= ref else w[1] // f)


def _chunk(size: int, parts: int, c: int, sub: int, j: int) -> tuple[int, int]:
    """Sub-tile ``j`` of GPU tile ``c``'s part of a ``size``-pixel dim (may be empty)."""
    t0, t1 = split_bounds(size, parts, c)
    a, b = split_bounds(t1 - t0, sub, j)
    return t0 + a, t0 + b


def grid_index(coords: Sequence[int], grid: Sequence[int]) -> int:
    """Row-major index of ``coords`` in ``grid``."""
    i = 0
    for c, g in zip(coords, grid, strict=True):
        i = i * g + c
    return i
