"""One picture of a plan: memory per rank, the schedule timeline and the stage graph."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nowdl.plan.plan import Plan, format_bytes
from nowdl.plot._mpl import check_plot_path, new_figure, save_figure
from nowdl.plot.graph import draw_graph, graph_height
from nowdl.plot.memory import draw_memory
from nowdl.plot.schedule_timeline import draw_timeline

__all__ = ["plan_figure", "plot_plan"]


def _title(plan: Plan) -> str:
    c, pr = plan.config, plan.predicted
    shape = "x".join(str(d) for d in plan.model["inputs"][0])
    sp = c.get("spatial") or {}
    extra = " + GEMS-MASTER" if int(c.get("replicas", 1)) == 2 else ""
    if sp.get("stages"):
        extra += f", spatial stages {sp['stages']}"
    if int(c.get("dp", 1)) > 1:
        extra += f", dp {c['dp']}"
    return (f"nowdl plan: {plan.model.get('name', '?')} {shape} on {c['gpus']} GPUs: {c['stages']} stage{'s' if c['stages'] != 1 else ''}, "
            f"{c.get('schedule', '?')}, {c['micro_batches']} micro-batches{extra}; predicted peak "
            f"{format_bytes(pr.get('peak_bytes', 0))}/GPU, step {pr.get('step_s', 0) * 1e3:.0f} ms, "
            f"{pr.get('throughput', 0):.3g} images/s")


def plan_figure(plan: Plan) -> Any:
    """A matplotlib Figure with the three panels of ``plan`` (see docs/pictures.md)."""
    rows = len({r.rank for r in plan.ranks if r.dp == 0})
    slots = len(plan.stages) * (1 + (int(plan.config.get("replicas", 1)) == 2))
    tl_h = 1.2 + 0.42 * min(slots, 32)
    g_h = graph_height(plan)
    fig = new_figure(15.0, 3.6 + tl_h + g_h + (0.6 if rows > 16 else 0.0))
    axes = fig.subplots(3, 1, height_ratios=[3.6, tl_h, g_h])
    fig.suptitle(_title(plan), fontsize=11)
    draw_memory(axes[0], plan)
    draw_timeline(axes[1], plan)
    draw_graph(axes[2], plan)
    return fig


def plot_plan(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Draw ``plan`` into ``path`` (.png, .svg or .pdf).

    Raises:
        NowdlError: matplotlib is missing (install ``nowdl[plot]``), or ``path`` cannot be written.

    Example:
        >>> plot_plan(nowdl.Plan.load("experiments/unet_8192_sp4x2.json"), "unet.png")
    """
    check_plot_path(path)
    return save_figure(plan_figure(plan), path)
