"""The partition Problem of one candidate as the search solves it: its micro-batch size's costs,
tiles no smaller than their ops need, and sequential tiles where the candidate runs them."""

from __future__ import annotations

import dataclasses

from nowdl.partitioner.config.candidate import Candidate
from nowdl.partitioner.config.grids import grid_of
from nowdl.partitioner.costs.costmodel import Costs, build_problem, spatial_dims_of
from nowdl.partitioner.costs.problem import Problem
from nowdl.partitioner.costs.sequential_tiles import sequential_problem
from nowdl.partitioner.search.batch_split import CostsByBatch

__all__ = ["candidate_problem", "stage_grids", "too_small"]


def stage_grids(costs: Costs, cand: Candidate) -> list[tuple[int, ...]]:
    """Per stage, the whole grid of tiles it runs (P x T tiles on a tiled stage; () elsewhere)."""
    dims = spatial_dims_of(costs.profile)
    parts = cand.stage_parts()
    tiled = set(cand.tiled_stages()) if cand.tiles_per_gpu > 1 else {s for s, p in enumerate(parts) if p > 1}
    out: list[tuple[int, ...]] = []
    for s, p in enumerate(parts):
        g = grid_of(cand.slice, p * cand.tiles_per_gpu, dims) if s in tiled else None
        out.append(g or ())
    return out


def too_small(costs: Costs, grid: tuple[int, ...]) -> set[int]:
    """Nodes whose output, cut by ``grid``, leaves a tile with fewer pixels along a cut dim than
    one (or than the halo the node reads): they cannot run on such tiles. Pooled values are not
    cut."""
    out = set()
    for i, n in enumerate(costs.profile.nodes):
        sp = list(n.out_shape[2:]) if n.out_shape is not None and len(n.out_shape) >= 3 else []
        if not sp or not grid:
            continue
        g = [1] * (len(sp) - len(grid)) + list(grid)[-len(sp):]
        rule = costs.rules.get(n.name)
        if rule is not None and rule.kind in ("pooled", "whole"):
            continue  # the same whole value on every tile: [Note: whole values on tiles]
        halo = list(rule.halo) if rule is not None and rule.halo else [0]
        halo += [halo[-1]] * len(sp)
        if any(gi > 1 and size // gi < max(1, h) for size, gi, h in zip(sp, g, halo, strict=False)):
            out.add(i)
    return out


def candidate_problem(by_batch: CostsByBatch, cand: Candidate, balance: str) -> tuple[Costs, Problem]:
    """The costs of ``cand``'s micro-batch size and its Problem (see the module docstring)."""
    costs = by_batch(cand.micro_batch_size)
    problem = build_problem(costs, cand, balance)
    grids = stage_grids(costs, cand)
    largest = max(grids, key=lambda g: (len(g) > 0, _count(g)))
    small = too_small(costs, largest) if largest else set()
    if small:
        tileable = list(problem.tileable) or [True] * problem.n
        problem = dataclasses.replace(problem, tileable=[t and i not in small for i, t in enumerate(tileable)])
    if cand.tiles_per_gpu > 1:
        problem = sequential_problem(costs, problem, stages=cand.tiled_stages(), parts=cand.stage_parts(),
                                     tiles=cand.tiles_per_gpu, grids=grids)
    return costs, problem


def _count(g: tuple[int, ...]) -> int:
    n = 1
    for x in g:
        n *= x
    return n
