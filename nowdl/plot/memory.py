"""Per-rank predicted memory, stacked by kind, against the per-GPU cap."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nowdl.plan.plan import Plan, StagePlan, format_bytes

__all__ = ["KIND_COLORS", "OFF_DEVICE", "RankMemory", "memory_bars", "stage_memory_parts", "draw_memory"]

KIND_COLORS = {
    "parameters": "#1f77b4",
    "gradients": "#6baed6",
    "optimizer state": "#9467bd",
    "weights, gradients, optimizer": "#1f77b4",
    "saved activations": "#ff7f0e",
    "received tensors": "#2ca02c",
    "sent tensors": "#98df8a",
    "boundary tensors, workspace": "#2ca02c",
    "workspace": "#8c8c8c",
    "waiting skip gradients": "#e377c2",
    "other": "#d9d9d9",
}

OFF_DEVICE = {"recomputed (not held)": "#ff7f0e", "offloaded to host": "#17becf"}
"""Bytes a rank keeps off the GPU by recomputing or offloading (plan keys ``recomputed_bytes`` and
``offloaded_bytes``): drawn hatched above its bar, not part of its peak."""


@dataclass
class RankMemory:
    """One bar: a rank's predicted peak bytes split by kind (kinds in drawing order)."""

    rank: int
    label: str
    parts: dict[str, float] = field(default_factory=dict)
    peak: float = 0.0
    off_device: dict[str, float] = field(default_factory=dict)  # OFF_DEVICE kinds: not on the GPU


def stage_memory_parts(stage: StagePlan) -> dict[str, float]:
    """Bytes by kind held by one rank of ``stage``; they add up to its ``peak_bytes``.

    Uses the plan's breakdown (docs/plan-format.md); a plan written before it existed gives
    three kinds: static bytes, saved activations and the rest of the peak.
    """
    q = stage.predicted
    peak = float(q.get("peak_bytes", 0.0))
    inflight = float(q.get("inflight", 1.0))
    if "saved_bytes" in q:
        parts = {
            "parameters": float(q.get("weight_bytes", 0.0)),
            "gradients": float(q.get("grad_bytes", 0.0)),
            "optimizer state": float(q.get("optim_bytes", 0.0)),
            # less what one micro-batch has freed by the peak ([Note: freed by the peak])
            "saved activations": float(q.get("saved_held", inflight)) * float(q["saved_bytes"])
            - float(q.get("freed_bytes", 0.0)),
            "received tensors": float(q.get("recv_held", inflight)) * float(q.get("recv_bytes", 0.0)),
            "sent tensors": float(q.get("send_held", inflight)) * float(q.get("send_bytes", 0.0)),
            "workspace": float(q.get("workspace_bytes", 0.0)),
            "waiting skip gradients": float(q.get("wait_bytes", 0.0)),
        }
        rest = peak - sum(parts.values())
        parts["other"] = rest if rest > 1e-6 * max(peak, 1.0) else 0.0
        return parts
    static = float(q.get("static_bytes", 0.0))
    saved = inflight * float(q.get("act_bytes", 0.0))
    return {
        "weights, gradients, optimizer": static,
        "saved activations": saved,
        "boundary tensors, workspace": max(0.0, peak - static - saved),
    }


def _rank_label(plan: Plan, held: list[dict[str, int]]) -> str:
    tags = []
    for e in held:
        s = plan.stages[int(e["stage"])]
        tag = f"s{s.index}" + ("'" if int(e.get("replica", 0)) == 1 else "")
        if s.parts > 1:
            tag += f".{int(e.get('part', 0))}"
        if s.recompute_segment:  # recomputes nodes a..b-1 only: [Note: recompute segments]
            tag += f" (recompute: nodes {s.recompute_segment[0]}..{s.recompute_segment[1] - 1} of {len(s.nodes)})"
        tags.append(tag)
    return "+".join(tags) if tags else "idle"


