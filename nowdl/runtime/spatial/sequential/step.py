"""The autograd step of sequential tiles: the sub-tiles' forward without saved activations, their
recomputation in backward ([Note: sequential tiles] in :mod:`nowdl.runtime.spatial.sequential.tiles`).

``run`` is the stage's :class:`~nowdl.runtime.spatial.sequential.SequentialTiles`, ``lay`` its
layout for this micro-batch's shapes (the sub-tiles' window slices, kept crops and norm chunks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from nowdl.runtime.spatial.dropout import keyed_run
from nowdl.runtime.spatial.statistics import layerwise as lw
from nowdl.runtime.spatial.statistics import layerwise_bwd as lwb
from nowdl.runtime.spatial.statistics import seq_norms as sn
from nowdl.runtime.spatial.tiles import TileGrid

__all__ = ["SubTilesRun", "extent"]


class SubTilesRun(torch.autograd.Function):
    """The sub-tiles' forward without saved activations; their recomputation in backward."""

    @staticmethod
    def forward(ctx: Any, run: Any, lay: Any, seeds: dict[str, int], n_in: int,  # type: ignore[override]
                *flat: Tensor) -> tuple[Tensor, ...]:
        wins = flat[:n_in]
        passes = run.norm_passes(lay)
        cache = lw.host_cache(run.module, passes, run.norm_schedule, wins[0].device, len(lay.subs),
                              any(ctx.needs_input_grad), run.host_meter)  # None: the statistics passes
        outs: list[Tensor] = []
        with torch.no_grad():
            for k in range(1, passes.levels.passes[0] + 1 if passes is not None else 1):  # statistics passes
                passes.mode, passes.level = "fwd", k  # type: ignore[union-attr]
                for i, sub in enumerate(lay.subs):
                    _sub_run(run, passes, i, [w[sl] for w, sl in zip(wins, sub.ins, strict=True)], seeds,
                             sub.origins, cache)
                passes.finish_fwd(wins[0].device)  # type: ignore[union-attr]
                if cache is not None:
                    cache.keep_only(cache.plan.keep[k])
            if passes is not None:
                passes.mode = "apply"
            for i, sub in enumerate(lay.subs):
                ys = _sub_run(run, passes, i, [w[sl] for w, sl in zip(wins, sub.ins, strict=True)], seeds,
                              sub.origins, cache)
                if not outs:
                    outs = [y.new_zeros(tuple(y.shape[:2]) + extent(lay, o, run)) for o, y in enumerate(ys)]
                for o, (y, (crop, place)) in enumerate(zip(ys, sub.outs, strict=True)):
                    outs[o][place] = y[crop]
                del ys, y  # one sub-tile's outputs live at a time
            lw.release(cache)  # the forward's own values; the backward's boundary stays
        dev = wins[0].device.type
        ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.run, ctx.lay, ctx.n_in, ctx.passes, ctx.seeds = run, lay, n_in, passes, seeds
        ctx.keep = getattr(cache, "bwd", None)
        ctx.save_for_backward(*wins)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *gys: Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        wins = ctx.saved_tensors
        run: Any = ctx.run
        n_in = ctx.n_in
        need_w = [bool(ctx.needs_input_grad[4 + i]) for i in range(n_in)]
        need_p = [bool(ctx.needs_input_grad[4 + n_in + k]) for k in range(len(run.params))]
        gw = [torch.zeros_like(w) if nd else None for w, nd in zip(wins, need_w, strict=True)]
        gp: list[Tensor | None] = [None] * len(run.params)
        params = [p for p, nd in zip(run.params, need_p, strict=True) if nd]
        dev, on, dtype = ctx.autocast
        passes: sn.NormPasses | None = ctx.passes
        with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=on):
            if ctx.keep is not None and passes is not None:  # [Note: layer-wise backward]
                gw, got = lwb.layerwise_backward(run.module, passes, ctx.lay.subs, wins, gys, need_w, params,
                                                 ctx.keep, _roots, lambda i: keyed_run(ctx.seeds, ctx.lay.subs[i].origins))
                gp = [got.pop(0) if nd else None for nd in need_p]
                return (None, None, None, None, *gw, *gp)
            for k in range(1, passes.levels.passes[1] + 1 if passes is not None else 1):  # gradient means
                passes.mode, passes.level = "bwd", k  # type: ignore[union-attr]
                for i, sub in enumerate(ctx.lay.subs):
                    xs = [w[sl].detach().requires_grad_(nd) for w, sl, nd in zip(wins, sub.ins, need_w, strict=True)]
                    roots, seeds = _roots(_sub_run(run, passes, i, xs, ctx.seeds, sub.origins), gys, sub)
                    passes.add_grads(roots, seeds)  # type: ignore[union-attr]
                    del roots, seeds  # one sub-tile's recomputed graph lives at a time
                passes.finish_bwd()  # type: ignore[union-attr]
            if passes is not None:
                passes.mode = "apply"
            for i, sub in enumerate(ctx.lay.subs):
                xs = [w[sl].detach().requires_grad_(nd) for w, sl, nd in zip(wins, sub.ins, need_w, strict=True)]
                ys = _sub_run(run, passes, i, xs, ctx.seeds, sub.origins)
                roots, seeds = _roots(ys, gys, sub)
                if not roots:
                    continue
                want = [x for x in xs if x.requires_grad] + params
                grads = torch.autograd.grad(roots, want, seeds, allow_unused=True)
                del roots, ys
                it = iter(grads)
                for i, (x, sl) in enumerate(zip(xs, sub.ins, strict=True)):
                    if x.requires_grad:
                        gx = next(it)
                        if gx is not None:
                            gw[i][sl] += gx  # type: ignore[index]
                k_need = [k for k, nd in enumerate(need_p) if nd]
                for k, g in zip(k_need, it, strict=True):
                    if g is not None:
                        gp[k] = g if gp[k] is None else gp[k] + g  # type: ignore[operator]
        return (None, None, None, None, *gw, *gp)


def _sub_run(run: Any, passes: sn.NormPasses | None, i: int, xs: Sequence[Tensor], seeds: dict[str, int],
             origins: dict[str, tuple[int, ...]], cache: lw.HostCache | None = None) -> Any:
    """The stage on sub-tile ``i``'s window inputs ``xs`` (its norms as ``passes`` says, its dropout
    keyed; ``cache``: a layer-wise forward's, [Note: layer-wise norms])."""
    with keyed_run(seeds, origins):
        if passes is None:
            return run.module(*xs)
        if cache is not None:
            return lw.CachedRun(run.module, passes, i, cache).run(*xs)
        return sn.NormRun(run.module, passes, i).run(*xs)


def _roots(ys: Sequence[Tensor], gys: Sequence[Tensor | None], sub: Any) -> tuple[list[Tensor], list[Tensor]]:
    """The kept part of a sub-tile's outputs and their gradients (those that take one)."""
    roots, seeds = [], []
    for y, g, (crop, place) in zip(ys, gys, sub.outs, strict=True):
        if g is not None and y.requires_grad:
            roots.append(y[crop])
            seeds.append(g[place])
    return roots, seeds


def extent(lay: Any, o: int, run: Any) -> tuple[int, ...]:
    """The shape of this GPU's tile of the stage's output ``o``."""
    shape = lay.out_shapes[o]
    return TileGrid.for_rank(shape, run._grid(len(shape)), run.rank, run.ranks).tile_shape()
