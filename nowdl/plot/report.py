"""Pictures of a run's metrics log: loss per step, measured against predicted peak memory per rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nowdl.cli.report import Metrics, rank_peaks
from nowdl.plot._mpl import check_plot_path, new_figure, save_figure

__all__ = ["report_figure", "plot_report"]


def _unit(top: float) -> tuple[float, str]:
    for scale, name in ((2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB")):
        if top >= scale:
            return scale, name
    return 1.0, "B"


def _loss(ax: Any, m: Metrics) -> None:
    pts = [(s.step, s.loss) for s in m.steps if s.loss is not None]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="#1f77b4", linewidth=1.2,
                marker="o" if len(pts) <= 40 else None, markersize=3)
    val = [(v.step, v.values.get("loss")) for v in m.validations if v.values.get("loss") is not None]
    if val:  # validation loss on held-out images, and its Dice
        ax.plot([p[0] for p in val], [p[1] for p in val], color="#2ca02c", linewidth=1.2, marker="s", markersize=4,
                label="validation loss")
        at = dict(val)
        for v in m.validations:
            d = v.values.get("dice")
            if d is not None and v.step in at:
                ax.annotate(f"Dice {d:.2f}", (v.step, at[v.step]), fontsize=7, textcoords="offset points",
                            xytext=(0, 6), ha="center", color="#2ca02c")
        ax.legend(loc="upper right", fontsize=8)
    if not pts and not val:
        ax.text(0.5, 0.5, "no loss logged", transform=ax.transAxes, ha="center", va="center", color="#777777")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot([s.step for s in m.steps], [s.images_per_s for s in m.steps], color="#ff7f0e", linewidth=0.8,
              alpha=0.7, linestyle="--")
    twin.set_ylabel("images/s (dashed)", color="#ff7f0e")
    twin.set_ylim(bottom=0)
    ax.set_title("loss (solid) and throughput (dashed) per step", fontsize=10, loc="left")


def _memory(ax: Any, m: Metrics) -> None:
    peaks = rank_peaks(m)
    ranks = list(peaks)
    top = max([v for pair in peaks.values() for v in pair] + [1])
    scale, unit = _unit(top)
    xs = range(len(ranks))
    ax.bar([x - 0.2 for x in xs], [peaks[r][1] / scale for r in ranks], width=0.4, color="#9ecae1",
           label="predicted (plan)")
    ax.bar([x + 0.2 for x in xs], [peaks[r][0] / scale for r in ranks], width=0.4, color="#08519c",
           label="measured (max over steps)")
    for x, r in zip(xs, ranks, strict=True):
        peak, pred = peaks[r]
        if pred > 0 and len(ranks) <= 32:
            ax.text(x, max(peak, pred) / scale * 1.01, f"{peak / pred:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([str(r) for r in ranks], fontsize=8 if len(ranks) <= 32 else 5)
    ax.set_xlabel("rank (label: measured / predicted)")
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_ylim(0, top / scale * 1.15)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("peak memory per rank: predicted against measured", fontsize=10, loc="left")


def report_figure(m: Metrics) -> Any:
    """A Figure with the loss curve and the per-rank memory comparison of ``m``."""
    fig = new_figure(12.0, 7.5)
    axes = fig.subplots(2, 1)
    meta = m.meta
    what = ", ".join(f"{k} {meta[k]}" for k in ("model", "world_size") if k in meta)
    fig.suptitle(f"nowdl run: {m.path.parent}" + (f" ({what})" if what else "") + f", {len(m.steps)} steps",
                 fontsize=11)
    _loss(axes[0], m)
    _memory(axes[1], m)
    return fig


def plot_report(m: Metrics, path: str | os.PathLike[str]) -> Path:
    """Draw the metrics ``m`` into ``path`` (.png, .svg or .pdf).

    Raises:
        NowdlError: matplotlib is missing (install ``nowdl[plot]``), or ``path`` cannot be written.
    """
    check_plot_path(path)
    return save_figure(report_figure(m), path)
