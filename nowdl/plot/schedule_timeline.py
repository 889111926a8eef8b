"""The schedule timeline: one row per pipeline slot, one column per step, idle cells are bubbles.

Drawn from nowdl's own schedule (:mod:`nowdl.schedule`), not from
``torch.distributed.pipelining``'s visualizer: that one knows one stage per rank, while a nowdl
row may hold two stages (GEMS-MASTER, replica 1 hatched) or stand for the tiles of a spatial
stage, which run the same actions in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nowdl.plan.plan import Plan
from nowdl.schedule import Action, build_schedule, simulate

__all__ = ["Box", "Timeline", "timeline", "draw_timeline"]


@dataclass(frozen=True)
class Box:
    """One action drawn at (``row``, ``step``); ``row`` is the slot's rank."""

    row: int
    step: int
    action: Action


@dataclass
class Timeline:
    """A simulated schedule ready to draw: its boxes, and its bubbles (idle steps) per row."""

    name: str
    micro_batches: int
    replicas: int
    steps: int
    rows: list[int]
    labels: dict[int, str]
    boxes: list[Box] = field(default_factory=list)
    bubbles: dict[int, list[int]] = field(default_factory=dict)

    @property
    def idle(self) -> float:
        """Fraction of the (rows x steps) cells that are bubbles."""
        cells = max(1, self.steps * len(self.rows))
        return sum(len(b) for b in self.bubbles.values()) / cells


def _span(ranks: list[int]) -> str:
    rs = sorted(ranks)
    if len(rs) == 1:
        return f"rank {rs[0]}"
    if rs == list(range(rs[0], rs[-1] + 1)):
        return f"ranks {rs[0]}-{rs[-1]}"
    return "ranks " + ",".join(map(str, rs))


def timeline(plan: Plan) -> Timeline:
    """Simulate ``plan``'s schedule in unit steps (:func:`nowdl.schedule.simulation`).

    Rows are pipeline slots (the dp-copy-0 rank holding part 0 of its stages), labelled with
    every rank that runs that row's actions (the tiles of a spatial stage).
    """
    sched = build_schedule(plan)
    grid = simulate(sched, plan)
    rows = sorted(sched)
    slot_of = {(a.replica, a.stage): r for r in rows for a in sched[r]}
    group: dict[int, list[int]] = {r: [] for r in rows}
    for rp in plan.ranks:
        if rp.dp == 0 and rp.stages:
            keys = {(int(e.get("replica", 0)), int(e["stage"])) for e in rp.stages}
            for slot in sorted({slot_of[key] for key in keys if key in slot_of}):
                group[slot].append(rp.rank)
    labels = {}
    for r in rows:
        held = sorted({(a.replica, a.stage) for a in sched[r]})
        stages = "+".join(f"s{s}" + "'" * rep for rep, s in held)
        tiles = len(group[r])
        labels[r] = f"{_span(group[r] or [r])}\n{stages}" + (f" ({tiles} tiles)" if tiles > 1 else "")
    tl = Timeline(name=str(plan.config.get("schedule") or plan.schedule.get("name") or "1f1b"),
                  micro_batches=int(plan.config["micro_batches"]), replicas=int(plan.config.get("replicas", 1)),
                  steps=len(grid), rows=rows, labels=labels)
    for t, row in enumerate(grid):
        for r in rows:
            a = row.get(r)
            if a is None:
                tl.bubbles.setdefault(r, []).append(t)
            else:
                tl.boxes.append(Box(row=r, step=t, action=a))
    for r in rows:
        tl.bubbles.setdefault(r, [])
    return tl


_PALETTE = (0, 1, 2, 3, 4, 5, 6, 8, 9)  # tab10 without its grey (grey means idle here)
_PALETTE20 = tuple(i for i in range(20) if i not in (14, 15))


def _mb_color(i: int, m: int) -> tuple[float, float, float]:
    from matplotlib import colormaps

    if m <= len(_PALETTE):
        rgba = colormaps["tab10"](_PALETTE[i])
    else:
        rgba = colormaps["tab20"](_PALETTE20[i % len(_PALETTE20)])
    return (rgba[0], rgba[1], rgba[2])


