"""What one rank runs of a plan: its actions, the stages it holds, the values they exchange."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nowdl.codegen.stage import StageModule
from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan
from nowdl.runtime.pipeline.ranks import Placement
from nowdl.schedule import Action, rank_actions

__all__ = ["RankView"]


@dataclass(frozen=True)
class RankView:
    """The facts about one rank that the transfers, the gradient sync and the runner share.

    ``held`` lists the (replica, stage) copies this rank runs, ``part`` the tile of each one it
    holds, ``parts`` the number of tiles of every stage; ``meta`` maps each value crossing
    stages to its full shape and dtype, ``value_ids`` to the number its message tags use.
    """

    plan: Plan
    rank: int
    place: Placement
    dp_index: int
    m: int
    actions: list[Action]
    stages: dict[int, StageModule]
    held: list[tuple[int, int]]
    part: dict[tuple[int, int], int]
    parts: list[int]
    device: torch.device
    comm_dtype: torch.dtype | None
    meta: dict[str, tuple[tuple[int, ...], torch.dtype]]
    value_ids: dict[str, int]

    @property
    def k(self) -> int:
        """The number of stages; stage ``k`` stands for the model's output (the loss)."""
        return self.place.k

    @classmethod
    def build(cls, plan: Plan, stages: Sequence[StageModule], rank: int, device: torch.device,
              comm_dtype: torch.dtype | None) -> RankView:
        """This rank's view of ``plan`` (``stages``: every stage built on this rank)."""
        place = Placement.from_plan(plan)
        me = next((r for r in plan.ranks if r.rank == rank), None)
        if me is None:
            raise NowdlError(f"rank {rank} is not in the plan (ranks 0..{len(plan.ranks) - 1})")
        value_ids = {name: i for i, name in enumerate(sorted(
            {n for s in stages for n in list(s.inputs) + list(s.outputs)}))}
        meta = {t.producer: (tuple(t.shape), getattr(torch, t.dtype.replace("torch.", ""))) for t in plan.tensors}
        return cls(
            plan=plan, rank=rank, place=place, dp_index=me.dp,
            m=int(plan.config["micro_batches"]), actions=rank_actions(plan, rank),
            stages={s.index: s for s in stages},
            held=sorted({(h["replica"], h["stage"]) for h in me.stages}),
            part={(h["replica"], h["stage"]): int(h.get("part", 0)) for h in me.stages},
            parts=[max(1, int(st.parts)) for st in plan.stages],
            device=device, comm_dtype=comm_dtype, meta=meta, value_ids=value_ids,
        )
