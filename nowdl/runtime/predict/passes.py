"""Statistics passes: the whole image's norm statistics and poolings, gathered over its windows.

[Note: statistics passes] An image that streams in several windows reaches InstanceNorm,
GroupNorm, BatchNorm without running statistics and adaptive pooling (squeeze-and-excitation)
one window at a time, but these ops take statistics over the whole image. Before the pass that
writes the output, predict runs *statistics passes* over the windows: pass k runs the forward of
every window, and each op of pass k ([Note: whole-image ops]) hands the part of its input inside
the window's core to :class:`~nowdl.runtime.spatial.statistics.accumulate.Statistics` ([Note: statistics
accumulation]); at the end of the pass the ranks combine them. Ops of earlier passes meanwhile
apply the whole-image statistics already gathered, so the input of an op of pass k is, inside
the core, what the whole-image forward computes there: the windows' margins cover the reach of
every op before it (the network's reach is at least each op's), and ops of later passes
compute what the window alone gives (their values are not used yet). The writing pass applies
every op's whole-image statistics. A network whose statistics ops sit k deep in a chain needs k
passes, each a forward of every window: the cost the inference plan records
(``config.statistics_passes``) and the summary line reports.

Where the ops run: a stage on tiles calls :meth:`StatisticsPasses.tiled` for them
(``TiledStage.overrides``: each rank's chunk is its tile's part of the core); a stage of one
rank has each of them replaced in its fx module by a :class:`StreamedOp` that does the same on
the whole window; a stage on sequential tiles runs each sub-tile once with this object as its
``external`` hook, handing it each norm's chunk ([Note: sequential tiles in statistics passes]). One window per image (the default up to 2048² / 128³) needs none of this: the
tiles reduce the statistics over the whole image already, and the ops run as they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from nowdl.errors import NowdlError
from nowdl.runtime.predict.windows import Reach, Window
from nowdl.runtime.spatial.reach import SEQ_NORMS
from nowdl.runtime.spatial.statistics.accumulate import Statistics, StatOp, norm_affine
from nowdl.runtime.spatial.tiles import TiledInput, TileGrid

__all__ = ["StatisticsPasses", "StreamedOp", "gather_statistics", "CachedInputs", "INPUT_CACHE_BYTES"]


class StreamedOp(nn.Module):
    """Stands in for a whole-image op in the fx module of a stage that is not on tiles: runs it
    as :class:`StatisticsPasses` says. Holds the op's module without registering it (it stays
    in the stage under its own name, with its parameters)."""

    def __init__(self, passes: StatisticsPasses, node: fx.Node, gm: fx.GraphModule) -> None:
        super().__init__()
        self.__dict__["passes"] = passes
        self.__dict__["inner"] = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        self.node_name, self.node_op, self.target = node.name, node.op, node.target

    passes: StatisticsPasses
    inner: nn.Module | None

    def _original(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        if self.node_op == "call_method":
            return getattr(args[0], str(self.target))(*args[1:], **kwargs)
        return self.target(*args, **kwargs)  # type: ignore[operator]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        p = self.passes
        if self.node_name not in p.ops and not p.skipped(self.node_name):  # the most calls: as it is
            return self._original(*args, **kwargs)
        return p.run(self.node_name, self.inner, self.target, args, kwargs, None,
                               lambda: self._original(*args, **kwargs))


class StatisticsPasses:
    """Which statistics pass is running and the statistics gathered so far, for one window engine.

    ``current`` 0: every op runs on its window alone (one window per image); k: pass k gathers
    the statistics of its ops, earlier ones apply theirs; ``passes + 1``: the writing pass.
    """

    def __init__(self, ops: Sequence[StatOp], device: torch.device,
                 prefix: Sequence[tuple[str, Sequence[int], Sequence[int]]] = (), modules: Sequence[str] = ()) -> None:
        self.ops = {o.node: o for o in ops}
        self.modules = frozenset(modules)  # the ops that are norm modules sequential tiles run
        self.skips = {name: (frozenset(ks), tuple(shape)) for name, ks, shape in prefix}
        self.passes = max((o.stat_pass for o in ops), default=0)
        self.device = device
        self.current = 0
        self.stats = Statistics()
        self.unhooked: list[str] = []  # functional norms on sequential tiles: computed per window (every rank)
        self.seconds = 0.0  # the last image's statistics passes, wall time
        self.cpu_seconds = 0.0  # and this process's CPU time in them
        self._window: tuple[Window, tuple[int, ...]] | None = None
        self._zero: dict[Any, tuple[Tensor, int]] = {}

    # ---- hooking the engine's stages --------------------------------------------------------------
    def install(self, engine: Any) -> None:
        """Hook every op of a stage this rank holds: overrides of its tiled stages, :class:`StreamedOp`
        nodes in the fx modules of the others."""
        self.unhooked = [n for st in engine.plan.stages if st.tiles_per_gpu > 1 for n in st.nodes
                         if n in self.ops and n not in self.modules]
        for rep, s in engine.held:
            gm: fx.GraphModule = engine.stages[s].module
            mine = [n for n in gm.graph.nodes if n.name in self.ops or n.name in self.skips]
            tiled = engine.tiled.get((rep, s))
            if tiled is not None and tiled.sequential is not None:
                tiled.sequential.external = self  # [Note: sequential tiles in statistics passes]
                continue
            if tiled is not None:
                for n in mine:
                    tiled.overrides[n.name] = self._tiled_hook(gm, n)
            elif mine and not any(isinstance(m, StreamedOp) for m in gm.modules()):
                for i, n in enumerate(mine):
                    gm.add_submodule(f"nowdl_streamed_{i}", StreamedOp(self, n, gm))
                    n.op, n.target = "call_module", f"nowdl_streamed_{i}"
                gm.recompile()

    def _tiled_hook(self, gm: fx.GraphModule, node: fx.Node) -> Callable[..., tuple[Any, TileGrid | None]]:
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None

        def hook(args: Any, kwargs: dict[str, Any], grids: Sequence[TileGrid | None],
                 original: Callable[[], tuple[Any, TileGrid | None]]) -> tuple[Any, TileGrid | None]:
            grid = next((g for g in grids if g is not None), None)
            return self.run(node.name, module, node.target, args, kwargs, grid, original)  # type: ignore[no-any-return]

        return hook

    # ---- running one op ----------------------------------------------------------------------------
    def run(self, name: str, module: nn.Module | None, target: Any, args: Sequence[Any], kwargs: dict[str, Any],
            grid: TileGrid | None, original: Callable[[], Any]) -> Any:
        """One call of op ``name`` on ``args[0]`` (a window, or this rank's tile of it when ``grid``):
        as the window alone computes it, gathering its statistics, or with the whole image's."""
        skip = self.skips.get(name)
        if skip is not None and 0 < self.current <= self.passes and self.current not in skip[0]:
            shape = skip[1]  # a value this statistics pass does not need: zeros
            like = args[0] if args and isinstance(args[0], Tensor) else next(
                t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor))
            if grid is None:
                return self._zeros(like, shape)
            out = grid.with_shape(shape[2:])
            return self._zeros(like, (*shape[:2], *out.tile_shape())), out
        op = self.ops.get(name)
        if op is None or self.current == 0 or op.stat_pass > self.current:
            return original()
        x = args[0]
        if op.stat_pass == self.current:
            sizes = tuple(grid.shape) if grid is not None else tuple(x.shape[2:])
            self._collect(op, x, sizes, [grid.bounds(d) if grid is not None else (0, sizes[d]) for d in range(len(sizes))])
            if op.is_norm:  # read by later passes' ops only, which this pass skips: any value of its shape
                return (x, grid) if grid is not None else x
            return original()
        if op.is_norm:
            w, b, eps = norm_affine(op, module, target, args, kwargs)
            y = self.stats.apply_norm(op, x, w, b, eps)
            return (y, grid) if grid is not None else y
        y = self.stats.pooled(op, x)
        return (y, None) if grid is not None else y

    # ---- stages on sequential tiles ([Note: sequential tiles in statistics passes]) ------------------
    def hooks(self, name: str) -> bool:
        return name in self.ops and name in self.modules

    def skipped(self, name: str) -> bool:
        skip = self.skips.get(name)
        return skip is not None and 0 < self.current <= self.passes and self.current not in skip[0]

    def chunk(self, name: str, module: nn.Module, x: Tensor, chunk: tuple[slice, ...],
              spans: Sequence[tuple[int, int]], sizes: Sequence[int], original: Callable[[], Tensor]) -> Tensor:
        """Norm ``name`` on a sub-tile window ``x`` whose chunk ``x[chunk]`` lies at ``spans`` of the
        window's ``sizes`` pixels at the norm's resolution."""
        op = self.ops[name]
        if self.current == 0 or op.stat_pass > self.current:
            return original()
        if op.stat_pass == self.current:
            self._collect(op, x[chunk], tuple(sizes), spans)
            return x  # read by later passes' ops only
        w, b, eps = norm_affine(op, module, None, (x,), {})
        return self.stats.apply_norm(op, x, w, b, eps)

    def _zeros(self, like: Tensor, shape: Sequence[int]) -> Tensor:
        """Zeros shaped ``shape`` like ``like``, one tensor per shape kept over the passes (made again
        if anything wrote into it)."""
        key = (tuple(shape), like.dtype, like.device)
        got = self._zero.get(key)
        if got is None or got[0]._version != got[1]:
            t = like.new_zeros(shape)
            got = self._zero[key] = (t, t._version)
        return got[0]

    def _collect(self, op: StatOp, x: Tensor, sizes: tuple[int, ...], bounds: Sequence[tuple[int, int]]) -> None:
        """Add the part of ``x`` (at ``bounds`` of the window's ``sizes`` pixels at ``op``'s
        resolution) inside the window's core."""
        if self._window is None:
            raise NowdlError(f"node {op.node!r}: a statistics pass ran without a window; report this")
        win, image = self._window
        if tuple(sizes) != op.spatial:
            raise NowdlError(f"node {op.node!r} sees a window input of {list(sizes)} pixels, the traced window "
                             f"{list(op.spatial)}: the windows changed shape; report this")
        sl, start = [], []
        for d, ((r0, r1), (c0, c1)) in enumerate(zip(win.read, win.core, strict=True)):
            k0, k1, off = _at(op, d, r0, r1, c0, c1, image[d])
            lo, hi = bounds[d]
            a, b = max(k0, lo), min(k1, hi)
            if a >= b:
                return
            sl.append(slice(a - lo, b - lo))
            start.append(a + off)
        self.stats.add(op, x[(slice(None), slice(None), *sl)], start, self.lengths(op, image))

    def lengths(self, op: StatOp, image: Sequence[int]) -> tuple[int, ...]:
        """The image's size at ``op``'s resolution."""
        win = self._window[0] if self._window is not None else None
        out = []
        for d, size in enumerate(image):
            w = win.read[d][1] - win.read[d][0] if win is not None else size
            out.append(_whole(Fraction(size * op.spatial[d], w), op, d) if w != size else op.spatial[d])
        return tuple(out)

    # ---- the passes --------------------------------------------------------------------------------
    def begin(self, k: int, window: Window, image: Sequence[int]) -> None:
        self.current = k
        self._window = (window, tuple(int(s) for s in image))

    def finish(self, k: int, image: Sequence[int]) -> None:
        ops = [o for o in self.ops.values() if o.stat_pass == k and o.node not in self.unhooked]
        self.stats.finish(ops, {o.node: self.lengths(o, image) for o in ops}, self.device)