def memory_bars(plan: Plan) -> list[RankMemory]:
    """One :class:`RankMemory` per rank of data-parallel copy 0 (the other copies are the same).

    A rank's bar is the sum over what it holds: one stage, one tile of a spatial stage, or
    (GEMS-MASTER) a stage of each replica; its ``peak`` is the plan's ``predicted_peak_bytes``.
    """
    bars = []
    for rp in sorted(plan.ranks, key=lambda r: r.rank):
        if rp.dp != 0:
            continue
        parts: dict[str, float] = {}
        off = dict.fromkeys(OFF_DEVICE, 0.0)
        for e in rp.stages:
            st = plan.stages[int(e["stage"])]
            for kind, b in stage_memory_parts(st).items():
                parts[kind] = parts.get(kind, 0.0) + b
            off["recomputed (not held)"] += float(st.predicted.get("recomputed_bytes", 0.0))
            off["offloaded to host"] += float(st.predicted.get("offloaded_bytes", 0.0))
        bars.append(RankMemory(rank=rp.rank, label=_rank_label(plan, rp.stages), parts=parts,
                               peak=float(rp.predicted_peak_bytes), off_device={k: v for k, v in off.items() if v > 0}))
    return bars


def _unit(top: float) -> tuple[float, str]:
    for scale, name in ((2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB")):
        if top >= scale:
            return scale, name
    return 1.0, "B"


def draw_memory(ax: Any, plan: Plan) -> list[RankMemory]:
    """Draw :func:`memory_bars` on ``ax``: stacked bars per rank, the cap as a dashed line."""
    bars = memory_bars(plan)
    top = max([b.peak + sum(b.off_device.values()) for b in bars] + [sum(b.parts.values()) for b in bars] + [1.0])
    cap = plan.config.get("gpu_memory")
    shown_cap = isinstance(cap, (int, float)) and cap > 0 and cap <= 2.5 * top
    ylim = max(top, float(cap) if shown_cap and cap else 0.0) * 1.12
    scale, unit = _unit(ylim)
    xs = list(range(len(bars)))
    kinds = [k for k in KIND_COLORS if any(b.parts.get(k, 0.0) > 0 for b in bars)]
    bottom = [0.0] * len(bars)
    for kind in kinds:
        vals = [b.parts.get(kind, 0.0) / scale for b in bars]
        ax.bar(xs, vals, bottom=bottom, width=0.7, color=KIND_COLORS[kind], label=kind,
               edgecolor="white", linewidth=0.5)
        bottom = [a + v for a, v in zip(bottom, vals, strict=True)]
    for kind, color in OFF_DEVICE.items():  # hatched above the bar: kept off the GPU, not in its peak
        vals = [b.off_device.get(kind, 0.0) / scale for b in bars]
        if any(v > 0 for v in vals):
            ax.bar(xs, vals, bottom=bottom, width=0.7, color="none", edgecolor=color, hatch="//", linewidth=0.8,
                   label=f"{kind}: off the GPU")
            bottom = [a + v for a, v in zip(bottom, vals, strict=True)]
    for x, b in zip(xs, bars, strict=True):
        ax.text(x, max(b.peak / scale, bottom[x]) + ylim / scale * 0.01, format_bytes(b.peak), ha="center", va="bottom",
                fontsize=7 if len(bars) <= 16 else 5, rotation=0 if len(bars) <= 12 else 90)
    handles, _ = ax.get_legend_handles_labels()
    if isinstance(cap, (int, float)) and cap > 0:
        from matplotlib.lines import Line2D

        if shown_cap:
            handles.append(ax.axhline(cap / scale, color="#d62728", linestyle="--", linewidth=1.2,
                                      label=f"cap {format_bytes(cap)}/GPU"))
            kept = sum((plan.config.get("reserve") or {}).values())
            if kept:  # [Note: memory reserve]: what the plan leaves for what it does not model
                handles.append(ax.axhspan((cap - kept) / scale, cap / scale, color="#d62728", alpha=0.12,
                                          label=f"reserved {format_bytes(kept)}: CUDA context,\nNCCL, allocator slack"))
        else:
            handles.append(Line2D([], [], color="#d62728", linestyle="--", linewidth=1.2,
                                  label=f"cap {format_bytes(cap)}/GPU: off the\nchart, at most {top / cap:.0%} used"))
    ax.set_ylim(0, ylim / scale)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{b.rank}\n{b.label}" for b in bars], fontsize=7 if len(bars) <= 16 else 5)
    pad = max(0.0, (4 - len(bars)) / 2)  # a lone bar is not drawn page-wide
    ax.set_xlim(-0.6 - pad, len(bars) - 0.4 + pad)
    ax.set_ylabel(f"predicted peak ({unit})")
    ax.set_xlabel("rank / what it holds (sS = stage S, ' = MASTER replica 1, .q = tile q)", fontsize=8)
    dp = int(plan.config.get("dp", 1))
    ax.set_title("memory per rank" + (f" (data-parallel copy 0 of {dp})" if dp > 1 else ""), fontsize=10, loc="left")
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return bars
