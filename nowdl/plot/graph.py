"""The coarse stage graph: one box per stage (its main layers named), cross-stage edges with bytes.

Stages are laid out left to right in pipeline order (every edge goes to a later stage, so this
is a layered drawing); edges to the next stage are straight arrows, long skips arcs above the
boxes, higher the further they reach, each labelled with the bytes it carries per micro-batch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from nowdl.plan.plan import Plan, StagePlan, format_bytes

__all__ = ["StageBox", "StageEdge", "StageGraph", "stage_graph", "main_layers", "draw_graph", "graph_height", "stage_color"]


@dataclass
class StageBox:
    """One stage as drawn: title, rank line and the names of its main layers."""

    stage: int
    title: str
    ranks: str
    layers: list[str]
    more: int  # layer groups not named


@dataclass
class StageEdge:
    """All tensors from stage ``src`` to stage ``dst``: how many and their bytes per micro-batch."""

    src: int
    dst: int
    tensors: int
    bytes: int

    @property
    def skip(self) -> bool:
        return self.dst > self.src + 1


@dataclass
class StageGraph:
    """The stage DAG of a plan, ready to draw."""

    boxes: list[StageBox]
    edges: list[StageEdge] = field(default_factory=list)


_OP = re.compile(r"^(conv|bn|norm|relu|act|gelu|silu|pool|drop|pad|up|down|proj|fc|linear)\w*?\d*$|^(conv|bn)\d*$")
_FUNCS = {"add", "cat", "mul", "sub", "getitem", "output", "flatten", "view", "reshape", "interpolate",
          "truediv", "matmul", "size", "contiguous", "permute", "transpose", "chunk", "split", "neg", "iadd"}


def _group(name: str) -> str | None:
    """``encoders_0_conv1`` -> ``encoders_0``; ``stages_0_8_conv1_bn`` -> ``stages_0_8``; ``add_7`` -> None."""
    segs = name.split("_")
    if segs[0] in _FUNCS and all(x.isdigit() for x in segs[1:]):
        return None
    while len(segs) > 1 and _OP.match(segs[-1]):
        segs.pop()
    return "_".join(segs)


def main_layers(nodes: list[str], limit: int = 4) -> tuple[list[str], int]:
    """Name the layer groups of a stage: module paths with their op suffix cut, in order, deduplicated.

    ``["encoders_0_conv1", "encoders_0_relu1", "add_3", "pools_0"]`` -> ``(["encoders_0", "pools_0"], 0)``
    (torch function nodes like ``add_3`` are not named); a stage of ``limit`` nodes or fewer
    names its nodes; at most ``limit`` names (the first ones
    and the last), the count of those left out second.
    """
    if len(nodes) <= limit:
        return list(nodes), 0
    groups: list[str] = []
    for n in nodes:
        g = _group(n)
        if g is not None and g not in groups:
            groups.append(g)
    if not groups:
        groups = list(dict.fromkeys(nodes))
    if len(groups) <= limit:
        return groups, 0
    return [*groups[: limit - 1], groups[-1]], len(groups) - limit


def _ranks_text(plan: Plan, s: StagePlan) -> str:
    rs = s.ranks
    text = f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs[0]}-{rs[-1]}"
    if s.parts > 1:
        text += f"\n{s.parts} tiles {'x'.join(map(str, s.grid))}"
    if int(plan.config.get("replicas", 1)) == 2:
        mirror = [rp.rank for rp in plan.ranks if rp.dp == 0
                  and any(int(e.get("replica", 0)) == 1 and int(e["stage"]) == s.index for e in rp.stages)]
        if mirror:
            text += f"\nreplica 1: {'rank ' + str(mirror[0]) if len(mirror) == 1 else f'ranks {mirror[0]}-{mirror[-1]}'}"
    return text


def stage_graph(plan: Plan, *, limit: int = 4) -> StageGraph:
    """The coarse stage graph of ``plan``: a box per stage and an edge per (from, to) stage pair."""
    boxes = []
    for s in plan.stages:
        layers, more = main_layers(s.nodes, limit)
        boxes.append(StageBox(stage=s.index, title=f"stage {s.index}", ranks=_ranks_text(plan, s),
                              layers=layers, more=more))
    agg: dict[tuple[int, int], list[int]] = {}
    for t in plan.tensors:
        for j in t.to_stages:
            e = agg.setdefault((t.from_stage, j), [0, 0])
            e[0] += 1
            e[1] += int(t.bytes)
    edges = [StageEdge(src=i, dst=j, tensors=n, bytes=b) for (i, j), (n, b) in sorted(agg.items())]
    return StageGraph(boxes=boxes, edges=edges)


def stage_color(i: int) -> tuple[float, float, float]:
    """A pale colour per stage (also used to tint nothing else: the stage is named in the box)."""
    from matplotlib import colormaps

    c = colormaps["Pastel1" if i % 18 < 9 else "Pastel2"](i % 9 if i % 18 < 9 else i % 8)
    return (c[0], c[1], c[2])


def _count(n: int) -> str:
    """38720 -> '38.7k', 3300000 -> '3.3M', 0 -> '0'."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _short(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def _arm(reach: int) -> float:
    """Height in points of a skip arc that spans ``reach`` stages."""
    return 14.0 + 13.0 * (reach - 2)


