"""Why no configuration fits, said with figures a user can act on.

[Note: infeasible figures] When nothing fits the memory cap, the error gives two figures, both
of splits that exist: the leanest split found with the requested GPUs (its peak is a cap that
would fit) and the smallest doubling of the GPU count whose leanest split fits the cap. Lower
bounds are not used for either: a candidate's bound can lie far below what any split of it
needs (UNet at 16384² on 8 GPUs: a 4-stage, 4-tile candidate bounded at 48.7 GiB needs 222.9),
and a cap raised to a bound would fail again. The leanest split of a candidate space is looked
for among its memory-lean candidates (one micro-batch where not pinned, no dp copies), each
split by the heuristic solvers without the cap, within ``BUDGET_S`` seconds in all, with the
search's ``SolveCache`` (the graph's ideals are enumerated once for every GPU count).
"""

from __future__ import annotations

import dataclasses
import math
import time

from nowdl.errors import InfeasibleError, NowdlError, TileHaloError
from nowdl.partitioner.config.candidate import Candidate, PlanRequest, enumerate_candidates
from nowdl.partitioner.config.grids import grid_of, part_counts, tile_counts
from nowdl.partitioner.costs.costmodel import Costs, spatial_dims_of
from nowdl.partitioner.costs.sequential_tiles import image_pools
from nowdl.partitioner.search.batch_split import CostsByBatch
from nowdl.partitioner.search.bounds import candidate_bounds
from nowdl.partitioner.search.candidate_problem import candidate_problem, too_small
from nowdl.partitioner.search.deadline import refusal_budget
from nowdl.partitioner.search.model_space import (
    batch_of,
    image_of,
    max_stages,
    tileable_ends,
    uncapped,
)
from nowdl.partitioner.search.pinned import check_tiles_per_gpu, pinned_arithmetic
from nowdl.partitioner.solver import SolveCache, solve
from nowdl.plan.plan import format_bytes

__all__ = ["cap_text", "describe", "infeasible_message", "tile_halo_error", "refusal", "leanest", "no_candidate_message", "first_untileable", "BUDGET_S",
           "MAX_GPUS", "check_tiles_per_gpu", "searched_space"]

BUDGET_S = 20.0  # seconds for the leanest splits of the requested and of the doubled GPU counts
MAX_GPUS = 4096


def cap_text(n: float) -> str:
    """A cap that holds ``n`` bytes, as ``format_bytes`` writes it but rounded up (120.23 GiB ->
    '120.3 GiB': a cap of '120.2 GiB' would not fit it)."""
    text = format_bytes(n)
    value, unit = text.split()
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]
    if float(value) * scale >= n or unit == "B":
        return text
    return f"{math.ceil(n / scale * 10) / 10:.1f} {unit}"


def describe(c: Candidate, gpus: int) -> str:
    """A candidate in words: '64 GPUs: 4 stages, 16 tiles in the spatial stages, 1 micro-batch'."""
    parts = [f"{c.stages} stage{'s' if c.stages != 1 else ''}"]
    if c.parts > 1:
        parts.append(f"{c.parts} tiles in the spatial stages")
    if c.tiles_per_gpu > 1:
        parts.append(f"{c.tiles_per_gpu} tiles per GPU in turn")
    if c.replicas > 1:
        parts.append("MASTER")
    if c.dp > 1:
        parts.append(f"dp {c.dp}")
    parts.append(f"{c.micro_batches} micro-batch{'es' if c.micro_batches != 1 else ''}"
                 + (f" of {c.micro_batch_size} samples" if c.micro_batch_size != 1 else ""))
    return f"{gpus} GPUs: " + ", ".join(parts)


def leanest(costs: Costs, req: PlanRequest, deadline: float, cache: SolveCache) -> tuple[float, str]:
    """The least peak memory of a split found among ``req``'s memory-lean candidates, and the
    candidate in words; (inf, "") when none was split before ``deadline``."""
    front, back = tileable_ends(costs)
    try:
        cands = list(enumerate_candidates(req, tileable_front=front, tileable_back=back,
                                          max_stages=max_stages(costs, req), micro_batch=batch_of(costs),
                                          image=image_of(costs)))
    except NowdlError:  # this GPU count allows no configuration
        return math.inf, ""
    if not cands:
        return math.inf, ""
    least_m = min(c.micro_batches for c in cands)  # fewer micro-batches in flight hold less
    least_dp = min(c.dp for c in cands)  # dp copies hold as much each and leave fewer ranks per pipeline
    least_b = min(c.micro_batch_size for c in cands)  # fewer samples per micro-batch hold less
    by_batch = CostsByBatch(costs, batch_of(costs))
    ranked = []
    for c in cands:
        if c.micro_batches != least_m or c.dp != least_dp or c.micro_batch_size != least_b:
            continue
        cc, problem = candidate_problem(by_batch, c, "memory")
        problem = uncapped(problem)
        try:
            ranked.append((candidate_bounds(cc, c, problem, c.micro_batch_size).mem_lb, c, problem))
        except InfeasibleError:
            continue
    ranked.sort(key=lambda e: e[0])
    best: tuple[float, str] = (math.inf, "")
    for lb, c, problem in ranked:
        if lb >= best[0] or time.perf_counter() > deadline:
            break
        try:
            part = solve(problem, ilp=False, cache=cache)
        except InfeasibleError:
            continue
        if part.bottleneck_mem < best[0]:
            best = (part.bottleneck_mem, describe(c, req.gpus))
    return best


