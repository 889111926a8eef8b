"""Run one pipeline stage's fx graph on image tiles: the spatial stage of a plan.

[Note: spatial stage] In a stage with ``parts = P > 1`` every rank of its tile group holds the
full weights and one tile of every activation. :class:`TiledStage` walks the stage's graph and
runs each node on tiles, tracking the :class:`TileGrid` of every value (its full spatial shape
and this rank's bounds):

* conv, conv-transpose, pooling, upsampling: :func:`nowdl.runtime.spatial.tile_forward` (halo
  exchange with the neighbours, exact at tile borders and at the image boundary);
* BatchNorm / InstanceNorm / GroupNorm: statistics reduced over the tile group;
* elementwise ops, residual adds, channel ``torch.cat``: run on the tiles as they are (the
  operands are tiles of the same image region);
* Dropout/Dropout1d/2d/3d and ``F.dropout``: the whole image's mask on this tile, keyed by image
  coordinates ([Note: keyed dropout] in :mod:`nowdl.runtime.spatial.dropout`);
* a run of consecutive convs/pools listed in the plan's ``fused`` chains: one deeper halo
  exchange for the whole run (:mod:`nowdl.runtime.spatial.fusion`).

With ``tiles_per_gpu = T > 1`` (the plan's ``StagePlan.tiles_per_gpu``) the stage runs instead as
T sequential sub-tiles per rank, each the whole stage on a window ([Note: sequential tiles] in
:mod:`nowdl.runtime.spatial.sequential`); that also applies on one rank (``parts = 1``).

Anything else is refused when the stage is built, naming the node and why (the planner does
not put such nodes in spatial stages: see ``nowdl.partitioner.spatial.tileable``). Weight gradients are
this tile's contribution; the engine sums them (never averages) over the tile group together
with the data-parallel and MASTER copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from nowdl.codegen.stage import StageModule
from nowdl.errors import NowdlError
from nowdl.partitioner.spatial.tileable import spatial_rules
from nowdl.runtime.spatial.dispatch import tile_forward
from nowdl.runtime.spatial.dropout import draw_seeds, keyed_nodes, keyed_run
from nowdl.runtime.spatial.graph_ops import ATEN_UP as _ATEN_UP
from nowdl.runtime.spatial.graph_ops import INTERP_ARGS as _INTERP_ARGS
from nowdl.runtime.spatial.graph_ops import POOL_ARGS as _POOL_ARGS
from nowdl.runtime.spatial.graph_ops import POOL_FN as _POOL_FN
from nowdl.runtime.spatial.graph_ops import bind as _bind
from nowdl.runtime.spatial.tiles import TileGrid
from nowdl.runtime.spatial.whole import pool_node, upsample_whole, whole_upsample, whole_view

__all__ = ["TiledStage", "full_grid"]

_CAT = (torch.cat, torch.concat, torch.concatenate, torch.ops.aten.cat.default, torch.ops.aten.concat.default)


def full_grid(grid: Sequence[int], ndim: int) -> tuple[int, ...]:
    """A plan's per-stage ``grid`` padded with leading 1s to ``ndim`` spatial dims."""
    g = tuple(int(v) for v in grid)
    if len(g) > ndim:
        raise NowdlError(f"the plan's tile grid {list(g)} has more dims than the tensor's {ndim} spatial dims")
    return (1,) * (ndim - len(g)) + g


