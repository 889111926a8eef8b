"""Checking schedules: completeness (:func:`validate_schedule`), deadlock freedom
(:func:`simulate`, unit time steps under blocking receives) and in-flight memory
(:func:`inflight_peaks`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from nowdl.schedule.actions import Action, Deps, Schedule, ScheduleError, stage_deps

if TYPE_CHECKING:
    from nowdl.plan.plan import Plan

__all__ = ["validate_schedule", "simulate", "inflight_peaks"]


def validate_schedule(schedule: Schedule, k: int, m: int, replicas: int = 1) -> None:
    """Check every (replica, stage, micro-batch) forward and backward appears exactly once, F before B.

    A schedule with any ``W`` action (zero bubble) must have one ``W`` per backward, after it.

    Raises:
        ScheduleError: naming the missing, duplicated, unexpected or misordered actions.
    """
    kinds = "FBW" if any(a.kind == "W" for acts in schedule.values() for a in acts) else "FB"
    if all(a.kind == "F" for acts in schedule.values() for a in acts):
        kinds = "F"  # a forward-only (inference) schedule
    want = {Action(kd, s, i, r) for r in range(replicas) for s in range(k) for i in range(m) for kd in kinds}
    where: dict[Action, tuple[int, int]] = {}
    problems: list[str] = []
    for rank, acts in schedule.items():
        for pos, a in enumerate(acts):
            if a in where:
                problems.append(f"{a} twice (rank {where[a][0]} and rank {rank})")
            elif a not in want:
                problems.append(f"unexpected {a} on rank {rank}")
            where[a] = (rank, pos)
    missing = sorted(want - set(where), key=lambda a: (a.replica, a.stage, a.microbatch, a.kind != "F"))
    if missing:
        shown = ", ".join(str(a) for a in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        problems.append(f"missing {shown}")
    for a, (rank, pos) in where.items():
        if a.kind != "F":
            f = Action("F" if a.kind == "B" else "B", a.stage, a.microbatch, a.replica)
            if f in where and where[f][0] == rank and where[f][1] > pos:
                problems.append(f"{a} before {f} on rank {rank}")
    if problems:
        raise ScheduleError("invalid schedule: " + "; ".join(problems))


def _deps_of(a: Action, deps: Deps) -> list[Action]:
    producers, consumers = deps
    if a.kind == "W":
        return [Action("B", a.stage, a.microbatch, a.replica)]
    if a.kind == "F":
        return [Action("F", p, a.microbatch, a.replica) for p in sorted(producers.get(a.stage, ()))]
    return [Action("F", a.stage, a.microbatch, a.replica)] + [
        Action("B", c, a.microbatch, a.replica) for c in sorted(consumers.get(a.stage, ()))
    ]


def simulate(schedule: Schedule, plan: Plan | Deps) -> list[dict[int, Action | None]]:
    """Run ``schedule`` in unit time steps; returns one {rank: action or None (idle)} per step.

    Each step, every rank runs its next action if all the actions it depends on ran at an
    earlier step: ``F(s, i)`` needs ``F(p, i)`` for every producer stage ``p`` of ``s``;
    ``B(s, i)`` needs ``F(s, i)`` and ``B(c, i)`` for every consumer stage ``c`` (a stage without
    consumers, like the last, needs only its forward); ``W(s, i)`` needs ``B(s, i)``; all within
    the same replica.

    Args:
        plan: a Plan (its stage DAG is used) or the dependencies themselves (:func:`stage_deps`,
            :func:`chain_deps`, :func:`dag_deps`).

    Raises:
        ScheduleError: an action is listed twice, or the schedule deadlocks; the message names
            every stuck rank, the action it is blocked at and what that action waits for.
    """
    deps: Deps = plan if isinstance(plan, tuple) else stage_deps(plan)
    ranks = sorted(schedule)
    seen: dict[Action, int] = {}
    for r in ranks:
        for a in schedule[r]:
            if a in seen:
                raise ScheduleError(f"{a} is scheduled twice (rank {seen[a]} and rank {r})")
            seen[a] = r
    total = len(seen)
    done: set[Action] = set()
    pos = dict.fromkeys(ranks, 0)
    steps: list[dict[int, Action | None]] = []
    while len(done) < total:
        row: dict[int, Action | None] = {}
        for r in ranks:
            nxt = schedule[r][pos[r]] if pos[r] < len(schedule[r]) else None
            row[r] = nxt if nxt is not None and all(d in done for d in _deps_of(nxt, deps)) else None
        if all(x is None for x in row.values()):
            stuck = {r: schedule[r][pos[r]] for r in ranks if pos[r] < len(schedule[r])}
            parts = []
            for r, blocked in stuck.items():
                waits = [f"{d}" + ("" if d in seen else " (never scheduled)")
                         for d in _deps_of(blocked, deps) if d not in done]
                parts.append(f"rank {r} at {blocked} (waits for {', '.join(waits)})")
            raise ScheduleError(
                f"the schedule deadlocks at step {len(steps)} after {len(done)} of {total} actions: "
                + "; ".join(parts),
                stuck=stuck, step=len(steps),
            )
        for r, ran in row.items():
            if ran is not None:
                done.add(ran)
                pos[r] += 1
        steps.append(row)
    return steps


def inflight_peaks(steps: Sequence[Mapping[int, Action | None]]) -> dict[tuple[int, int], int]:
    """(replica, stage) -> the most micro-batches whose forward ran but backward did not yet
    (zero bubble: whose ``W`` did not yet: the deferred weight gradient holds its inputs)."""
    live: dict[tuple[int, int], int] = {}
    peak: dict[tuple[int, int], int] = {}
    ends = "W" if any(a is not None and a.kind == "W" for row in steps for a in row.values()) else "B"
    for row in steps:
        for a in row.values():
            if a is None or a.kind not in ("F", ends):
                continue
            key = (a.replica, a.stage)
            live[key] = live.get(key, 0) + (1 if a.kind == "F" else -1)
            peak[key] = max(peak.get(key, 0), live[key])
    return peak

