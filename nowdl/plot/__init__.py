"""Pictures of plans and runs (matplotlib, the optional extra ``nowdl[plot]``).

The numbers behind each picture (:func:`memory_bars`, :func:`timeline`, :func:`stage_graph`)
need no matplotlib; drawing imports it and says how to install it when it is missing.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.plot._mpl import FORMATS, check_plot_path, require_matplotlib
    from nowdl.plot.figure import plan_figure, plot_plan
    from nowdl.plot.graph import stage_graph
    from nowdl.plot.memory import memory_bars
    from nowdl.plot.report import plot_report, report_figure
    from nowdl.plot.schedule_timeline import timeline

__all__ = ["FORMATS", "check_plot_path", "require_matplotlib", "plan_figure", "plot_plan", "plot_report", "report_figure",
           "memory_bars", "timeline", "stage_graph"]

__getattr__ = lazy_exports(__name__, {
    "FORMATS": "_mpl", "check_plot_path": "_mpl", "require_matplotlib": "_mpl",
    "plan_figure": "figure", "plot_plan": "figure", "stage_graph": "graph",
    "memory_bars": "memory", "plot_report": "report", "report_figure": "report",
    "timeline": "schedule_timeline",
})
