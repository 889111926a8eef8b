"""One node's spatial rule: whether it runs on tiles, why not, the halo it reads and its kind."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SpatialRule"]


@dataclass(frozen=True)
class SpatialRule:
    """Whether a node can run on tiles, why not, and the halo (per spatial dim) it reads."""

    tileable: bool
    reason: str = ""
    halo: tuple[int, ...] = ()  # extra input pixels needed on each side, per spatial dim
    # conv, pool, upsample, norm, elementwise, concat, io; shape (a size read off the whole image),
    # pooled (an average over every tile) and whole (computed on a pooled value, the same on every
    # tile): [Note: whole values on tiles] in nowdl/partitioner/spatial/whole_values.py
    kind: str = ""
    # input pixels an output pixel reads beyond its own footprint, per dim, as sequential tiles'
    # windows count them ([Note: stage reach] in runtime/spatial/reach.py); () where it is the halo
    reach: tuple[float, ...] = ()