def _fitting_gpus(costs: Costs, req: PlanRequest, cap: float, deadline: float, cache: SolveCache
                  ) -> tuple[int | None, tuple[float, str], int]:
    """The smallest doubling of ``req.gpus`` (no pins but the schedule's) whose leanest split fits
    ``cap``, or None; the leanest split found on the way; and the largest GPU count tried in full
    (less than MAX_GPUS when the time ran out)."""
    lean: tuple[float, str] = (math.inf, "")
    g, tried = req.gpus * 2, req.gpus
    while g <= MAX_GPUS:
        try:
            r = PlanRequest(gpus=g, balance="memory", micro_batches=req.micro_batches, schedule=req.schedule,
                            slice=req.slice, time_limit=req.time_limit, tiles_per_gpu=req.tiles_per_gpu)
        except NowdlError:
            break
        found = leanest(costs, r, deadline, cache)
        lean = min(lean, found)
        if found[0] <= cap:
            return g, found, g
        if time.perf_counter() >= deadline:
            break  # g was perhaps cut short: the counts tried in full end before it
        tried = g
        g *= 2
    return None, lean, (MAX_GPUS if g > MAX_GPUS else tried)


def infeasible_message(costs: Costs, req: PlanRequest, searched: tuple[float, str], cache: SolveCache,
                       deadline: float | None = None) -> str:
    """The error for a search that fitted nothing: ``searched`` is the leanest split it made
    (peak bytes and the candidate in words); its figures take ``BUDGET_S`` seconds at most, and
    what is left before the search's ``deadline`` when given (``deadline.refusal_budget``). See
    [Note: infeasible figures]."""
    cap = costs.mem_cap or 0.0
    budget = BUDGET_S if deadline is None else refusal_budget(deadline, BUDGET_S)
    deadline = time.perf_counter() + budget
    found = min(searched, leanest(costs, req, deadline, cache))
    need = (f"the leanest split found needs {cap_text(found[0])} on its fullest GPU ({found[1]})"
            if math.isfinite(found[0]) else f"no split of it was made within the {budget:.0f} s for this search")
    heaviest = max(costs.profile.nodes, key=lambda n: n.static_bytes)
    if heaviest.static_bytes > cap:
        return (
            f"nothing fits in {format_bytes(cap)} per GPU: node {heaviest.name} ({heaviest.target}) alone "
            f"holds {format_bytes(heaviest.static_bytes)} of weights, gradients and optimizer state, "
            f"which no pipeline or spatial split divides; with {req.gpus} GPUs {need}. Raise the cap "
            f"(--gpu-memory){' to ' + cap_text(found[0]) if math.isfinite(found[0]) else ''}, or use a "
            "lighter optimizer (--optimizer sgd)."
        )
    gpus, lean, tried = _fitting_gpus(costs, req, cap, deadline, cache)
    leanest_txt = f"the leanest split found, {lean[1]}, needs {format_bytes(lean[0])}" if math.isfinite(lean[0]) else ""
    if gpus is not None:
        more = f"{gpus} GPUs would fit it ({lean[1]}, {format_bytes(lean[0])})"
    elif tried < MAX_GPUS and time.perf_counter() >= deadline:
        more = (f"no GPU count up to {tried} fits it, and the {budget:.0f} s for this search ran out at "
                f"{2 * tried} GPUs{' (' + leanest_txt + ')' if leanest_txt else ''}: try a larger --gpus")
    else:
        more = f"no GPU count up to {tried} was found to fit it" + (f" ({leanest_txt})" if leanest_txt else "")
    raise_to = f" to {cap_text(found[0])}" if math.isfinite(found[0]) else ""
    return (f"{_norms_text(costs, req)}nothing fits in {format_bytes(cap)} per GPU with {req.gpus} GPUs (the memory cap is the constraint "
            f"that failed; the search tried {searched_space(costs, req)}): {need}. Raise the cap{raise_to} "
            f"(--gpu-memory), or use more GPUs: {more}{_tiles_hint(costs, req, cap, deadline, cache)}.")