def _lines(plan: Plan, g: StageGraph) -> int:
    return max(3 + b.ranks.count("\n") + len(b.layers) + (1 if b.more else 0) + 2 for b in g.boxes)


def graph_height(plan: Plan) -> float:
    """Inches the stage graph needs: chain labels, the boxes, the highest skip arc and its label."""
    reach = max([j - t.from_stage for t in plan.tensors for j in t.to_stages] + [1])
    box = (_lines(plan, stage_graph(plan)) * 7.5 * 1.2 + 16.0) / 72.0
    return 0.45 + box + 0.35 + ((_arm(reach) + 18.0) / 72.0 if reach > 1 else 0.0)


def draw_graph(ax: Any, plan: Plan) -> StageGraph:
    """Draw :func:`stage_graph` on ``ax``: boxes sized to their text, arrows between them."""
    g = stage_graph(plan)
    k = len(g.boxes)
    span_pt = 72 * ax.figure.get_figwidth() * 0.86 / max(1, k)
    fs = 7.5 if span_pt > 90 else 6.0
    chars = max(6, int(span_pt * 0.85 / (0.62 * fs)))
    texts = []
    for b, s in zip(g.boxes, plan.stages, strict=True):
        lines = [_short(x, chars) for x in b.layers]
        if b.more:
            lines.insert(len(lines) - 1, f"… {b.more} more …")
        foot = f"{len(s.nodes)} node{'s' if len(s.nodes) != 1 else ''}, {_count(s.params)} params"
        texts.append([b.title, *b.ranks.split("\n"), "", *lines, "", foot])
    height = max(len(t) for t in texts)
    arts = []
    for b, t in zip(g.boxes, texts, strict=True):
        body = "\n".join(_short(x, chars) for x in t[:-1]) + "\n" * (height - len(t) + 1) + t[-1]
        arts.append(ax.text(b.stage, 0.0, body, ha="center", va="bottom", fontsize=fs, family="monospace",
                            linespacing=1.15, bbox=dict(boxstyle="round,pad=0.4", facecolor=stage_color(b.stage),
                                                        edgecolor="#555555", linewidth=0.8)))
    skips = [e for e in g.edges if e.skip]
    out_n: dict[int, int] = {}
    in_n: dict[int, int] = {}
    for e in g.edges:
        label = format_bytes(e.bytes) + (f" ({e.tensors} tensors)" if e.tensors > 1 else "")
        if not e.skip:
            ax.annotate("", xy=(0.0, 0.5), xycoords=arts[e.dst], xytext=(1.0, 0.5), textcoords=arts[e.src],
                        arrowprops=dict(arrowstyle="-|>", color="#333333", linewidth=1.0, shrinkA=1, shrinkB=1))
            ax.annotate(label, xy=(e.src + 0.5, 0.0), xycoords=("data", arts[e.src]), xytext=(0, -4),
                        textcoords="offset points", ha="center", va="top", fontsize=fs - 0.5)
            continue
        arm = _arm(e.dst - e.src)
        fa = 0.62 + 0.08 * out_n.get(e.src, 0)
        fb = 0.38 - 0.08 * in_n.get(e.dst, 0)
        out_n[e.src] = out_n.get(e.src, 0) + 1
        in_n[e.dst] = in_n.get(e.dst, 0) + 1
        ax.annotate("", xy=(fb, 1.0), xycoords=arts[e.dst], xytext=(fa, 1.0), textcoords=arts[e.src],
                    arrowprops=dict(arrowstyle="-|>", color="#c0392b", linewidth=1.1, shrinkA=0, shrinkB=0,
                                    connectionstyle=f"arc,angleA=90,angleB=90,armA={arm:.0f},armB={arm:.0f},rad=4"))
        ax.annotate(f"skip {e.src}→{e.dst}: {label}", xy=((e.src + e.dst) / 2, 1.0), xycoords=("data", arts[e.src]),
                    xytext=(0, arm + 2), textcoords="offset points", ha="center", va="bottom", fontsize=fs - 0.5,
                    color="#c0392b", bbox=dict(facecolor="white", edgecolor="none", pad=0.5))
    ax.set_xlim(-0.5, k - 0.5)
    ax.set_ylim(-0.45 / graph_height(plan), 1.0)
    ax.axis("off")
    ax.set_title(f"stage graph: {k} stage{'s' if k != 1 else ''}, {len(plan.tensors)} cross-stage tensors (bytes per micro-batch)"
                 + (f", {len(skips)} long skip(s) sent directly (red)" if skips else ""), fontsize=10, loc="left")
    return g