def _whole(v: Fraction, op: StatOp, d: int) -> int:
    if v.denominator != 1:
        raise NowdlError(f"node {op.node!r} runs at a resolution where the window's core along spatial dim {d} "
                         f"does not fall on whole pixels ({float(v):g}): its statistics cannot be gathered over "
                         "the windows; use a window that covers the image along that dim")
    return int(v)


def _at(op: StatOp, d: int, r0: int, r1: int, c0: int, c1: int, size: int) -> tuple[int, int, int]:
    """(core start, core end, window start) along dim ``d`` at ``op``'s resolution, window pixels."""
    s = op.spatial[d]
    if r0 == 0 and r1 == size:  # one window spans the dim: its core is the whole dim
        return 0, s, 0
    f = Fraction(s, r1 - r0)
    return _whole((c0 - r0) * f, op, d), _whole((c1 - r0) * f, op, d), _whole(r0 * f, op, d)


INPUT_CACHE_BYTES = 1 << 30
"""Host bytes of window inputs :class:`CachedInputs` keeps per image (later windows are read again)."""


class CachedInputs:
    """Each window's input as this rank reads it, kept over one image's statistics passes and its
    writing pass (every pass reads the same windows: one read each instead of one per pass), up to
    ``budget`` bytes. A kept tensor changed in place by the forward is read again."""

    def __init__(self, read: Callable[[Window], TiledInput], budget: int = INPUT_CACHE_BYTES) -> None:
        self.read, self.budget, self.bytes = read, budget, 0
        self.held: dict[Any, tuple[Tensor, int]] = {}

    def __call__(self, w: Window) -> TiledInput:
        x = self.read(w)
        inner = x._read

        def read(idx: tuple[slice, ...]) -> Tensor:
            key = (w.read, tuple((s.start, s.stop, s.step) for s in idx))
            got = self.held.get(key)
            if got is not None and got[0]._version == got[1]:
                return got[0]
            t = inner(idx)
            if got is None and self.bytes + t.numel() * t.element_size() <= self.budget:
                self.held[key] = (t, t._version)
                self.bytes += t.numel() * t.element_size()
            return t

        return TiledInput(x.shape, read, x.dtype)