def refusal(costs: Costs, req: PlanRequest, searched: tuple[float, str], cache: SolveCache,
            deadline: float | None = None) -> InfeasibleError:
    """The error for a search that fitted nothing: a :class:`TileHaloError` when no split was
    made at all and the pinned tiles are narrower than a node's halo ([Note: halo wider than a
    tile]), else :func:`infeasible_message`'s."""
    halo = tile_halo_error(costs, req) if not math.isfinite(searched[0]) else None
    return halo or InfeasibleError(infeasible_message(costs, req, searched, cache, deadline))


def searched_space(costs: Costs, req: PlanRequest) -> str:
    """What the search tried, in words: 'spatial parts up to 64, up to 64 tiles per GPU in turn, ...'."""
    slice_ = req.slice or "square"
    image = image_of(costs)
    front = tileable_ends(costs)[0]
    out = []
    if isinstance(req.spatial_parts, tuple) or req.spatial_parts:
        out.append(f"spatial parts {req.spatial_parts} (pinned)")
    elif front:
        ps = part_counts(req.gpus, slice_, image)
        out.append(f"spatial parts up to {max(ps)}" if ps else
                   "no spatial parts" + (" (1 GPU)" if req.gpus < 2 else " (the image cuts into none)"))
    else:
        out.append("no spatial stage (the model's first op cannot run on tiles)")
    if req.tiles_per_gpu is not None:
        out.append(f"{req.tiles_per_gpu} tile{'s' if req.tiles_per_gpu != 1 else ''} per GPU (pinned)")
    elif front:
        ts = tile_counts(1, slice_, image)
        out.append(f"up to {max(ts)} tiles per GPU in turn" if ts else "no sequential tiles")
    if req.micro_batches:
        out.append(f"{req.micro_batches} micro-batches (pinned)")
    return ", ".join(out)


def _norms_text(costs: Costs, req: PlanRequest) -> str:
    """Why pinned sequential tiles could not cover the model: the first average over the whole image."""
    pools = image_pools(costs)
    if not req.tiles_per_gpu or req.tiles_per_gpu == 1 or not pools:
        return ""
    n = costs.profile.nodes[pools[0]]
    return (f"tiles_per_gpu={req.tiles_per_gpu}: node {n.name!r} ({n.target.rsplit('.', 1)[-1]}) averages over the "
            "whole image, which tiles run one after another cannot gather before going on, so a stage of sequential "
            "tiles ends before it (no pooling pass in training). ")


def _tiles_hint(costs: Costs, req: PlanRequest, cap: float, deadline: float, cache: SolveCache) -> str:
    """', or allow sequential tiles (...)' with the fewest tiles per GPU that fit these GPUs,
    when they are forbidden ('' when none fits before ``deadline``)."""
    if req.tiles_per_gpu != 1 or not tileable_ends(costs)[0]:
        return ""
    for t in tile_counts(1, req.slice or "square", image_of(costs)):
        if time.perf_counter() >= deadline:
            break
        try:
            found = leanest(costs, dataclasses.replace(req, tiles_per_gpu=t), deadline, cache)
        except NowdlError:
            continue
        if found[0] <= cap:
            return (f", or allow sequential tiles (--tiles-per-gpu {t} or auto): {found[1]} needs "
                    f"{format_bytes(found[0])}")
    return ""


def first_untileable(costs: Costs, front: bool) -> str:
    """Why the model cannot be spatial to its end: the first node that cannot run on tiles."""
    for n in costs.profile.nodes:
        rule = costs.rules.get(n.name)
        if n.op not in ("placeholder", "output", "get_attr") and rule is not None and not rule.tileable:
            where = "is the model's first operation" if not front else "ends the spatial region"
            return f" Node {n.name!r} {where}: {rule.reason}."
    return ""


