"""Pipeline schedules: which forward and backward each rank runs, in what order.

A *schedule* gives every pipeline slot (a rank of data-parallel copy 0 that holds part 0 of its
stage) the list of actions it executes during one training step. An action is the forward
(``F``) or backward (``B``) of one stage on one micro-batch, for replica 0 or (GEMS-MASTER)
replica 1. Three orders are built:

* **GPipe** (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
  Parallelism", NeurIPS 2019): every stage runs all ``m`` forwards, then all ``m`` backwards.
  Peak in-flight micro-batches per stage: ``m``.
* **1F1B** (PipeDream-Flush; Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
  Training", ICML 2021): stage ``s`` of ``K`` runs ``min(m, K - s)`` warm-up forwards, then
  alternates one backward and one forward, then drains the remaining backwards. Peak in-flight
  micro-batches at stage ``s``: ``min(m, K - s)``.
* **GEMS-MASTER** (Jain et al., "GEMS: GPU-Enabled Memory-Aware Model-Parallelism System for
  Distributed DNN Training", SC'20), ``replicas=2``: a second, mirrored replica whose stage ``s``
  lives on the ranks of replica 0's stage ``K-1-s`` (``K`` odd: the middle rank holds both
  copies of the middle stage). Replica 1 trains on its own ``m`` micro-batches (micro-batches
  ``m .. 2m-1`` of the global batch; :attr:`Action.microbatch` is the index *within* the
  replica). A rank's two lists (each a GPipe or 1F1B list) are merged by the time step at which
  each action runs in its own replica's schedule, replica 0 first on ties. Each replica keeps
  its own program order, so its in-flight bound is unchanged.

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

:func:`simulate` runs a schedule in unit time steps under blocking-receive semantics (an action
runs once every action it depends on ran at an earlier step, and only after the actions before
it on its rank); :func:`format_grid` draws the result, rows = ranks, columns = steps, like
``torch.distributed.pipelining``'s schedule printouts.

Example:
    >>> print(format_grid(simulate(one_f_one_b(4, 4), chain_deps(4))))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from nowdl.errors import NowdlError

if TYPE_CHECKING:
    from nowdl.partitioner.plan import Plan

__all__ = [
    "Action",
    "Schedule",
    "Deps",
    "ScheduleError",
    "SCHEDULES",
    "LEGEND",
    "stage_deps",
    "chain_deps",
    "dag_deps",
    "stage_actions",
    "gpipe",
    "one_f_one_b",
    "build_schedule",
    "rank_actions",
    "validate_schedule",
    "simulate",
    "inflight_peaks",
    "format_grid",
    "format_plan_schedule",
]

SCHEDULES = ("gpipe", "1f1b")

LEGEND = (
    "legend: sFi = forward of stage s on micro-batch i, sBi = its backward, one action per step;\n"
    "        a prime (') marks replica 1 (GEMS-MASTER, its own micro-batches); blank = idle"
)


class ScheduleError(NowdlError):
    """A schedule is malformed, incomplete, or deadlocks (the message names the stuck ranks).

    Attributes:
        stuck: rank -> the action it is blocked at (empty unless the schedule deadlocked).
        step: the time step at which no rank could progress (-1 if not a deadlock).
    """

    def __init__(self, message: str, *, stuck: Mapping[int, Action] | None = None, step: int = -1) -> None:
        super().__init__(message)
        self.stuck: dict[int, Action] = dict(stuck or {})
        self.step = step


@dataclass(frozen=True, order=True)
class Action:
    """One forward (``"F"``) or backward (``"B"``) of ``stage`` on ``microbatch``.

    ``microbatch`` is the index within the replica (0 .. m-1). ``str()`` gives ``"2F0"`` (stage 2,
    forward, micro-batch 0) and ``"2F0'"`` for replica 1.
    """

    kind: str
    stage: int
    microbatch: int
    replica: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise ScheduleError(f"action kind must be 'F' or 'B', got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}" + "'" * self.replica


Schedule: TypeAlias = dict[int, list[Action]]
"""Pipeline slot (rank of dp copy 0 holding part 0 of its stages) -> actions in execution order."""

Deps: TypeAlias = tuple[dict[int, set[int]], dict[int, set[int]]]
"""(stage -> producer stages, stage -> consumer stages), as :func:`stage_deps` returns."""


# ---- stage dependency graphs -------------------------------------------------------------------
def stage_deps(plan: Plan) -> Deps:
    """The stage DAG of ``plan``: (stage -> producer stages, stage -> consumer stages).

    Built from ``plan.tensors`` (long skips included); tensors from or to a stage outside
    ``0 .. K-1`` (model inputs, placeholders: stage -1) and self-edges are ignored. Every stage
    appears as a key of both maps.
    """
    k = len(plan.stages)
    return dag_deps(k, ((t.from_stage, j) for t in plan.tensors for j in t.to_stages))


def chain_deps(k: int) -> Deps:
    """The dependencies of a simple chain ``0 -> 1 -> ... -> K-1``."""
    return dag_deps(k, ((s, s + 1) for s in range(k - 1)))


def dag_deps(k: int, edges: Iterable[tuple[int, int]]) -> Deps:
    """Dependencies of ``k`` stages from ``(producer, consumer)`` stage edges.

    Edges with an end outside ``0 .. k-1`` or from a stage to itself are ignored.

    Raises:
        ScheduleError: an edge goes backward (consumer < producer): pipelines need forward edges.
    """
    if k < 1:
        raise ScheduleError(f"a pipeline needs at least one stage, got {k}")
    producers: dict[int, set[int]] = {s: set() for s in range(k)}
    consumers: dict[int, set[int]] = {s: set() for s in range(k)}
    for src, dst in edges:
        if src < 0 or dst < 0 or src >= k or dst >= k or src == dst:
            continue
        if dst < src:
            raise ScheduleError(f"stage edge {src} -> {dst} goes backward: every edge must go to a later stage")
        producers[dst].add(src)
        consumers[src].add(dst)
    return producers, consumers


def _num_stages(deps: Deps) -> int:
    return len(deps[0])


# ---- per-stage orders ----------------------------------------------------------------------------
def stage_actions(schedule: str, k: int, m: int, stage: int, replica: int = 0) -> list[Action]:
    """The actions of one stage of one replica, in execution order.

    GPipe: ``F0 .. F(m-1)`` then ``B0 .. B(m-1)``. 1F1B: ``min(m, K - s)`` warm-up forwards,
    then one backward / one forward alternately, then the remaining backwards. Backwards run in
    micro-batch order 0 .. m-1 in both (see [Note: backward order]).

    Raises:
        ScheduleError: unknown schedule name, or ``k``, ``m``, ``stage`` out of range.
    """
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    if k < 1 or m < 1:
        raise ScheduleError(f"stages and micro-batches must be positive, got K={k}, m={m}")
    if not 0 <= stage < k:
        raise ScheduleError(f"stage {stage} is not in 0..{k - 1}")
    fwd = [Action("F", stage, i, replica) for i in range(m)]
    bwd = [Action("B", stage, i, replica) for i in range(m)]
    if schedule == "gpipe":
        return fwd + bwd
    warm = min(m, k - stage)
    out = fwd[:warm]
    for i in range(m - warm):
        out += [bwd[i], fwd[warm + i]]
    out += bwd[m - warm:]
    return out


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


# ---- plans ------------------------------------------------------------------------------------------
def _plan_params(plan: Plan) -> tuple[str, int, int, int]:
    c = plan.config
    name = str(c.get("schedule") or plan.schedule.get("name") or "1f1b").lower()
    if name not in SCHEDULES:
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


# ---- checking and simulation ----------------------------------------------------------------------
def validate_schedule(schedule: Schedule, k: int, m: int, replicas: int = 1) -> None:
    """Check every (replica, stage, micro-batch) forward and backward appears exactly once, F before B.

    Raises:
        ScheduleError: naming the missing, duplicated, unexpected or misordered actions.
    """
    want = {Action(kd, s, i, r) for r in range(replicas) for s in range(k) for i in range(m) for kd in "FB"}
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
        if a.kind == "B":
            f = Action("F", a.stage, a.microbatch, a.replica)
            if f in where and where[f][0] == rank and where[f][1] > pos:
                problems.append(f"{a} before {f} on rank {rank}")
    if problems:
        raise ScheduleError("invalid schedule: " + "; ".join(problems))


def _deps_of(a: Action, deps: Deps) -> list[Action]:
    producers, consumers = deps
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
    consumers, like the last, needs only its forward); all within the same replica.

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
    """(replica, stage) -> the most micro-batches whose forward ran but backward did not yet."""
    live: dict[tuple[int, int], int] = {}
    peak: dict[tuple[int, int], int] = {}
    for row in steps:
        for a in row.values():
            if a is None:
                continue
            key = (a.replica, a.stage)
            live[key] = live.get(key, 0) + (1 if a.kind == "F" else -1)
            peak[key] = max(peak.get(key, 0), live[key])
    return peak


# ---- display ------------------------------------------------------------------------------------------
def format_grid(steps: Sequence[Mapping[int, Action | None]], *, failed: tuple[int, int] | None = None,
                labels: Mapping[int, str] | None = None) -> str:
    """Draw a simulated schedule: one row per rank, one column per time step.

    Cells read ``0F1`` (stage 0 forward of micro-batch 1), ``2B0'`` (replica 1) or are blank
    (idle).

    Args:
        failed: (rank, step) where a run failed: that cell is marked ``!`` and a note follows.
        labels: rank -> row label (default ``"rank R"``).
    """
    ranks = sorted({r for row in steps for r in row} | ({failed[0]} if failed else set()))
    lab = {r: (labels or {}).get(r, f"rank {r}") for r in ranks}
    cells = [[str(row.get(r) or "") for row in steps] for r in ranks]
    n = len(steps)
    if failed is not None and failed[1] >= n:
        for c in cells:
            c.extend([""] * (failed[1] + 1 - n))
        n = failed[1] + 1
    if failed is not None:
        i = ranks.index(failed[0])
        cells[i][failed[1]] += "!"
    width = max([len(str(max(n - 1, 0)))] + [len(c) for row in cells for c in row]) + 1
    lw = max([len("step")] + [len(v) for v in lab.values()])
    lines = [f"{'step':<{lw}} |" + "".join(f"{t:>{width}}" for t in range(n))]
    lines.append("-" * len(lines[0]))
    for r, row in zip(ranks, cells, strict=True):
        lines.append(f"{lab[r]:<{lw}} |" + "".join(f"{c:>{width}}" for c in row).rstrip())
    if failed is not None:
        act = steps[failed[1]].get(failed[0]) if failed[1] < len(steps) else None
        lines.append(f"! rank {failed[0]} failed at step {failed[1]}" + (f" while running {act}" if act else ""))
    return "\n".join(lines)


def _rank_span(ranks: Sequence[int]) -> str:
    rs = sorted(ranks)
    if len(rs) == 1:
        return f"rank {rs[0]}"
    if rs == list(range(rs[0], rs[-1] + 1)):
        return f"ranks {rs[0]}-{rs[-1]}"
    return "ranks " + ",".join(str(r) for r in rs)


def format_plan_schedule(plan: Plan) -> str:
    """The schedule of ``plan`` as text: a title, the grid of :func:`simulate`, and a legend."""
    name, k, m, replicas = _plan_params(plan)
    sched = build_schedule(plan)
    steps = simulate(sched, plan)
    validate_schedule(sched, k, m, replicas)
    owner = _slot_owners(plan)
    group: dict[int, list[int]] = {slot: [] for slot in sched}
    for rp in plan.ranks:
        if rp.dp != 0 or not rp.stages:
            continue
        slots = {owner[(int(e.get("replica", 0)), int(e["stage"]))] for e in rp.stages}
        for slot in slots:
            group[slot].append(rp.rank)
    labels = {slot: _rank_span(group[slot] or [slot]) for slot in sched}
    busy = sum(1 for row in steps for a in row.values() if a is not None)
    cells = max(1, len(steps) * len(sched))
    title = (f"schedule: {name}{' + GEMS-MASTER' if replicas == 2 else ''}, {k} stage{'s' if k > 1 else ''}, {m} micro-batches"
             f"{' per replica' if replicas == 2 else ''}: {len(steps)} steps of one action each, "
             f"{1 - busy / cells:.0%} idle")
    notes = [LEGEND]
    if any(len(g) > 1 for g in group.values()):
        notes.append("a row with several ranks is a spatial stage: its tiles run the same actions in step")
    dp = int(plan.config.get("dp", 1))
    if dp > 1:
        notes.append(f"data-parallel copies 1..{dp - 1} run the same schedule on their own ranks")
    return "\n".join([title, format_grid(steps, labels=labels), *notes])
