"""Where every (dp copy, replica, stage, tile) of a plan runs: the global rank of each part."""

from __future__ import annotations

from dataclasses import dataclass

from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan

__all__ = ["Placement"]


@dataclass(frozen=True)
class Placement:
    """Where every (dp copy, replica, stage) lives: the global rank of each of its parts (tiles)."""

    k: int
    replicas: int
    dp: int
    where: dict[tuple[int, int, int], list[int]]  # (dp, replica, stage) -> global rank of each part

    @classmethod
    def from_plan(cls, plan: Plan) -> Placement:
        parts = {s.index: max(1, int(s.parts)) for s in plan.stages}
        found: dict[tuple[int, int, int], dict[int, int]] = {}
        for r in plan.ranks:
            for h in r.stages:
                found.setdefault((r.dp, h["replica"], h["stage"]), {})[int(h.get("part", 0))] = r.rank
        where: dict[tuple[int, int, int], list[int]] = {}
        for key, by_part in found.items():
            want = parts.get(key[2], 1)
            if sorted(by_part) != list(range(want)):
                raise NowdlError(f"the plan gives stage {key[2]} (replica {key[1]}, dp copy {key[0]}) parts "
                                 f"{sorted(by_part)} but the stage has {want}: the plan is inconsistent; re-plan")
            where[key] = [by_part[q] for q in range(want)]
        return cls(k=len(plan.stages), replicas=int(plan.config["replicas"]), dp=int(plan.config["dp"]), where=where)

    def rank_of(self, d: int, rep: int, stage: int, part: int = 0) -> int:
        return self.where[(d, rep, stage)][part]

    def part_ranks(self, d: int, rep: int, stage: int) -> list[int]:
        """The ranks holding the tiles of one copy of ``stage``, in part order."""
        return self.where[(d, rep, stage)]

    def group_ranks(self, stage: int) -> list[int]:
        """Every rank holding any part of any copy of ``stage`` (replicas, dp copies), sorted."""
        return sorted({r for d in range(self.dp) for rep in range(self.replicas) for r in self.where[(d, rep, stage)]})