def no_candidate_message(req: PlanRequest, front: bool, untileable: str = "", *, costs: Costs | None = None) -> str:
    """The error for pinned settings that no configuration of ``req.gpus`` GPUs matches; with
    ``costs``, the arithmetic: the ranks a pipeline of these pins takes and GPU counts that work."""
    pins = {k: getattr(req, k) for k in ("stages", "dp", "replicas", "spatial_parts", "spatial_stages", "global_batch",
                                         "micro_batches", "micro_batch_size", "tiles_per_gpu") if getattr(req, k)}
    why = ""
    if (req.spatial_parts or req.spatial_stages) and not front:
        why = " The model's first operation cannot run on image tiles, so no spatial stage is possible." + untileable
    elif costs is not None:
        back = tileable_ends(costs)[1]
        why = pinned_arithmetic(req, tileable_front=front, tileable_back=back, max_stages=max_stages(costs, req),
                                micro_batch=batch_of(costs), image=image_of(costs))
        if (req.spatial_parts not in (None, 1) or req.spatial_stages) and not back and req.stages == 1:
            why += " A spatial stage needs a non-spatial stage after it unless the whole model runs on tiles." + untileable
    elif req.spatial_parts not in (None, 1) or req.spatial_stages:
        why = (" Spatial stages need a non-spatial stage after them unless the whole model runs on tiles."
               + untileable)
    return (
        f"no configuration of {req.gpus} GPUs matches the pinned settings {pins}: ranks per pipeline "
        "(stages, plus (parts - 1) for each spatial stage) times dp must equal gpus"
        + (", and micro-batches x replicas x dp x samples per micro-batch the global batch" if req.global_batch else "")
        + "." + why + " Drop a pinned setting or change gpus."
    )


def tile_halo_error(costs: Costs, req: PlanRequest) -> TileHaloError | None:
    """Why the pinned spatial parts cannot hold the whole net: the first node whose tiles are
    narrower than the halo it reads (or than one pixel: ``candidate_problem.too_small``), with
    the widest such halo and the image that would hold it; None when every node fits its tiles.

    [Note: halo wider than a tile] A conv dilated by ``d`` reads ``d`` pixels past its tile at
    its own scale, and a halo comes from the neighbouring tile only: torchvision's DeepLabV3
    (dilation 36 at 1/8 of a 32x32 input: tiles of 2 rows) cannot run there on 2 tiles at any
    memory cap. The fixes are an image large enough, fewer parts, or the node on a later,
    non-spatial stage (more stages and GPUs)."""
    parts = max(req.spatial_parts) if isinstance(req.spatial_parts, tuple) else (req.spatial_parts or 1)
    image = image_of(costs)
    grid = grid_of(req.slice or "square", parts * (req.tiles_per_gpu or 1), spatial_dims_of(costs.profile))
    if parts <= 1 or image is None or grid is None:
        return None
    small = sorted(too_small(costs, grid))
    if not small:
        return None
    names = "DHW"[-len(image):] if len(image) <= 3 else "".join(str(i) for i in range(len(image)))
    found = []  # (halo, node, dim, output size, cut, input pixels it needs along dim)
    for i in small:
        n = costs.profile.nodes[i]
        sp = list(n.out_shape[2:]) if n.out_shape is not None else []
        rule = costs.rules.get(n.name)
        halo = list(rule.halo) if rule is not None and rule.halo else [0]
        halo += [halo[-1]] * len(sp)
        g = [1] * (len(sp) - len(grid)) + list(grid)[-len(sp):]
        for d, (size, gi, h) in enumerate(zip(sp, g, halo, strict=False)):
            if gi > 1 and size // gi < max(1, h):
                dim = d + len(image) - len(sp)
                found.append((h, n, dim, size, gi, math.ceil(max(1, h) * gi * image[dim] / size)))
                break
    h, n, dim, size, gi, _ = found[0]
    name = n.name
    kind = f" ({n.target.rsplit('.', 1)[-1]})"
    reads = (f"reads a halo of {h} pixels along {names[dim]}, wider than its tiles: its output, {size} pixels "
             f"along {names[dim]} cut in {gi}, leaves {size // gi} per tile" if h else
             f"has {size} pixels along {names[dim]}, fewer than its {gi} tiles")
    widest = max(found, key=lambda f: (f[0], f[5]))
    more = (f"; {len(found) - 1} more node{'s' if len(found) > 2 else ''} too (the widest halo: {widest[1].name!r}, "
            f"{widest[0]} pixels)" if len(found) > 1 else "")
    need = max(f[5] for f in found)
    shape = "x".join(map(str, image))
    e = TileHaloError(f"Node {name!r}{kind} {reads}, and a halo comes from the neighbouring tile only{more}. "
            f"spatial_parts={req.spatial_parts} cannot hold it on this {shape} image at any memory cap: give an "
            f"image of at least {need} pixels along {names[widest[2]]}, fewer spatial parts, or let the spatial "
            "stages end before it (more stages and GPUs: a non-spatial stage runs it). [Note: halo wider than a tile]")
    e.node = name
    return e
