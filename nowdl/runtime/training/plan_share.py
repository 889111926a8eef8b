"""One plan for every rank: rank 0 makes it and broadcasts its JSON."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan

__all__ = ["plan_on_rank0"]


def plan_on_rank0(make: Callable[[], Plan], *, rank: int, world: int) -> Plan:
    """Rank 0 runs ``make()`` and broadcasts the plan; every rank returns the same Plan.

    If rank 0 fails, the other ranks (which would otherwise wait for the plan) raise a NowdlError
    carrying rank 0's message, and rank 0 re-raises its own error.
    """
    box: list[Any] = [None]
    failure: Exception | None = None
    if rank == 0:
        try:
            box[0] = make().to_json()
        except Exception as e:
            failure = e
            box[0] = {"error": str(e) if isinstance(e, NowdlError) else f"{type(e).__name__}: {e}"}
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if isinstance(box[0], dict):
        raise NowdlError(f"rank 0 could not plan: {box[0]['error']}")
    return Plan.from_json(str(box[0]), source="plan from rank 0")