def _light(c: tuple[float, float, float], f: float = 0.55) -> tuple[float, float, float]:
    return (c[0] + (1 - c[0]) * f, c[1] + (1 - c[1]) * f, c[2] + (1 - c[2]) * f)


def draw_timeline(ax: Any, plan: Plan) -> Timeline:
    """Draw :func:`timeline` on ``ax``: forwards light, backwards dark, one hue per micro-batch."""
    from matplotlib.patches import Patch, Rectangle

    tl = timeline(plan)
    y = {r: i for i, r in enumerate(tl.rows)}
    width_in = ax.figure.get_figwidth() * 0.8
    cell_pt = 72 * width_in / max(1, tl.steps)
    fs = max(4.0, min(8.0, cell_pt / 3.2))
    for r in tl.rows:
        for t in tl.bubbles[r]:
            ax.add_patch(Rectangle((t, y[r] - 0.42), 1, 0.84, facecolor="#f4f4f4", edgecolor="#d0d0d0",
                                   linewidth=0.4, hatch="...." if tl.steps <= 80 else None))
    for b in tl.boxes:
        a = b.action
        base = _mb_color(a.microbatch, tl.micro_batches)
        color = _light(base) if a.kind == "F" else base
        ax.add_patch(Rectangle((b.step, y[b.row] - 0.42), 1, 0.84, facecolor=color, edgecolor="white",
                               linewidth=0.6))
        if a.replica:  # replica 1 (MASTER): a hatched band at the bottom, the label stays readable
            ax.add_patch(Rectangle((b.step + 0.04, y[b.row] + 0.16), 0.92, 0.24, facecolor="white",
                                   edgecolor="black", linewidth=0.4, hatch="////"))
        if cell_pt >= 12:
            text = f"{a.kind}{a.microbatch}" + ("'" if a.replica else "")
            ax.text(b.step + 0.5, y[b.row] - (0.12 if a.replica else 0.0), text, ha="center", va="center",
                    fontsize=fs, color="black" if a.kind == "F" else "white")
    ax.set_xlim(0, tl.steps)
    ax.set_ylim(len(tl.rows) - 0.5, -0.5)
    ax.set_yticks(range(len(tl.rows)))
    ax.set_yticklabels([tl.labels[r] for r in tl.rows], fontsize=7 if len(tl.rows) <= 16 else 5)
    stride = max(1, tl.steps // 20)
    ax.set_xticks([t + 0.5 for t in range(0, tl.steps, stride)])
    ax.set_xticklabels([str(t) for t in range(0, tl.steps, stride)], fontsize=7)
    ax.set_xlabel("time step (one forward or backward of a stage on one micro-batch per step)", fontsize=8)
    ax.tick_params(axis="both", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    master = " + GEMS-MASTER" if tl.replicas == 2 else ""
    per = " per replica" if tl.replicas == 2 else ""
    ax.set_title(f"schedule: {tl.name}{master}, {tl.micro_batches} micro-batches{per}, {tl.steps} steps, "
                 f"{tl.idle:.0%} of the cells idle (bubbles, dotted grey)", fontsize=10, loc="left")
    m = tl.micro_batches
    handles = [Patch(facecolor=_mb_color(i, m), label=f"micro-batch {i}") for i in range(min(m, 12))]
    if m > 12:
        handles.append(Patch(facecolor="white", label=f"... ({m} in all)"))
    handles += [Patch(facecolor=_light((0.5, 0.5, 0.5)), label="F: forward (light)"),
                Patch(facecolor=(0.5, 0.5, 0.5), label="B: backward (dark)")]
    if tl.replicas == 2:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="////", label="' replica 1 (MASTER): hatched band"))
    handles.append(Patch(facecolor="#f4f4f4", edgecolor="#d0d0d0", hatch="....", label="idle (bubble)"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return tl
