"""``--recompute`` and ``--offload`` on ``nowdl plan`` and ``nowdl run``, and what a plan's choices cost.

The flags take what ``compile(recompute=..., offload=...)`` takes ([Note: lever settings] in
partitioner/config/lever_options.py): ``auto``, ``on``, ``off`` or stage indices ``0,2``.
:func:`format_levers` is the text ``nowdl plan`` and ``nowdl show`` print under the plan: per
stage that recomputes or offloads, the time it adds and the bytes it moves off the GPU.
"""

from __future__ import annotations

import argparse
from typing import Any

from nowdl.errors import NowdlError
from nowdl.partitioner.config.lever_options import LeverSetting, check_lever
from nowdl.plan.plan import Plan, StagePlan, format_bytes

__all__ = ["add_lever_arguments", "lever_arg", "lever_kwargs", "format_levers", "segment_text"]


def lever_arg(text: str) -> LeverSetting:
    """Parse ``auto``, ``on``, ``off`` or ``0,2`` (argparse type; a bad value exits 2 naming it)."""
    t = text.strip()
    value: object = t
    if t and all(part.strip().isdigit() for part in t.split(",")):
        value = [int(part) for part in t.split(",")]
    try:
        return check_lever("setting", value)
    except NowdlError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not auto, on, off or a list of stage indices such as 0,2") from None


def add_lever_arguments(p: argparse.ArgumentParser, plan: bool = False) -> None:
    """Add ``--recompute`` and ``--offload`` to ``p`` (``plan``: and ``--norm-schedule``)."""
    if plan:
        p.add_argument("--norm-schedule", choices=("auto", "passes", "layerwise"), default="auto",
                       help="how a stage of sequential tiles gathers its norms' statistics: auto (the cheaper that fits "
                            "host memory; default), passes (statistics passes) or layerwise (boundaries in host memory)")
    p.add_argument("--recompute", type=lever_arg, default="auto", metavar="auto|on|off|S,..",
                   help="recompute a stage's forward in its backward instead of keeping its saved activations: "
                        "auto (only stages that do not fit the cap otherwise; default), on (every stage), off, or "
                        "the stage indices (e.g. 0,1)")
    p.add_argument("--offload", type=lever_arg, default="auto", metavar="auto|on|off|S,..",
                   help="keep a stage's saved activations in host memory between forward and backward (needs the "
                        "device spec's host_memory): auto (default), on, off, or the stage indices")


def lever_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``compile()`` keywords of the two flags (absent flags: "auto")."""
    return {"recompute": getattr(args, "recompute", "auto"), "offload": getattr(args, "offload", "auto")}


def _time(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def segment_text(s: StagePlan) -> str:
    """' nodes a..b (x of y saved per micro-batch, n of N nodes)' for a stage that recomputes a
    segment ([Note: recompute segments]); "" for a whole stage."""
    if not s.recompute_segment:
        return ""
    a, b = s.recompute_segment
    seg = float(s.predicted.get("segment_bytes", 0.0))
    return (f" nodes {s.nodes[a]}..{s.nodes[b - 1]} ({format_bytes(seg)} of "
            f"{format_bytes(float(s.predicted.get('act_bytes', 0.0)))} saved per micro-batch, {b - a} of "
            f"{len(s.nodes)} nodes)")


def _norm_text(s: StagePlan, m: int) -> str:
    """', +x/step statistics passes for its norms' and, layer-wise ([Note: layer-wise norms cost]),
    its host copies and host memory; "" for a stage without such norms."""
    q = s.predicted
    if s.norm_schedule == "layerwise":
        return (f", norms layer-wise: +{_time(m * float(q.get('norm_passes_s', 0.0)))}/step forward for their sums, +"
                f"{_time(m * float(q.get('norm_host_s', 0.0)))}/step host copies, "
                f"{format_bytes(float(q.get('norm_host_bytes', 0.0)))} per GPU in host memory")
    return f", +{_time(m * float(q['norm_passes_s']))}/step statistics passes for its norms" if q.get("norm_passes_s") else ""


def format_levers(plan: Plan) -> str:
    """One line per stage that recomputes or offloads: the seconds it adds per step (its
    per-micro-batch figure x micro-batches) and the bytes per GPU it keeps off the device; ""
    when no stage does."""
    m = int(plan.config.get("micro_batches", 1) or 1)
    lines = []
    for s in plan.stages:
        q = s.predicted
        if s.recompute:
            lines.append(f"stage {s.index}: recompute{segment_text(s)} (+{_time(m * float(q.get('recompute_s', 0.0)))}"
                         f"/step of its work, saves {format_bytes(float(q.get('recomputed_bytes', 0.0)))} per GPU at "
                         "the peak)")
        if s.offload:
            lines.append(f"stage {s.index}: offload (+{_time(m * float(q.get('offload_s', 0.0)))}/step of host "
                         f"copies not hidden by compute, {format_bytes(float(q.get('offloaded_bytes', 0.0)))} per GPU "
                         "in host memory)")
        if s.tiles_per_gpu > 1:  # [Note: sequential tiles cost]: each term on its own line, none under comm_s
            lines.append(f"stage {s.index}: {s.tiles_per_gpu} tiles per GPU in turn (+"
                         f"{_time(m * float(q.get('seq_recompute_s', 0.0)))}/step forward recomputed in the backward, +"
                         f"{_time(m * float(q.get('seq_margin_s', 0.0)))}/step on the tiles' margins"
                         + _norm_text(s, m) + ")")
    if not lines:
        return ""
    host = plan.config.get("host_memory")
    tail = f"; host memory for offload: {format_bytes(float(host))} per GPU" if isinstance(host, (int, float)) else ""
    return "\n".join([f"levers (recompute {plan.config.get('recompute', '?')}, offload "
                      f"{plan.config.get('offload', '?')}{tail}):", *lines])