class TiledStage:
    """A StageModule run on tiles by the ranks of one tile group.

    Args:
        stage: the stage (its GraphModule is run node by node, on tiles).
        grid: tiles per spatial dim (the plan's ``StagePlan.grid``).
        ranks: the global ranks of the tile group, in part order (row-major over ``grid``).
        rank: this process's global rank (one of ``ranks``).
        group: the tile group's process group (halo exchanges and norm statistics).
        fused: chains of node names whose halo exchanges are fused into one.
        tiles_per_gpu: T > 1 runs the stage as T sequential sub-tiles per rank.
        norm_schedule: with T > 1, how its norms' statistics are gathered ("passes" or "layerwise").

    Raises:
        NowdlError: a node of the stage cannot run on tiles (names the node and why).
    """

    def __init__(self, stage: StageModule, grid: Sequence[int], ranks: Sequence[int], rank: int,
                 group: dist.ProcessGroup | None, fused: Sequence[Sequence[str]] = (), tiles_per_gpu: int = 1,
                 norm_schedule: str = "passes") -> None:
        self.stage = stage
        self.grid = tuple(int(g) for g in grid)
        self.ranks = tuple(int(r) for r in ranks)
        self.rank = rank
        self.group = group
        gm = stage.module
        rules = spatial_rules(gm)
        bad = [(n, rules[n.name].reason) for n in gm.graph.nodes if not rules[n.name].tileable]
        if bad:
            shown = "; ".join(f"{n.name!r} ({r})" for n, r in bad[:3])
            raise NowdlError(
                f"stage {stage.index} is spatial but node(s) {shown}{' ...' if len(bad) > 3 else ''} cannot run on "
                "tiles: re-plan so that the spatial region ends before them (fewer spatial stages, or "
                "spatial_parts=1)"
            )
        self._kinds = {name: r.kind for name, r in rules.items()}  # shape, pooled, whole: [Note: whole values on tiles]
        # by call target: a module shared by several paths is listed once by named_modules()
        self._mods = {str(n.target): gm.get_submodule(str(n.target)) for n in gm.graph.nodes if n.op == "call_module"}
        self._chains: dict[str, list[fx.Node]] = {}
        self._skip: set[str] = set()
        self.keyed = {k.node: k for k in keyed_nodes(gm)}  # dropout keyed by image coordinates
        self._seeds: dict[str, int] = {}
        self._check_chains(fused)
        # per node: run it instead of the tiled op, given (args, kwargs, input grids, the tiled op):
        # predict's statistics passes ([Note: statistics passes] in runtime/predict/passes.py)
        self.overrides: dict[str, Callable[..., tuple[Any, TileGrid | None]]] = {}
        self.sequential: Any = None
        if tiles_per_gpu > 1:
            from nowdl.runtime.spatial.sequential import SequentialTiles

            self.sequential = SequentialTiles(stage, self.grid, self.ranks, rank, group, tiles_per_gpu, norm_schedule)

    def _check_chains(self, fused: Sequence[Sequence[str]]) -> None:
        from nowdl.runtime.spatial.fusion import fusable

        by_name = {n.name: n for n in self.stage.module.graph.nodes}
        for chain in fused:
            nodes = [by_name.get(c) for c in chain]
            if len(chain) < 2 or any(n is None for n in nodes):
                raise NowdlError(f"fused chain {list(chain)} of stage {self.stage.index} names nodes that are not "
                                 "in the stage (or has fewer than 2): the plan was made for another model; re-plan")
            ns = [n for n in nodes if n is not None]
            for a, b in zip(ns, ns[1:], strict=False):
                if list(a.users) != [b] or b.all_input_nodes != [a]:
                    raise NowdlError(f"fused chain {list(chain)}: {a.name!r} must feed only {b.name!r} and "
                                     f"{b.name!r} take only {a.name!r}; re-plan")
            for n in ns:
                if n.op != "call_module" or not fusable(self._mods[str(n.target)]):
                    raise NowdlError(f"fused chain {list(chain)}: node {n.name!r} is not a module halo fusion runs "
                                     "(convs, pools and pointwise activations); re-plan")
            self._chains[ns[0].name] = ns
            self._skip.update(n.name for n in ns[1:])

    def grid_of(self, full_spatial: Sequence[int]) -> TileGrid:
        """This rank's TileGrid of a value with spatial shape ``full_spatial``."""
        return TileGrid.for_rank(full_spatial, full_grid(self.grid, len(full_spatial)), self.rank, self.ranks)

    def __call__(self, tiles: Sequence[Tensor], shapes: Sequence[Sequence[int]]) -> tuple[list[Tensor], list[TileGrid]]:
        """Run the stage on this rank's input tiles.

        Args:
            tiles: one tile per stage input (``stage.inputs`` order).
            shapes: each input's FULL spatial shape (the image, not the tile).

        Returns:
            The output tiles (``stage.outputs`` order) and their grids.
        """
        if self.sequential is not None:
            seq: tuple[list[Tensor], list[TileGrid]] = self.sequential(tiles, shapes)
            return seq
        self._seeds = draw_seeds(list(self.keyed.values()), self.ranks, self.group, tiles[0].device) \
            if self.keyed else {}
        gm = self.stage.module
        env: dict[str, Any] = {}
        grids: dict[str, TileGrid | None] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(tiles):
            raise NowdlError(f"stage {self.stage.index} takes {len(placeholders)} inputs, got {len(tiles)}")
        for ph, t, shape in zip(placeholders, tiles, shapes, strict=True):
            env[ph.name] = t
            g = self.grid_of(shape)
            if tuple(t.shape[2:]) != g.tile_shape():
                raise NowdlError(f"stage {self.stage.index} input {ph.name!r}: got a tile of shape {tuple(t.shape)}, "
                                 f"expected spatial {g.tile_shape()} (tile {g.coords} of {g.shape} cut {g.grid})")
            grids[ph.name] = g
        out: Any = None
        last = self._last_uses()
        for node in gm.graph.nodes:
            if node.op == "placeholder" or node.name in self._skip:
                continue
            if node.op == "output":
                out = node.args[0]
                break
            self._run_node(node, env, grids)
            for name in last.get(node.name, ()):  # free what no later node reads (as fx's codegen does)
                env.pop(name, None)
        names = [a.name for a in (out if isinstance(out, (tuple, list)) else (out,))]
        outs, ogrids = [], []
        for nm in names:
            og = grids.get(nm)
            if og is None:
                raise NowdlError(f"stage {self.stage.index} output {nm!r} is not an image tile; a spatial stage "
                                 "can only pass on (N, C, *spatial) tensors: re-plan")
            outs.append(env[nm])
            ogrids.append(og)
        return outs, ogrids

    def _last_uses(self) -> dict[str, list[str]]:
        """Per node (a fused chain: its head), the values read for the last time there.

        Values the output returns are never freed; a fused chain's inner values live only
        inside :func:`nowdl.runtime.spatial.fusion.fused_forward`.
        """
        head = {n.name: h for h, chain in self._chains.items() for n in chain}
        last: dict[str, str] = {}
        for node in self.stage.module.graph.nodes:
            if node.op == "output":
                for a in node.all_input_nodes:
                    last.pop(a.name, None)
                continue
            for a in node.all_input_nodes:
                last[a.name] = head.get(node.name, node.name)
        out: dict[str, list[str]] = {}
        for value, user in last.items():
            out.setdefault(user, []).append(value)
        return out

    def _run_node(self, node: fx.Node, env: dict[str, Any], grids: dict[str, TileGrid | None]) -> None:
        """Run one node (a fused chain's head: the whole chain) into ``env`` and ``grids``."""
        if self._kinds.get(node.name) == "shape":  # sizes read off the whole image, not off the tile

            def seen(a: fx.Node) -> Any:
                g = grids.get(a.name)
                return env[a.name] if g is None else whole_view(env[a.name], g)

            env[node.name] = _call(node, fx.node.map_arg(node.args, seen), fx.node.map_arg(node.kwargs, seen))
            grids[node.name] = None
            return
        args: Any = fx.node.map_arg(node.args, lambda a: env[a.name])
        kwargs: Any = fx.node.map_arg(node.kwargs, lambda a: env[a.name])
        tiled = [grids[a.name] for a in node.all_input_nodes if grids.get(a.name) is not None]
        if node.op == "get_attr":
            env[node.name] = _fetch_attr(self.stage.module, str(node.target))
            grids[node.name] = None
            return
        if node.name in self._chains:
            from nowdl.runtime.spatial.fusion import fused_forward

            chain = self._chains[node.name]
            mods = [self._mods[str(n.target)] for n in chain]
            yf, gf = fused_forward(mods, args[0], _one(tiled, node), self.group)
            env[chain[-1].name], grids[chain[-1].name] = yf, gf
            return
        k = self.keyed.get(node.name)
        if k is not None:  # the whole image's mask on this tile ([Note: keyed dropout])
            g = next((t for t in tiled if t is not None), None)
            with keyed_run(self._seeds, {node.name: tuple(a for a, _ in g.tile_bounds()) if g is not None else ()}):
                env[node.name], grids[node.name] = k(args[0] if args else kwargs["input"]), g
            return
        hook = self.overrides.get(node.name)
        if hook is not None:
            env[node.name], grids[node.name] = hook(args, kwargs, tiled, lambda: self._run(node, args, kwargs, tiled))
            return
        env[node.name], grids[node.name] = self._run(node, args, kwargs, tiled)

    def _run(self, node: fx.Node, args: Any, kwargs: dict[str, Any],
             tiled: list[TileGrid | None]) -> tuple[Any, TileGrid | None]:
        kind = self._kinds.get(node.name)
        if kind == "pooled" or not any(g is not None for g in tiled):
            return self._run_whole(node, args, kwargs, tiled, kind)
        if node.op == "call_module":
            mod = self._mods[str(node.target)]
            return tile_forward(mod, args[0], _one(tiled, node), self.group)
        target = node.target
        if node.op == "call_function" and target in _POOL_FN:
            kind = "max" if "max" in getattr(target, "__name__", "") else "avg"
            mod = _POOL_FN[target](**_bind(args[1:], kwargs, _POOL_ARGS[kind]))
            return tile_forward(mod, args[0], _one(tiled, node), self.group)
        if node.op == "call_function" and target is F.interpolate:
            opts = _bind(args[1:], kwargs, _INTERP_ARGS)
            opts.pop("antialias", None)
            up = nn.Upsample(**opts)
            return tile_forward(up, args[0], _one(tiled, node), self.group)
        if node.op == "call_function" and target in _ATEN_UP:  # to the traced (whole) size, or by its scales
            aten_up = whole_upsample(self.stage.module, node, args, kwargs)
            if aten_up is None:  # pragma: no cover - every ATen upsampling is one
                raise NowdlError(f"node {node.name!r} is not an upsampling nowdl runs on tiles")
            return tile_forward(aten_up, args[0], _one(tiled, node), self.group)
        if node.op == "call_function" and target in _CAT:
            grids = {(g.shape, g.grid, g.coords) for g in tiled if g is not None}
            if len(grids) > 1:
                raise NowdlError(f"node {node.name!r} concatenates tiles of different images/grids {sorted(grids)}")
        elif tiled:
            shapes = {g.shape for g in tiled if g is not None}
            if len(shapes) > 1:
                raise NowdlError(f"node {node.name!r} combines tensors of spatial shapes {sorted(shapes)}; "
                                 "an elementwise op on tiles needs equal shapes")
        g = next((t for t in tiled if t is not None), None)
        if g is not None:  # a whole value meets tiles: it must broadcast over them ([Note: whole values on tiles])
            _check_broadcast(node, [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)], g)
        y = _call(node, args, kwargs)
        if g is not None and isinstance(y, Tensor) and tuple(y.shape[2:]) != g.tile_shape():
            raise NowdlError(f"node {node.name!r} ({getattr(target, '__name__', target)}) changed the tile's spatial "
                             f"shape {g.tile_shape()} to {tuple(y.shape[2:])}: it cannot run on tiles; re-plan")
        return y, g

    def _run_whole(self, node: fx.Node, args: Any, kwargs: dict[str, Any], tiled: list[TileGrid | None],
                   kind: str | None) -> tuple[Any, TileGrid | None]:
        """A node whose value is the same on every tile ([Note: whole values on tiles]): a pooling
        over every tile, a node on whole values only, or an upsampling of a pooled value to this
        rank's tile of the image."""
        if kind == "pooled" and any(g is not None for g in tiled):  # a pooling of a pooled value runs as it is
            return pool_node(self.stage.module, node, args, kwargs, _one(tiled, node), self.group), None
        up = whole_upsample(self.stage.module, node, args, kwargs)
        if up is not None:
            return upsample_whole(args[0], up, self.grid_of)
        if node.op == "call_module":
            return self._mods[str(node.target)](*args, **kwargs), None
        return _call(node, args, kwargs), None


def _call(node: fx.Node, args: Any, kwargs: dict[str, Any]) -> Any:
    """Run a call_function or call_method node on plain values."""
    if node.op == "call_function":
        return node.target(*args, **kwargs)  # type: ignore[operator]
    return getattr(args[0], str(node.target))(*args[1:], **kwargs)


def _check_broadcast(node: fx.Node, tensors: list[Tensor], g: TileGrid) -> None:
    """A whole tensor (not a tile) that meets tiles must be 1 along every spatial dim."""
    for t in tensors:
        if t.dim() == len(g.shape) + 2 and tuple(t.shape[2:]) not in (g.tile_shape(), (1,) * len(g.shape)):
            raise NowdlError(f"node {node.name!r} combines a tile {g.tile_shape()} of a {g.shape} image with a whole "
                             f"tensor of shape {tuple(t.shape)}: only whole values of spatial size 1 broadcast over "
                             "tiles; re-plan with the spatial region ending before it")


def _one(tiled: list[TileGrid | None], node: fx.Node) -> TileGrid:
    g = next((t for t in tiled if t is not None), None)
    if g is None:
        raise NowdlError(f"node {node.name!r} of a spatial stage has no tiled input")
    return g


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj

