"""Parallel configurations: what the user pins, and the candidates the search enumerates."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from nowdl.errors import NowdlError
from nowdl.partitioner.config.grids import part_counts, tile_counts
from nowdl.partitioner.config.lever_options import LeverSetting, check_lever, check_lever_pair
from nowdl.partitioner.spatial.tileable import SLICE_METHODS
from nowdl.schedule.zero_bubble_order import zb_held

__all__ = ["PlanRequest", "Candidate", "enumerate_candidates", "BALANCES", "SCHEDULES", "MICRO_BATCH_CHOICES",
           "batch_splits"]

BALANCES = ("memory", "compute")
SCHEDULES = ("1f1b", "gpipe", "zb")
MICRO_BATCH_CHOICES = (1, 2, 4, 8)  # micro-batches per step tried when the global batch is free


def _pos_int(name: str, v: object, *, allow_none: bool = True) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise NowdlError(f"{name} must be a positive integer, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What the user asked for; ``None`` means "let the search choose".

    ``micro_batches`` counts micro-batches per step. With ``global_batch`` the search chooses the
    micro-batch size b too (micro_batches x replicas x dp x b = global_batch); without it the
    example input is one micro-batch and the global batch follows from the configuration chosen.
    ``tiles_per_gpu`` None searches sequential tiles (a spatial stage's tiles run one after
    another on each GPU); 1 forbids them; N pins them.
    """

    gpus: int
    balance: str = "memory"
    stages: int | None = None
    micro_batches: int | None = None
    schedule: str | None = None
    replicas: int | None = None
    dp: int | None = None
    spatial_parts: int | tuple[int, ...] | None = None  # a tuple: parts of each front spatial stage
    spatial_stages: int | None = None  # spatial stages at the front (UNets: mirrored at the back too)
    slice: str | None = None
    gpu_memory: float | None = None  # bytes; None: the device's memory
    time_limit: float = 30.0
    mip_gap: float = 0.01  # the MILP stops at this proven relative gap (the plan records the gap reached)
    milp: bool = True  # False: the anytime split of graphs too wide for the exact DP ([Note: anytime split])
    global_batch: int | None = None  # samples per optimizer step: micro-batch x m x replicas x dp must equal it
    nodes: int | None = None  # cluster nodes (None: from gpus_per_node or the device spec's node)
    gpus_per_node: int | None = None  # GPUs per node (None: the device spec's node, e.g. 8 for h100)
    recompute: LeverSetting = "auto"  # [Note: lever settings] in config/lever_options.py
    offload: LeverSetting = "auto"
    tiles_per_gpu: int | None = None  # tiles each GPU of a spatial stage runs in turn (None: searched)
    micro_batch_size: int | None = None  # samples per micro-batch with a global batch (None: searched)
    min_micro_batch: int = 1  # fewest samples per micro-batch ([Note: one-sample norms]: 2 for such nets)

    def __post_init__(self) -> None:
        _pos_int("gpus", self.gpus, allow_none=False)
        if self.balance not in BALANCES:
            raise NowdlError(f"unknown balance {self.balance!r}: use 'memory' (smallest peak memory per GPU) or 'compute' (fastest stage time)")
        for name in ("stages", "micro_batches", "replicas", "dp", "global_batch", "nodes", "gpus_per_node",
                     "tiles_per_gpu", "micro_batch_size", "min_micro_batch"):
            _pos_int(name, getattr(self, name))
        if isinstance(self.spatial_parts, (list, tuple)):
            sp = tuple(self.spatial_parts)
            for v in sp:
                _pos_int("spatial_parts", v, allow_none=False)
            if not sp or min(sp) < 2:
                raise NowdlError(f"spatial_parts as a list gives the parts (>= 2) of each spatial stage in order, "
                                 f"got {list(sp)}; use an int for one value (1: no spatial stage)")
            if self.spatial_stages not in (None, len(sp)):
                raise NowdlError(f"spatial_parts {list(sp)} names {len(sp)} spatial stages but spatial_stages is "
                                 f"{self.spatial_stages}: give one entry per spatial stage")
            object.__setattr__(self, "spatial_parts", sp)
            object.__setattr__(self, "spatial_stages", len(sp))
        else:
            _pos_int("spatial_parts", self.spatial_parts)
        if self.spatial_stages is not None and (isinstance(self.spatial_stages, bool) or not isinstance(self.spatial_stages, int) or self.spatial_stages < 0):
            raise NowdlError(f"spatial_stages must be an integer >= 0, got {self.spatial_stages!r}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise NowdlError(f"unknown schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        if self.replicas is not None and self.replicas not in (1, 2):
            raise NowdlError(f"replicas must be 1 or 2 (2 = GEMS-MASTER mirrored replica), got {self.replicas}")
        if self.slice is not None and self.slice not in SLICE_METHODS:
            raise NowdlError(f"unknown slice method {self.slice!r}: use one of {', '.join(SLICE_METHODS)}")
        if self.gpu_memory is not None and (not isinstance(self.gpu_memory, (int, float)) or self.gpu_memory <= 0):
            raise NowdlError(f"gpu_memory must be a positive number of bytes (e.g. 80 * 2**30), got {self.gpu_memory!r}")
        if self.dp is not None and self.gpus % self.dp:
            raise NowdlError(f"dp ({self.dp}) must divide gpus ({self.gpus}): dp * ranks per pipeline == gpus")
        if self.nodes is not None and self.gpus_per_node is not None and self.nodes * self.gpus_per_node != self.gpus:
            raise NowdlError(f"nodes ({self.nodes}) x gpus_per_node ({self.gpus_per_node}) = "
                             f"{self.nodes * self.gpus_per_node} GPUs, but gpus is {self.gpus}: give nodes x "
                             f"gpus_per_node = gpus (e.g. --nodes {max(1, self.gpus // self.gpus_per_node)} "
                             f"--gpus-per-node {self.gpus_per_node})")
        object.__setattr__(self, "recompute", check_lever("recompute", self.recompute))
        object.__setattr__(self, "offload", check_lever("offload", self.offload))
        check_lever_pair(self.recompute, self.offload, gpus=self.gpus, stages=self.stages)
        if self.time_limit <= 0:
            raise NowdlError(f"time_limit must be positive seconds, got {self.time_limit}")
        if not 0 <= self.mip_gap < 1:
            raise NowdlError(f"mip_gap must be a relative gap in [0, 1) (0.01: within 1% of the optimum), "
                             f"got {self.mip_gap}")


@dataclass(frozen=True)
class Candidate:
    """One parallel configuration: stage count, spatial layout, replicas, dp, schedule."""

    stages: int
    micro_batches: int
    schedule: str
    replicas: int
    dp: int
    parts: int  # spatial parts of each spatial stage (1: none)
    front: int  # spatial stages at the front
    back: int  # spatial stages at the back (mirrored UNet decoder)
    slice: str
    taper: tuple[int, ...] = ()  # parts of each front spatial stage when they differ (back stages mirror)
    micro_batch_size: int = 1  # samples per micro-batch
    tiles_per_gpu: int = 1  # tiles each GPU of a spatial stage runs one after another
    recompute: tuple[int, ...] = ()  # stages that recompute their forward in the backward (costs/levers.py)
    offload: tuple[int, ...] = ()  # stages whose saved activations wait in host memory
    # (stage, cut): a recomputed stage that recomputes only its nodes before node index ``cut``
    # (a prefix of the stage: [Note: recompute segments] in costs/segments.py)
    segments: tuple[tuple[int, int], ...] = ()

    def global_batch(self) -> int:
        """Samples per optimizer step: micro-batch size x micro-batches x replicas x dp."""
        return self.micro_batch_size * self.micro_batches * self.replicas * self.dp

    def tiled_stages(self) -> list[int]:
        """Stages that run on tiles: the spatial ones, and with sequential tiles (``tiles_per_gpu``
        > 1) also those of one GPU in the front/back layout."""
        k = self.stages
        return [s for s in range(k) if s < self.front or s >= k - self.back]

    def stage_parts(self) -> list[int]:
        k = self.stages
        out = []
        for s in range(k):
            if s < self.front:
                out.append(self.taper[s] if self.taper else self.parts)
            elif s >= k - self.back:
                out.append(self.taper[k - 1 - s] if self.taper else self.parts)
            else:
                out.append(1)
        return out

    def spatial_stages(self) -> list[int]:
        return [s for s, p in enumerate(self.stage_parts()) if p > 1]

    def group_sizes(self) -> list[int]:
        """Ranks of each stage slot j (MASTER: slot j also hosts replica 2's stage K-1-j)."""
        p = self.stage_parts()
        if self.replicas == 2:
            return [max(p[j], p[self.stages - 1 - j]) for j in range(self.stages)]
        return p

    def ranks_per_pipeline(self) -> int:
        return sum(self.group_sizes())

    def inflight(self) -> list[int]:
        """Micro-batches whose whole activations each stage holds at its peak (zero bubble: those
        whose ``B`` has not run, ``zborder.zb_held``; 1F1B's min(m, K - s) in the steady state)."""
        m, k = self.micro_batches, self.stages
        if self.schedule == "gpipe":
            return [m] * k
        if self.schedule == "zb":
            return [whole for whole, _ in zb_held(k, m)]
        return [min(m, k - s) for s in range(k)]

    def deferred(self) -> list[int]:
        """Micro-batches whose deferred weight gradients (``W``) each stage holds at its peak
        besides :meth:`inflight` (zero bubble only; 0 elsewhere and on spatial stages, which do
        not defer)."""
        if self.schedule != "zb":
            return [0] * self.stages
        held = zb_held(self.stages, self.micro_batches)
        tiled = set(self.tiled_stages()) if self.tiles_per_gpu > 1 else set()
        return [0 if p > 1 or s in tiled else held[s][1] for s, p in enumerate(self.stage_parts())]


def enumerate_candidates(req: PlanRequest, *, tileable_front: bool, tileable_back: bool,
                         max_stages: int | None = None, micro_batch: int = 1,
                         image: Sequence[int] | None = None) -> Iterator[Candidate]:
    """Every configuration consistent with ``req`` whose ranks add up to ``req.gpus``.

    ``max_stages`` bounds the pipeline depth (a stage needs at least one node). Spatial parts go
    up to the GPU count, every count whose grid cuts ``image`` (the input's spatial dims) evenly
    (``grids.part_counts``); sequential tiles likewise (``grids.tile_counts``). With
    ``req.global_batch`` G, every split m x replicas x dp x b = G (b: the micro-batch size);
    without it, micro-batches of ``micro_batch`` samples (the example's batch) and m from
    ``MICRO_BATCH_CHOICES`` unless pinned.

    Args:
        tileable_front: the model starts with ops that can run on tiles.
        tileable_back: the model also ends with tileable ops (a UNet decoder), so mirrored
            spatial stages at the back are possible.
    """
    dps = [req.dp] if req.dp else [d for d in range(1, req.gpus + 1) if req.gpus % d == 0]
    reps = [req.replicas] if req.replicas else [1, 2]
    slice_ = req.slice or "square"
    tapers: list[tuple[int, ...]] = [()]
    if isinstance(req.spatial_parts, tuple):
        parts_list = [max(req.spatial_parts)]
        tapers = [req.spatial_parts]
    elif req.spatial_parts:
        parts_list = [req.spatial_parts]
    elif req.spatial_stages:
        parts_list = part_counts(req.gpus, slice_, image)
    elif tileable_front and req.spatial_stages is None:
        parts_list = [1] + part_counts(req.gpus, slice_, image)
    else:
        parts_list = [1]
    mbs = [req.micro_batches] if req.micro_batches else list(MICRO_BATCH_CHOICES)
    scheds = [req.schedule] if req.schedule else ["1f1b"]
    seen: set[Candidate] = set()
    for dp in dps:
        ranks = req.gpus // dp
        for rep in reps:
            for parts in parts_list:
                for tiles in _tiles_for(req, parts, slice_, image, tileable_front):
                    if parts == 1 and tiles == 1:
                        layouts = [(0, 0)]
                    else:
                        fronts = [req.spatial_stages] if req.spatial_stages else [1, 2]
                        layouts = [(f, 0) for f in fronts]
                        if tileable_back:
                            layouts += [(f, f) for f in fronts]
                    for front, back in layouts:
                        for taper in _tapers(tapers, parts, front, pinned=isinstance(req.spatial_parts, tuple)):
                            shape = _Shape(parts, front, back, taper, tiles)
                            yield from _stage_counts(req, ranks, rep, dp, shape, tileable_back,
                                                     mbs, scheds, slice_, micro_batch, max_stages, seen)


def _tiles_for(req: PlanRequest, parts: int, slice_: str, image: Sequence[int] | None, tileable: bool) -> list[int]:
    """Tiles per GPU to try with ``parts`` spatial parts: the pinned count, or 1 and every count
    ``grids.tile_counts`` allows (none without a tileable front, or with spatial stages forbidden
    by ``spatial_parts=1`` and tiles per GPU not pinned)."""
    if req.tiles_per_gpu is not None:
        return [req.tiles_per_gpu] if tileable or req.tiles_per_gpu == 1 else []
    if not tileable or (parts == 1 and (req.spatial_parts == 1 or req.spatial_stages == 0)):
        return [1]
    extra = tile_counts(parts, slice_, image)
    return extra if parts == 1 and req.spatial_stages else [1, *extra]


@dataclass(frozen=True)
class _Shape:
    """The spatial layout of a candidate: parts, spatial stages at each end, taper, tiles per GPU."""

    parts: int
    front: int
    back: int
    taper: tuple[int, ...]
    tiles: int


def _tapers(pinned_tapers: list[tuple[int, ...]], parts: int, front: int, *, pinned: bool) -> list[tuple[int, ...]]:
    """Per-stage parts to try: the pinned list, or equal parts, and halving P for a second stage."""
    if pinned:
        return [t for t in pinned_tapers if len(t) == front]
    out: list[tuple[int, ...]] = [()]
    if front == 2 and parts >= 4:
        out.append((parts, parts // 2))  # a deeper stage has smaller activations: fewer tiles
    return out


def _ranks_of(k: int, rep: int, parts: int, front: int, back: int, taper: tuple[int, ...]) -> int:
    """``Candidate.ranks_per_pipeline()`` in O(front + back): only slots touching a spatial stage
    hold more than one rank."""
    def p(s: int) -> int:
        if s < front:
            return taper[s] if taper else parts
        if s >= k - back:
            return taper[k - 1 - s] if taper else parts
        return 1

    special = {*range(front), *range(k - back, k)}
    if rep == 2:
        special |= {k - 1 - j for j in special}
        return k - len(special) + sum(max(p(j), p(k - 1 - j)) for j in special)
    return k - len(special) + sum(p(j) for j in special)


def batch_splits(req: PlanRequest, rep: int, dp: int, micro_batch: int, mbs: Sequence[int]) -> list[tuple[int, int]]:
    """``(micro-batches, micro-batch size)`` pairs for ``rep`` replicas and ``dp`` copies: with a
    global batch G, m x b = G / (rep x dp) with m or b as pinned, else b the example's size
    ``micro_batch`` (or the largest divisor below it: [Note: micro-batch size]); without one,
    ``mbs`` x ``micro_batch``."""
    if req.global_batch is None:
        return [(m, micro_batch) for m in mbs]
    per, rest = divmod(req.global_batch, rep * dp)
    if rest or per < 1:
        return []
    sizes = [b for b in range(req.min_micro_batch, per + 1) if per % b == 0]
    if req.micro_batch_size is not None:
        sizes = [b for b in sizes if b == req.micro_batch_size]
    elif not req.micro_batches and sizes:  # [Note: micro-batch size] in search/batch_split.py: the example's size
        sizes = [max([b for b in sizes if b <= micro_batch] or sizes[:1])]
    return [(per // b, b) for b in sizes if not req.micro_batches or per // b == req.micro_batches]


def _stage_counts(req: PlanRequest, ranks: int, rep: int, dp: int, shape: _Shape, tileable_back: bool,
                  mbs: Sequence[int], scheds: Sequence[str], slice_: str, micro_batch: int,
                  max_stages: int | None, seen: set[Candidate]) -> Iterator[Candidate]:
    parts, front, back, taper = shape.parts, shape.front, shape.back, shape.taper
    splits = batch_splits(req, rep, dp, micro_batch, mbs)
    for k in range(1, min(ranks, max_stages or ranks) + 1):
        if req.stages and k != req.stages:
            continue
        if front + back <= k and _ranks_of(k, rep, parts, front, back, taper) != ranks:
            continue  # the check below, without building the candidates
        if rep == 2 and k < 2:
            continue
        if front + back > k or (front and front + back == k and not tileable_back):
            continue
        for m, b in splits:
            for sched in scheds:
                c = Candidate(k, m, sched, rep, dp, parts, front, back, slice_, taper, b, shape.tiles)
                if c.ranks_per_pipeline() == ranks and c not in seen:
                    seen.add(c)
                    yield c
