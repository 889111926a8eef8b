"""Checks of pinned settings before the search, and the arithmetic of pins that cannot fill the GPUs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from nowdl.errors import NowdlError
from nowdl.partitioner.config.candidate import Candidate, PlanRequest, enumerate_candidates
from nowdl.partitioner.config.grids import (
    MAX_TILES_PER_GPU,
    cuts_evenly,
    grid_of,
    part_counts,
    sub_grid,
    tile_counts,
)

__all__ = ["check_tiles_per_gpu", "pinned_arithmetic", "rank_formula"]


def _image_text(image: Sequence[int] | None) -> str:
    return "x".join(str(d) for d in image) if image else "?"


def check_tiles_per_gpu(req: PlanRequest, image: Sequence[int] | None, tileable_front: bool) -> None:
    """Refuse a pinned ``tiles_per_gpu`` > 1 that no allowed spatial part count can cut ``image``
    into ([Note: search grids] in config/grids.py), or a model whose first op cannot run on tiles.

    Raises:
        NowdlError: naming the value and the counts that work.
    """
    t = req.tiles_per_gpu
    if t is None or t == 1:
        return
    if not tileable_front:
        raise NowdlError(f"tiles_per_gpu={t}: the model's first operation cannot run on image tiles, so no stage "
                         "can run tiles one after another; use tiles_per_gpu=1 (--tiles-per-gpu 1)")
    slice_ = req.slice or "square"
    dims = len(image) if image else 2
    if isinstance(req.spatial_parts, tuple):
        parts = list(req.spatial_parts)
    elif req.spatial_parts:
        parts = [req.spatial_parts]
    else:
        parts = [1, *part_counts(req.gpus, slice_, image)]
    for p in parts:
        g = grid_of(slice_, p * t, dims)
        if g is not None and sub_grid(slice_, p, t, dims) is not None and cuts_evenly(image, g):
            return
    ok = sorted({n for p in parts for n in tile_counts(p, slice_, image)})
    fix = (f"use one of {', '.join(map(str, ok))}" if ok else "use tiles_per_gpu=1 (no sequential tiles)")
    raise NowdlError(
        f"tiles_per_gpu={t} cannot cut the {_image_text(image)} input into tiles: with {slice_} slicing and "
        f"{'spatial parts ' + ', '.join(map(str, parts))} the grid of parts x {t} tiles must refine each GPU's tile "
        f"and divide the image into whole tiles of at least 16 pixels; {fix} (--tiles-per-gpu N, or auto; "
        f"at most {MAX_TILES_PER_GPU})")


def rank_formula(c: Candidate) -> str:
    """How ``c``'s ranks per pipeline add up, e.g. '2 plain stages + 2 spatial stages x 2 tiles = 6'."""
    sizes = c.group_sizes()
    plain = sum(1 for g in sizes if g == 1)
    spatial = [g for g in sizes if g > 1]
    terms = []
    if plain:
        terms.append(f"{plain} plain stage{'s' if plain != 1 else ''}")
    for g in sorted(set(spatial), reverse=True):
        n = spatial.count(g)
        terms.append(f"{n} spatial stage{'s' if n != 1 else ''} x {g} tiles")
    mirror = " (the spatial stages mirrored at the back: the model ends on tiles too)" if c.back else ""
    master = " (MASTER: each slot holds a stage of both replicas)" if c.replicas == 2 else ""
    return f"{' + '.join(terms)} = {c.ranks_per_pipeline()} ranks per pipeline{mirror}{master}"


def pinned_arithmetic(req: PlanRequest, *, tileable_front: bool, tileable_back: bool, max_stages: int,
                      micro_batch: int, image: Sequence[int] | None) -> str:
    """Why the pins of ``req`` fill no ``req.gpus`` GPUs, with figures: the ranks a pipeline of these
    pins takes and the GPU counts that would work ('' when nothing is found up to 4 x gpus)."""
    found: dict[int, Candidate] = {}
    for g in range(1, min(4 * req.gpus, 256) + 1):
        try:
            r = dataclasses.replace(req, gpus=g, dp=1, global_batch=None, tiles_per_gpu=req.tiles_per_gpu or 1)
        except NowdlError:
            continue
        for c in enumerate_candidates(r, tileable_front=tileable_front, tileable_back=tileable_back,
                                      max_stages=max_stages, micro_batch=micro_batch, image=image):
            found.setdefault(c.ranks_per_pipeline(), c)
            break
    if not found:
        return ""
    dps = [req.dp] if req.dp else None
    works = sorted({rpp * d for rpp in found for d in (dps or range(1, 65)) if rpp * d <= 4 * req.gpus})
    shown = sorted(found)[:3]
    lines = "; ".join(rank_formula(found[rpp]) for rpp in shown)
    fit = [rpp for rpp in found if req.gpus % rpp == 0 and (not req.dp or rpp * req.dp == req.gpus)]
    text = f" With these pins a pipeline takes: {lines}."
    if fit and req.global_batch is not None:
        text += (f" {req.gpus} GPUs hold such pipelines, but the global batch of {req.global_batch} does not split "
                 "into micro-batches x replicas x dp x samples for them (it must be a multiple of replicas x dp)"
                 + (f" with {req.micro_batches} micro-batches" if req.micro_batches else "") + ".")
    elif not fit:
        near = ", ".join(str(w) for w in works[:8])
        text += f" {req.gpus} GPUs is not {'dp x ' if not req.dp else f'dp {req.dp} x '}that; GPU counts that are: {near}."
    return text
