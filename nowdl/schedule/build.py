"""Building schedules: GPipe and 1F1B per stage, the GEMS-MASTER merge, and a plan's per-rank actions.

See :mod:`nowdl.schedule` for the orders and their in-flight bounds.

[Note: backward order] Backwards run in micro-batch order ``0 .. m-1`` in GPipe and 1F1B alike
(1F1B does so naturally; GPipe is often drawn with ``m-1 .. 0``). The gradients a stage
accumulates are then summed in the same floating-point order as a single process that runs the
backward of micro-batch 0, then 1, ..., so a pipelined step can be compared exactly with a
single-device reference.

[Note: long skips] The dependencies come from the plan's cross-stage tensors and may skip stages
(a UNet's encoder-to-decoder skips go from stage ``i`` straight to stage ``j > i + 1``). Every
edge goes forward in stage index, so each one is implied by the chain ``i -> i+1 -> ... -> j``:
the dependencies of any such DAG are a subset of the chain's (transitive) dependencies. An
execution order that satisfies the chain's dependencies therefore satisfies the DAG's too, and
the chain's deadlock-free GPipe and 1F1B orders stay deadlock-free; :func:`simulate` checks it.
The same argument covers the MASTER merge: sorting all actions by (step in their own replica,
replica) is a total order in which every dependency comes strictly earlier.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from nowdl.schedule.actions import (
    FORWARD_ONLY,
    SCHEDULES,
    Action,
    Deps,
    Schedule,
    ScheduleError,
    chain_deps,
    stage_deps,
)
from nowdl.schedule.orders import stage_order
from nowdl.schedule.simulation import simulate
from nowdl.schedule.zero_bubble_order import zero_bubble_orders

if TYPE_CHECKING:
    from nowdl.plan.plan import Plan

__all__ = ["stage_actions", "gpipe", "one_f_one_b", "zero_bubble", "build_schedule", "rank_actions"]


def _num_stages(deps: Deps) -> int:
    return len(deps[0])


# ---- per-stage orders ----------------------------------------------------------------------------
def stage_actions(schedule: str, k: int, m: int, stage: int, replica: int = 0) -> list[Action]:
    """The actions of one stage of one replica, in execution order.

    GPipe: ``F0 .. F(m-1)`` then ``B0 .. B(m-1)``. 1F1B: ``min(m, K - s)`` warm-up forwards,
    then one backward / one forward alternately, then the remaining backwards. Backwards run in
    micro-batch order 0 .. m-1 in both (see [Note: backward order]). ``"zb"``: ZB-H1, with
    ``W`` actions ([Note: zero-bubble order] in zerobubble.py). ``"forward"`` (an inference
    plan's): ``F0 .. F(m-1)`` only.

    Raises:
        ScheduleError: unknown schedule name, or ``k``, ``m``, ``stage`` out of range.
    """
    if schedule not in SCHEDULES + (FORWARD_ONLY,):
        raise ScheduleError(f"unknown pipeline schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    if k < 1 or m < 1:
        raise ScheduleError(f"stages and micro-batches must be positive, got K={k}, m={m}")
    if not 0 <= stage < k:
        raise ScheduleError(f"stage {stage} is not in 0..{k - 1}")
    if schedule == FORWARD_ONLY:
        return [Action("F", stage, i, replica) for i in range(m)]
    if schedule == "zb":
        return [Action(a.kind, a.stage, a.microbatch, replica) for a in zero_bubble_orders(k, m)[stage]]
    # the order the planner's memory model replays ([Note: long-skip gradient waits])
    return [Action(kind, stage, i, replica) for kind, i in stage_order(schedule, k, m, stage)]


def _master_stage(k: int, rank: int) -> int:
    """Replica 1's stage on the rank that holds replica 0's stage ``rank``."""
    return k - 1 - rank


def _merge(lists: Sequence[list[Action]], when: Mapping[Action, int]) -> list[Action]:
    """Merge per-(replica, stage) lists by each action's step in its own replica's schedule."""
    if len(lists) == 1:
        return list(lists[0])
    merged = [a for lst in lists for a in lst]
    merged.sort(key=lambda a: (when[Action(a.kind, a.stage, a.microbatch)], a.replica, a.stage))
    return merged


def _replica_times(schedule: str, m: int, deps: Deps) -> dict[Action, int]:
    """Step at which each replica-0 action runs in the single-replica schedule (one rank per stage)."""
    k = _num_stages(deps)
    single = {s: stage_actions(schedule, k, m, s) for s in range(k)}
    return {a: t for t, row in enumerate(simulate(single, deps)) for a in row.values() if a is not None}


def _rank_list(schedule: str, m: int, deps: Deps, held: Sequence[tuple[int, int]],
               times: dict[Action, int] | None = None) -> list[Action]:
    """The action list of a rank holding the (replica, stage) pairs ``held``."""
    k = _num_stages(deps)
    pairs = sorted(set(held))
    lists = [stage_actions(schedule, k, m, s, r) for r, s in pairs]
    if len(lists) <= 1:
        return lists[0] if lists else []
    return _merge(lists, times if times is not None else _replica_times(schedule, m, deps))


def _build(schedule: str, k: int, m: int, deps: Deps | None, replicas: int) -> Schedule:
    deps = deps if deps is not None else chain_deps(k)
    if _num_stages(deps) != k:
        raise ScheduleError(f"the dependencies describe {_num_stages(deps)} stages, not K={k}")
    if replicas not in (1, 2):
        raise ScheduleError(f"replicas must be 1 or 2 (2 = GEMS-MASTER), got {replicas}")
    if replicas == 1:
        return {s: stage_actions(schedule, k, m, s) for s in range(k)}
    times = _replica_times(schedule, m, deps)
    return {r: _rank_list(schedule, m, deps, [(0, r), (1, _master_stage(k, r))], times) for r in range(k)}


def gpipe(k: int, m: int, deps: Deps | None = None, *, replicas: int = 1) -> Schedule:
    """GPipe for ``k`` stages and ``m`` micro-batches; slot ``s`` runs stage ``s``.

    Args:
        deps: the stage DAG (default: a chain); used only to merge MASTER's two replicas.
        replicas: 2 for GEMS-MASTER: slot ``r`` also runs replica 1's stage ``k-1-r``.
    """
    return _build("gpipe", k, m, deps, replicas)


def one_f_one_b(k: int, m: int, deps: Deps | None = None, *, replicas: int = 1) -> Schedule:
    """1F1B (PipeDream-Flush) for ``k`` stages and ``m`` micro-batches; slot ``s`` runs stage ``s``.

    Args:
        deps: the stage DAG (default: a chain); used only to merge MASTER's two replicas.
        replicas: 2 for GEMS-MASTER: slot ``r`` also runs replica 1's stage ``k-1-r``.
    """
    return _build("1f1b", k, m, deps, replicas)


def zero_bubble(k: int, m: int, deps: Deps | None = None, *, replicas: int = 1) -> Schedule:
    """ZB-H1 (zero bubble) for ``k`` stages and ``m`` micro-batches; slot ``s`` runs stage ``s``.

    Args:
        deps: the stage DAG (default: a chain); used only to merge MASTER's two replicas.
        replicas: 2 for GEMS-MASTER: slot ``r`` also runs replica 1's stage ``k-1-r``.
    """
    return _build("zb", k, m, deps, replicas)


# ---- plans ------------------------------------------------------------------------------------------
def _plan_params(plan: Plan) -> tuple[str, int, int, int]:
    c = plan.config
    name = str(c.get("schedule") or plan.schedule.get("name") or "1f1b").lower()
    if name not in SCHEDULES + (FORWARD_ONLY,):
        raise ScheduleError(f"the plan asks for schedule {name!r}; this nowdl runs {', '.join(SCHEDULES)}")
    return name, len(plan.stages), int(c["micro_batches"]), int(c.get("replicas", 1))


def _slot_owners(plan: Plan) -> dict[tuple[int, int], int]:
    """(replica, stage) -> the dp-copy-0 rank holding its part 0."""
    _, k, _, replicas = _plan_params(plan)
    owner: dict[tuple[int, int], int] = {}
    for rp in plan.ranks:
        if rp.dp != 0:
            continue
        for e in rp.stages:
            if int(e.get("part", 0)) == 0:
                key = (int(e.get("replica", 0)), int(e["stage"]))
                if key in owner:
                    raise ScheduleError(f"replica {key[0]} stage {key[1]} part 0 is on ranks {owner[key]} and {rp.rank}")
                owner[key] = rp.rank
    missing = [f"replica {r} stage {s}" for r in range(replicas) for s in range(k) if (r, s) not in owner]
    if missing:
        raise ScheduleError(f"no rank of data-parallel copy 0 holds part 0 of {', '.join(missing)}: the plan's ranks are incomplete")
    return owner


def build_schedule(plan: Plan) -> Schedule:
    """The schedule of ``plan``: rank of dp copy 0 holding part 0 of a stage -> its actions.

    The other parts (tiles) of a spatial stage and the ranks of the other data-parallel copies
    run the same list (restricted to what they hold): see :func:`rank_actions`.

    Raises:
        ScheduleError: unknown schedule name, or a (replica, stage) that no rank holds.
    """
    name, k, m, _ = _plan_params(plan)
    deps = stage_deps(plan)
    owner = _slot_owners(plan)
    held: dict[int, list[tuple[int, int]]] = {}
    for key, rank in owner.items():
        held.setdefault(rank, []).append(key)
    times = _replica_times(name, m, deps) if any(len(h) > 1 for h in held.values()) else None
    return {rank: _rank_list(name, m, deps, held[rank], times) for rank in sorted(held)}


def rank_actions(plan: Plan, global_rank: int, schedule: Schedule | None = None) -> list[Action]:
    """The actions any global rank runs: its stage's part-0 rank's list, restricted to what it holds.

    Tiles of a spatial stage and ranks of other data-parallel copies run the same actions in the
    same order as the part-0 rank of data-parallel copy 0 (so collectives line up).

    Args:
        schedule: :func:`build_schedule`'s result, to avoid rebuilding it for every rank.

    Raises:
        ScheduleError: no such rank, or it holds stages whose part-0 ranks differ.
    """
    rp = next((r for r in plan.ranks if r.rank == global_rank), None)
    if rp is None:
        raise ScheduleError(f"rank {global_rank} is not in the plan (ranks 0..{len(plan.ranks) - 1})")
    owner = _slot_owners(plan)
    sched = schedule if schedule is not None else build_schedule(plan)
    held = {(int(e.get("replica", 0)), int(e["stage"])) for e in rp.stages}
    slots = {owner[h] for h in held}
    if len(slots) > 1:
        raise ScheduleError(f"rank {global_rank} holds stages run by different pipeline slots {sorted(slots)}")
    if not slots:
        return []
    return [a for a in sched[slots.pop()] if (a.replica, a.stage) in held]

