"""Drawing schedules: :func:`format_grid` (rows = ranks, columns = time steps) and
:func:`format_plan_schedule` (a plan's schedule with a title and a legend, for ``nowdl show``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from nowdl.schedule.actions import Action
from nowdl.schedule.build import _plan_params, _slot_owners, build_schedule
from nowdl.schedule.simulation import simulate, validate_schedule

if TYPE_CHECKING:
    from nowdl.plan.plan import Plan

__all__ = ["LEGEND", "format_grid", "format_plan_schedule"]

LEGEND = (
    "legend: sFi = forward of stage s on micro-batch i, sBi = its backward (zb: input gradients only),\n"
    "        sWi = its deferred weight gradients (zb), one action per step;\n"
    "        a prime (') marks replica 1 (GEMS-MASTER, its own micro-batches); blank = idle"
)


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
