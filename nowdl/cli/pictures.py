"""What ``nowdl show/plan --plot`` and ``nowdl report`` do, kept out of cli.py (this prints)."""

from __future__ import annotations

from nowdl.plan.plan import Plan
from nowdl.plot import check_plot_path, require_matplotlib

__all__ = ["check_plot", "draw_plan", "report_command"]


def check_plot(path: str) -> None:
    """Refuse a --plot FILE nowdl cannot write, or a missing matplotlib, before any work.

    Raises:
        NowdlError: unknown suffix, missing or read-only folder, or no matplotlib.
    """
    check_plot_path(path)
    require_matplotlib()


def draw_plan(plan: Plan, path: str, *, quiet: bool = False) -> None:
    """Draw ``plan`` into ``path`` and say so (unless ``quiet``: stdout carries JSON)."""
    from nowdl.plot.figure import plot_plan

    plot_plan(plan, path)
    if not quiet:
        print(f"drew {path}")


def report_command(log_dir: str, plot: str | None) -> int:
    """``nowdl report DIR [--plot FILE]``: print the summary of the metrics log, draw it; exit status."""
    from nowdl.cli.report import read_metrics, summary

    metrics = read_metrics(log_dir)
    if plot:
        check_plot(plot)
    print(summary(metrics))
    if plot:
        from nowdl.plot.report import plot_report

        plot_report(metrics, plot)
        print(f"drew {plot}")
    return 0