def gather_statistics(runner: Any, spatial: Sequence[int], windows: Sequence[Window], reach: Reach,
                      read: Callable[[Window], Any], on_window: Callable[[], None] | None = None
                      ) -> StatisticsPasses | None:
    """Run the statistics passes of one image over ``windows`` on ``runner`` (a window runner; every
    rank calls it alike) and leave its ops applying the whole image's statistics: the next
    forwards of these windows are the writing pass. ``read(w)`` gives window ``w``'s input.
    None, every op running on its window alone, when the image is one window or needs no pass."""
    held = getattr(runner.engine, "statistics", None)
    if held is not None:
        held.current = 0
    if len(windows) < 2 or not reach.passes:
        return None
    engine = runner._window_engine(read(windows[0]))
    passes: StatisticsPasses | None = getattr(engine, "statistics", None)
    if passes is None:
        seq = {t.__name__ for t in SEQ_NORMS}
        passes = StatisticsPasses(reach.stat_ops, engine.device, reach.prefix,
                                  [node for node, op, *_ in reach.whole if op in seq])
        passes.install(engine)
        engine.statistics = passes
    t0, c0 = time.perf_counter(), time.process_time()
    for k in range(1, passes.passes + 1):
        for w in windows:
            passes.begin(k, w, spatial)
            runner.run_window(read(w), measure=False)
            if on_window is not None:
                on_window()
        passes.finish(k, spatial)
    passes.current = passes.passes + 1
    passes.seconds, passes.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    return passes
