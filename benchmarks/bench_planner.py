"""Planner benchmark: nowdl's partition against the usual baselines, and how long planning takes.

What is measured
----------------
Table 1 (quality). For nowdl's UNet, ResNet-110-v2, AmoebaNet-D and MONAI's UNet, at
1024² and 2048² (batch 1, a meta input), and K = 2, 4, 8 pipeline stages, the model is traced
with ``nowdl.trace.tracer.trace`` and profiled in estimate mode on the built-in ``h100`` device spec
(Adam optimizer state). The partition Problem is built with
``build_problem(Costs(..., mem_cap=None), Candidate(stages=K, micro_batches=K,
schedule="1f1b", replicas=1, dp=1, parts=1, front=0, back=0, slice="square"), objective)``
for objective "memory" (Table 1a, bottleneck = largest rank memory, GiB) and "compute"
(Table 1b, bottleneck = slowest rank's time per micro-batch, ms). nowdl's ``solve`` is
compared on the SAME Problem, all evaluated by the same cost model (``evaluate``), with three
contiguous splits of one topological order (``topological_order(problem)``):

* params - balance parameter bytes (DeepSpeed / PiPPy "parameters" balancing:
  ``balance_by_params``, an exact min-max split of the per-node static bytes);
* block  - torchgpipe's block-partition algorithm (``balance_by_weights``) on the objective's
  own per-node weights (see the notes the script prints for the exact weights);
* count  - equal node counts per stage (MPI4DL's default, ``balance_by_count``).

Table 2 (planning time, end to end). CIFAR-style ResNet v1 graphs of growing depth
(``resnet(depth=d, version=1)``: about 100, 500, 1,000 and 2,000 fx nodes) at 1024², and
AmoebaNet-D (1,095 nodes) at 1024²: ``nowdl.compile(model, gpus=8, balance=..., stages=8 or
unpinned, mode="estimate", device_spec="h100", progress=False, cache=False).plan(x)`` on a
fresh ``compile`` each time (cold: trace, estimate profile, configuration search and MILP all
run), median of ``--repeats`` runs. The columns split it into trace (with its eager check),
profile and search (bounds, DP, MILP, tie-breaks: "solve-only"), and give the configuration
chosen, its solver status and gap. The first plan of a process also pays one-time imports
(``torch._dynamo`` for fake tensors); a warm-up plan of a tiny model pays them first and the
script prints how long that took.

Targets (issue #9): plan end to end in <= 3 s for <= 500 nodes, <= 30 s up to 2,000 nodes
(gpus=8), the chosen configuration proven optimal or its gap <= 1%; bottleneck memory <= 0.8x
parameter balancing on the 2048² UNet and ResNet; never worse than the block partition. Rows
are marked with a check mark or a cross; nothing is asserted.

Table 3 (``--wide``, only it): wide graphs (issue 32), see ``benchmarks/wide_table.py``: MONAI's
SwinUNETR, BasicUNetPlusPlus and UNETR at the docs/models.md widths planned end to end with the
default PlannerOptions (the anytime split) at K = 4 and 8, against the previous planner's 120 s
splits (``benchmarks/wide_reference.json``, made by ``benchmarks/wide_graphs.py --reference``), with
wall and CPU seconds and the load average; AmoebaNet-D (1024², K = 8, memory) against its proven
optimum; ``--wide-real`` adds the real widths.

How to run
----------
    .venv/bin/python benchmarks/bench_planner.py [--quick] [--markdown] [--speed-only]
        [--repeats N] [--time-limit S] [--wide [--wide-real]]

``--quick`` runs a few small cases (a smoke run, a couple of minutes); ``--speed-only`` skips
Table 1; ``--markdown`` prints the tables as Markdown. Progress goes to stderr, the tables to
stdout. The full run takes about 25 minutes on a 2-core CPU machine (no GPU needed: profiling
is an estimate).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

import nowdl
from nowdl.models import amoebanetd, resnet, resnet110v2, unet
from nowdl.partitioner.baselines import (
    balance_by_count,
    balance_by_params,
    balance_by_weights,
)
from nowdl.partitioner.config.candidate import Candidate
from nowdl.partitioner.costs.costmodel import Costs, build_problem
from nowdl.partitioner.costs.problem import Partition, Problem
from nowdl.partitioner.costs.structure import topological_order
from nowdl.partitioner.solver import solve
from nowdl.partitioner.spatial.tileable import spatial_rules
from nowdl.plan.plan import Plan
from nowdl.profiler import get_device_spec, profile

# ``trace`` is imported from its module: ``nowdl.trace.tracer`` the attribute may be shadowed.
from nowdl.trace.tracer import trace

GIB = 2.0**30
DEVICE_SPEC = "h100"
OPTIMIZER = "adam"
OBJECTIVES = ("memory", "compute")
REL_TOL = 1e-6  # "never worse" allows this relative slack (float sums in a different order)

# Targets of the issue (end to end, gpus=8).
FAST_NODES, FAST_SECONDS = 500, 3.0
BIG_NODES, BIG_SECONDS = 2000, 30.0
GAP_TARGET = 0.01
PARAMS_RATIO_TARGET = 0.8
PARAMS_TARGET_MODELS = ("nowdl UNet", "MONAI UNet", "ResNet-110-v2")
PARAMS_TARGET_IMAGE = 2048

OK, BAD, NA = "✓", "✗", "—"

_T0 = time.perf_counter()

from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402


def progress(msg: str) -> None:
    """One progress line on stderr, with the elapsed time of the run."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


# ---- models ------------------------------------------------------------------------------------


def monai_unet() -> nn.Module:
    """MONAI's 2D UNet, 5 levels (64..1024 channels), 2 residual units per level."""
    from monai.networks.nets import UNet as MonaiUNet

    return MonaiUNet(spatial_dims=2, in_channels=3, out_channels=2,
                     channels=(64, 128, 256, 512, 1024), strides=(2, 2, 2, 2), num_res_units=2)


#: (row label, builder, description printed in the notes)
QUALITY_MODELS: list[tuple[str, Callable[[], nn.Module], str]] = [
    ("nowdl UNet", unet, "nowdl.models.unet() defaults: depth 4, base 64, 3 -> 2 channels"),
    ("ResNet-110-v2", resnet110v2, "nowdl.models.resnet110v2() (bottleneck blocks, width 16)"),
    ("AmoebaNet-D", amoebanetd, "nowdl.models.amoebanetd() defaults: 18 normal cells, 416 filters"),
    ("MONAI UNet", monai_unet, "monai.networks.nets.UNet(2D, 3 -> 2, channels 64..1024, "
     "strides 2x4, num_res_units=2)"),
]

#: ResNet v1 depths (6n+2) giving about 100, 500, 1000 and 2000 fx nodes.
SPEED_DEPTHS = (26, 140, 284, 572)
SPEED_IMAGE = 1024
SPEED_GPUS = 8


# ---- profiling ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profiled:
    """A traced and profiled model at one input size, ready to build Problems from."""

    costs: Costs
    nodes: int
    trace_s: float
    profile_s: float


def profile_at(model: nn.Module, image: int) -> Profiled:
    """Trace ``model`` on a (1, 3, image, image) meta input and profile it in estimate mode."""
    x = torch.empty(1, 3, image, image, device="meta")
    t0 = time.perf_counter()
    traced = trace(model, (x,))
    t1 = time.perf_counter()
    prof = profile(traced.gm, (x,), mode="estimate", device_spec=DEVICE_SPEC, optimizer=OPTIMIZER,
                   cache=False, progress=False)
    t2 = time.perf_counter()
    spec = get_device_spec(DEVICE_SPEC)
    costs = Costs(profile=prof, rules=spatial_rules(traced.gm), link_bw=float(spec.link_bw),
                  mem_cap=None)
    return Profiled(costs=costs, nodes=len(prof.nodes), trace_s=t1 - t0, profile_s=t2 - t1)


def candidate(k: int) -> Candidate:
    """K plain pipeline stages, K micro-batches, 1F1B, no replica, no data or spatial parallelism."""
    return Candidate(stages=k, micro_batches=k, schedule="1f1b", replicas=1, dp=1, parts=1,
                     front=0, back=0, slice="square")


# ---- baselines and metrics ---------------------------------------------------------------------


def mean_inflight(problem: Problem) -> float:
    """Average micro-batches in flight per stage ((K+1)/2 for 1F1B with m = K)."""
    return sum(s.inflight for s in problem.stages) / problem.k


def block_weights(problem: Problem) -> list[float]:
    """Per-node weights for the block-partition baseline, matching the problem's objective.

    memory:  static bytes + mean_inflight * saved activation bytes of the node;
    compute: the node's fwd + bwd time (torchgpipe's ``balance_by_time``).
    """
    vec = problem.variants["plain"]
    if problem.objective == "compute":
        return [float(t) for t in vec.time]
    inflight = mean_inflight(problem)
    return [float(s) + inflight * float(a) for s, a in zip(problem.static, vec.act, strict=True)]


def bottleneck(part: Partition, objective: str) -> float:
    """GiB for the memory objective, ms for the compute objective."""
    return part.bottleneck_mem / GIB if objective == "memory" else part.bottleneck_time * 1e3


def rank_values(part: Partition, objective: str) -> list[float]:
    if objective == "memory":
        return [m / GIB for m in part.rank_mem]
    return [t * 1e3 for t in part.rank_time]


def mem_breakdown(problem: Problem, stage_of: Sequence[int], stage: int) -> dict[str, float]:
    """GiB of one stage's memory by term of the cost model (static, activations, received, ws)."""
    vec = problem.variants[problem.stages[stage].variant]
    members = [v for v in range(problem.n) if stage_of[v] == stage]
    received: set[int] = set()
    for u, v in problem.edges:
        if stage_of[v] == stage and stage_of[u] < stage:
            received.add(u)
    inflight = problem.stages[stage].inflight
    return {
        "static": sum(problem.static[v] for v in members) / GIB,
        "act": inflight * sum(vec.act[v] for v in members) / GIB,
        "recv": inflight * sum(vec.out[u] for u in received) / GIB,
        "ws": max((vec.workspace[v] for v in members), default=0.0) / GIB,
        "inflight": float(inflight),
        "nodes": float(len(members)),
    }


def time_target(nodes: int, seconds: float) -> str:
    """The issue's wall-time target for a graph of ``nodes`` nodes (K <= 8)."""
    if nodes <= FAST_NODES:
        return OK if seconds <= FAST_SECONDS else BAD
    if nodes <= BIG_NODES * 1.05:
        return OK if seconds <= BIG_SECONDS else BAD
    return NA


def load_average() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        return "?"


def fmt(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}g}" if abs(x) < 10**digits else f"{x:.0f}"


def fmt_ratio(x: float) -> str:
    return f"{x:.3f}"


# ---- tables ------------------------------------------------------------------------------------


def render(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> str:
    """A Markdown table, or an aligned plain-text one."""
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def heading(title: str, markdown: bool) -> str:
    return f"\n### {title}\n" if markdown else f"\n{title}\n{'=' * len(title)}"


def notes(lines: Sequence[str], markdown: bool) -> str:
    """A bullet list; a line starting with two spaces is a sub-item of the one before."""
    out = []
    for s in lines:
        nested = s.startswith("  ")
        if markdown:
            out.append(("  - " if nested else "- ") + s.strip())
        else:
            out.append(("      - " if nested else "  * ") + s.strip())
    return "\n".join(out)


# ---- Table 1: quality --------------------------------------------------------------------------


@dataclass
class QualityRow:
    model: str
    image: int
    k: int
    objective: str
    nodes: int
    nowdl: Partition
    params: Partition
    block: Partition
    count: Partition
    problem: Problem

    def value(self, which: str) -> float:
        return bottleneck(getattr(self, which), self.objective)

    @property
    def vs_params(self) -> float:
        return self.value("nowdl") / self.value("params")

    @property
    def vs_block(self) -> float:
        return self.value("nowdl") / self.value("block")

    @property
    def not_worse_than_block(self) -> bool:
        return self.value("nowdl") <= self.value("block") * (1 + REL_TOL)

    @property
    def params_target_applies(self) -> bool:
        return (self.objective == "memory" and self.model in PARAMS_TARGET_MODELS
                and self.image == PARAMS_TARGET_IMAGE)

    @property
    def params_target(self) -> str:
        if not self.params_target_applies:
            return NA
        return OK if self.vs_params <= PARAMS_RATIO_TARGET else BAD

    @property
    def worst_rank(self) -> int:
        vals = rank_values(self.nowdl, self.objective)
        return max(range(len(vals)), key=vals.__getitem__)


def run_quality(models: Sequence[tuple[str, Callable[[], nn.Module], str]],
                images: Sequence[int], ks: Sequence[int], time_limit: float) -> list[QualityRow]:
    rows: list[QualityRow] = []
    total = len(models) * len(images) * len(ks) * len(OBJECTIVES)
    for label, builder, _ in models:
        progress(f"building {label}")
        model = builder()
        for image in images:
            prof = profile_at(model, image)
            progress(f"{label} {image}²: {prof.nodes} nodes, trace {prof.trace_s:.1f} s, "
                     f"profile {prof.profile_s:.1f} s")
            for k in ks:
                for objective in OBJECTIVES:
                    problem = build_problem(prof.costs, candidate(k), objective)
                    order = topological_order(problem)
                    nowdl_part = solve(problem, time_limit=time_limit)
                    row = QualityRow(
                        model=label, image=image, k=k, objective=objective, nodes=prof.nodes,
                        nowdl=nowdl_part,
                        params=balance_by_params(problem, order),
                        block=balance_by_weights(problem, block_weights(problem), order),
                        count=balance_by_count(problem, order),
                        problem=problem,
                    )
                    rows.append(row)
                    progress(f"[{len(rows)}/{total}] {label} {image}² K={k} {objective}: "
                             f"solve {nowdl_part.seconds:.2f} s ({nowdl_part.status}), "
                             f"nowdl/params {row.vs_params:.3f}, nowdl/block {row.vs_block:.3f}")
        del model
    return rows


def quality_table(rows: Sequence[QualityRow], objective: str, markdown: bool) -> str:
    unit = "GiB" if objective == "memory" else "ms"
    headers = ["model", "image", "K", "nodes", f"nowdl {unit}", f"params {unit}",
               f"block {unit}", f"count {unit}", "nowdl/params", "nowdl/block", "worst rank",
               "solve s", "status", "≤block"]
    if objective == "memory":
        headers.append(f"≤{PARAMS_RATIO_TARGET}×params")
    headers.append("time")
    body = []
    for r in rows:
        if r.objective != objective:
            continue
        cells = [r.model, f"{r.image}²", str(r.k), str(r.nodes), fmt(r.value("nowdl")),
                 fmt(r.value("params")), fmt(r.value("block")), fmt(r.value("count")),
                 fmt_ratio(r.vs_params), fmt_ratio(r.vs_block), f"{r.worst_rank}/{r.k}",
                 f"{r.nowdl.seconds:.2f}", r.nowdl.status,
                 OK if r.not_worse_than_block else BAD]
        if objective == "memory":
            cells.append(r.params_target)
        cells.append(time_target(r.nodes, r.nowdl.seconds))
        body.append(cells)
    return render(headers, body, markdown)


# ---- Table 2: planning time end to end -------------------------------------------------------


@dataclass
class SpeedRow:
    graph: str
    nodes: int
    balance: str
    stages: int | None
    e2e: list[float]
    trace: list[float]
    profile: list[float]
    search: list[float]
    config: str
    status: str
    gap: float
    choice: str

    @property
    def proof_ok(self) -> bool:
        return self.status == "optimal" or (math.isfinite(self.gap) and self.gap <= GAP_TARGET)

    @property
    def time_mark(self) -> str:
        return time_target(self.nodes, median(self.e2e))


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def plan_once(build: Callable[[], nn.Module], image: int, balance: str, stages: int | None,
              time_limit: float) -> tuple[Plan, float]:
    """One cold ``compile(...).plan(x)`` (a fresh CompiledModel, no profile cache)."""
    model = build()
    x = torch.empty(1, 3, image, image, device="meta")
    cm = nowdl.compile(model, gpus=SPEED_GPUS, balance=balance, stages=stages, mode="estimate",
                       device_spec=DEVICE_SPEC, optimizer=OPTIMIZER, progress=False, cache=False,
                       planner=nowdl.PlannerOptions(time_limit=time_limit))
    t0 = time.perf_counter()
    plan = cm.plan(x)
    return plan, time.perf_counter() - t0


def config_text(plan: Plan) -> str:
    c = plan.config
    sp = c.get("spatial") or {}
    text = f"K={c['stages']} m={c['micro_batches']} dp={c['dp']}"
    if c["replicas"] == 2:
        text += " MASTER"
    if sp.get("stages"):
        text += f" sp{'/'.join(map(str, sp.get('stage_parts') or [sp.get('parts')]))}"
    return text


def run_speed(graphs: Sequence[tuple[str, Callable[[], nn.Module]]], image: int,
              repeats: int, time_limit: float) -> list[SpeedRow]:
    rows = []
    for label, build in graphs:
        for balance in OBJECTIVES:
            for stages in (8, None):
                e2e, tr, pr, se = [], [], [], []
                plan = None
                for _ in range(repeats):
                    plan, secs = plan_once(build, image, balance, stages, time_limit)
                    timing = plan.solver.get("timing", {})
                    e2e.append(secs)
                    tr.append(float(timing.get("trace_s", math.nan)))
                    pr.append(float(timing.get("profile_s", math.nan)))
                    se.append(float(timing.get("search_s", plan.solver.get("seconds", math.nan))))
                assert plan is not None
                st = plan.solver.get("search") or {}
                row = SpeedRow(label, int(plan.model["nodes"]), balance, stages, e2e, tr, pr, se,
                               config_text(plan), str(plan.solver["status"]),
                               float(plan.solver.get("gap", math.nan)), str(st.get("choice", "?")))
                rows.append(row)
                progress(f"{label} {row.nodes} nodes {balance} stages={stages or 'free'}: "
                         f"e2e {', '.join(f'{x:.2f}' for x in e2e)} s (search "
                         f"{median(se):.2f} s), {row.config}, {row.status} gap {row.gap:.3g}")
    return rows


def speed_table(rows: Sequence[SpeedRow], markdown: bool) -> str:
    headers = ["graph", "nodes", "balance", "stages", "end-to-end s", "trace s", "profile s",
               "search s", "chosen", "status (gap)", "configuration choice", "≤ target",
               "optimal or gap ≤ 1%"]
    body = []
    for r in rows:
        gap = f"{r.gap:.2%}" if math.isfinite(r.gap) else "?"
        budget = FAST_SECONDS if r.nodes <= FAST_NODES else BIG_SECONDS
        body.append([r.graph, str(r.nodes), r.balance, str(r.stages or "free"),
                     f"{median(r.e2e):.2f}", f"{median(r.trace):.2f}", f"{median(r.profile):.2f}",
                     f"{median(r.search):.2f}", r.config, f"{r.status} ({gap})", r.choice,
                     f"{r.time_mark} ({budget:g} s)", OK if r.proof_ok else BAD])
    return render(headers, body, markdown)


# ---- summary -----------------------------------------------------------------------------------


def explain_memory_miss(r: QualityRow) -> str:
    """Why nowdl's bottleneck is not far below the params split: the two worst stages' terms."""
    parts = []
    for which in ("nowdl", "params"):
        part: Partition = getattr(r, which)
        s = max(range(r.k), key=lambda i: part.rank_mem[i])
        b = mem_breakdown(r.problem, part.stage_of, s)
        ranks = ", ".join(f"{v:.2f}" for v in rank_values(part, "memory"))
        parts.append(
            f"{which}: ranks [{ranks}] GiB; worst stage {s} ({int(b['nodes'])} nodes, "
            f"inflight {int(b['inflight'])}) = static {b['static']:.2f} + act {b['act']:.2f} "
            f"+ recv {b['recv']:.2f} + ws {b['ws']:.2f} GiB"
        )
    return "; ".join(parts)


def summary(quality: Sequence[QualityRow], speed: Sequence[SpeedRow], markdown: bool) -> str:
    lines: list[str] = []
    # End-to-end planning time against the budget of its size, and the proof of the choice.
    for limit_nodes, budget in ((FAST_NODES, FAST_SECONDS), (BIG_NODES, BIG_SECONDS)):
        lo = 0 if limit_nodes == FAST_NODES else FAST_NODES
        sel = [r for r in speed if lo < r.nodes <= limit_nodes * (1.05 if lo else 1)]
        if not sel:
            lines.append(f"{NA} plan ≤ {budget:g} s end to end for {lo + 1}-{limit_nodes} nodes: no case run")
            continue
        worst = max(sel, key=lambda r: median(r.e2e))
        misses = [r for r in sel if median(r.e2e) > budget]
        mark = BAD if misses else OK
        text = (f"{mark} plan ≤ {budget:g} s end to end for {lo + 1}-{limit_nodes} nodes: "
                f"{len(sel) - len(misses)}/{len(sel)} rows, slowest {median(worst.e2e):.2f} s "
                f"({worst.graph} {worst.balance} stages={worst.stages or 'free'})")
        if misses:
            text += "; over budget: " + ", ".join(
                f"{r.graph} {r.balance} stages={r.stages or 'free'} {median(r.e2e):.2f} s "
                f"(trace {median(r.trace):.2f} + profile {median(r.profile):.2f} + search "
                f"{median(r.search):.2f})" for r in misses)
        lines.append(text)
    if speed:
        bad = [r for r in speed if not r.proof_ok]
        lines.append(f"{BAD if bad else OK} chosen configuration proven optimal or gap ≤ "
                     f"{GAP_TARGET:.0%}: {len(speed) - len(bad)}/{len(speed)} rows"
                     + ("; not: " + ", ".join(f"{r.graph} {r.balance} stages={r.stages or 'free'} "
                                              f"({r.status}, gap {r.gap:.2%})" for r in bad)
                        if bad else ""))
    # Quality vs params on the 2048² UNets and ResNet.
    target_rows = [r for r in quality if r.params_target_applies]
    if target_rows:
        misses_p = [r for r in target_rows if r.vs_params > PARAMS_RATIO_TARGET]
        mark = BAD if misses_p else OK
        best = max(target_rows, key=lambda r: r.vs_params)
        text = (f"{mark} memory ≤ {PARAMS_RATIO_TARGET}× params balancing "
                f"({', '.join(PARAMS_TARGET_MODELS)} at {PARAMS_TARGET_IMAGE}²): "
                f"{len(target_rows) - len(misses_p)}/{len(target_rows)} rows, largest ratio "
                f"{best.vs_params:.3f} ({best.model} K={best.k})")
        lines.append(text)
        for r in misses_p:
            lines.append(f"  missed: {r.model} {r.image}² K={r.k}: nowdl {r.value('nowdl'):.2f} GiB "
                         f"vs params {r.value('params'):.2f} GiB (ratio {r.vs_params:.3f}). "
                         + explain_memory_miss(r)
                         + (f". nowdl's value is the MILP optimum (status optimal, gap "
                            f"{r.nowdl.gap:.2g}): no assignment under this cost model reaches "
                            f"{PARAMS_RATIO_TARGET} x params = "
                            f"{PARAMS_RATIO_TARGET * r.value('params'):.2f} GiB"
                            if r.nowdl.status == "optimal" else ""))
    else:
        lines.append(f"{NA} memory ≤ {PARAMS_RATIO_TARGET}× params: no {PARAMS_TARGET_IMAGE}² UNet/ResNet "
                     "case run")
    # Never worse than the block partition.
    if quality:
        worse = [r for r in quality if not r.not_worse_than_block]
        mark = BAD if worse else OK
        best = min(quality, key=lambda r: r.vs_block)
        lines.append(f"{mark} never worse than the block partition: "
                     f"{len(quality) - len(worse)}/{len(quality)} rows (both objectives); "
                     f"best ratio {best.vs_block:.3f} ({best.model} {best.image}² K={best.k} "
                     f"{best.objective}), worst {max(r.vs_block for r in quality):.3f}")
        for r in worse:
            lines.append(f"  worse: {r.model} {r.image}² K={r.k} {r.objective}: nowdl "
                         f"{fmt(r.value('nowdl'))} vs block {fmt(r.value('block'))} "
                         f"(solver {r.nowdl.solver}, status {r.nowdl.status})")
        not_opt = [r for r in quality if r.nowdl.status != "optimal"]
        if not_opt:
            lines.append("solves that stopped at the time limit (status not optimal): "
                         + ", ".join(f"{r.model} {r.image}² K={r.k} {r.objective} "
                                     f"({r.nowdl.status}, gap {r.nowdl.gap:.3g})"
                                     for r in not_opt))
    return notes(lines, markdown)


# ---- main --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--quick", action="store_true",
                    help="a few small cases (smoke run): the UNets at 1024², K = 2 and 8, "
                         "and the two smallest speed graphs")
    ap.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    ap.add_argument("--time-limit", type=float, default=30.0,
                    help="solve(time_limit=...) and compile(planner=PlannerOptions(time_limit=...)) in seconds (default "
                         "30, nowdl's default)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="end-to-end runs per Table 2 row; the median is shown (default 3)")
    ap.add_argument("--speed-only", action="store_true", help="skip Table 1 (quality)")
    ap.add_argument("--quality-only", action="store_true", help="skip Table 2 (planning time)")
    ap.add_argument("--wide", action="store_true",
                    help="only Table 3: the wide MONAI graphs (issue 32) against their references, and AmoebaNet-D")
    ap.add_argument("--wide-real", action="store_true", help="with --wide: also the real widths")
    args = ap.parse_args(argv)

    models = QUALITY_MODELS
    images: tuple[int, ...] = (1024, 2048)
    ks: tuple[int, ...] = (2, 4, 8)
    graphs: list[tuple[str, Callable[[], nn.Module]]] = [
        (f"resnet(depth={d}, v1)", functools.partial(resnet, depth=d, version=1))
        for d in SPEED_DEPTHS] + [("AmoebaNet-D", amoebanetd)]
    if args.quick:
        models = [m for m in QUALITY_MODELS if m[0] in ("nowdl UNet", "MONAI UNet")]
        images, ks, graphs = (1024,), (2, 8), graphs[:2]
    if args.speed_only:
        models = []

    try:
        import monai  # noqa: F401
    except ImportError:
        progress("MONAI is not installed: skipping MONAI UNet")
        models = [m for m in models if m[0] != "MONAI UNet"]

    if args.wide:
        from wide_table import run_wide

        print(run_wide(args.markdown, real=args.wide_real, repeats=args.repeats))
        progress(f"done in {time.perf_counter() - _T0:.1f} s")
        return 0
    t0 = time.perf_counter()
    plan_once(functools.partial(resnet, depth=8, version=1), 64, "compute", None, args.time_limit)
    warmup = time.perf_counter() - t0
    progress(f"warm-up plan of a tiny model (one-time imports): {warmup:.2f} s")
    speed = [] if args.quality_only else run_speed(graphs, SPEED_IMAGE, args.repeats, args.time_limit)
    quality = run_quality(models, images, ks, args.time_limit)
    md = args.markdown

    spec = get_device_spec(DEVICE_SPEC)
    print(heading("Setup", md))
    print(notes([
        f"Profiles: nowdl.trace.tracer.trace + nowdl.profiler.profile(mode='estimate', "
        f"device_spec='{DEVICE_SPEC}', optimizer='{OPTIMIZER}') on a meta input of batch 1; "
        f"link {spec.link_bw / 1e9:g} GB/s; torch {torch.__version__}.",
        *[f"{label}: {desc}." for label, _, desc in models],
        "Problem: build_problem(Costs(mem_cap=None), Candidate(stages=K, micro_batches=K, "
        "schedule='1f1b', replicas=1, dp=1, parts=1, front=0, back=0, slice='square'), "
        "objective); 1F1B keeps min(K, K - s) micro-batches in flight on stage s.",
        f"nowdl: solve(problem, time_limit={args.time_limit:g}) (exact coarsening; the exact DP "
        "over the DAG's ideals where it has at most 3,000 of them, else the HiGHS MILP started "
        "from the DP over one topological order, threads=1); 'solve s' is its wall time.",
        "Baselines split the same topological order (nowdl.partitioner.costs.structure.topological_order) "
        "contiguously and are evaluated by the same cost model (evaluate()).",
        "params: balance_by_params: exact min-max contiguous split of the per-node static bytes "
        "(parameters + grads + Adam states, proportional to the parameter count).",
        "block: torchgpipe's block partition (Bárány-Grinberg, balance_by_weights). Weights: "
        "memory objective: static_v + ((K+1)/2) * act_v, i.e. static bytes plus the mean "
        "in-flight micro-batch count over the K stages times the node's saved activation "
        "bytes (workspace and boundary tensors are not per-node sums, so not included); "
        "compute objective: time_v, the node's fwd + bwd seconds (torchgpipe's balance_by_time).",
        "count: equal node counts per stage (MPI4DL's default), first n mod K stages get one more.",
        "Bottleneck: memory = the largest rank's static + inflight x (activations + received "
        "boundary tensors) + largest workspace; compute = the slowest rank's fwd + bwd time per "
        "micro-batch including boundary transfer time.",
        "worst rank: the rank holding nowdl's bottleneck (of K).",
        f"Targets: '≤block' nowdl ≤ block partition (relative slack {REL_TOL:g}); "
        f"'≤{PARAMS_RATIO_TARGET}×params' nowdl ≤ {PARAMS_RATIO_TARGET} × params on "
        f"{', '.join(PARAMS_TARGET_MODELS)} at {PARAMS_TARGET_IMAGE}² (memory objective, every K; "
        f"{NA} elsewhere); 'time' solve ≤ {FAST_SECONDS:g} s for ≤ {FAST_NODES} nodes and "
        f"≤ {BIG_SECONDS:g} s up to ~{BIG_NODES} nodes (applied at every K ≤ 8).",
        f"Machine: {os.cpu_count()} CPUs, load average {load_average()} at the end of the run "
        "(a shared box: timings vary with what else runs).",
    ], md))
    if quality:
        print(heading("Table 1a: bottleneck memory (objective 'memory', GiB per GPU)", md))
        print(quality_table(quality, "memory", md))
        print(heading("Table 1b: bottleneck time (objective 'compute', ms per micro-batch)", md))
        print(quality_table(quality, "compute", md))
    if not speed:
        print(heading("Summary", md))
        print(summary(quality, speed, md))
        progress(f"done in {time.perf_counter() - _T0:.1f} s")
        return 0
    print(heading(f"Table 2: planning time end to end (gpus={SPEED_GPUS}, {SPEED_IMAGE}², "
                  f"median of {args.repeats})", md))
    print(speed_table(speed, md))
    print()
    print(notes([
        "end-to-end s: nowdl.compile(...).plan(x) on a fresh compile, cold (cache=False, "
        "progress=False): trace (with the eager check on a shrunk real input) + estimate "
        "profile + search; trace/profile/search s: its parts (plan.solver['timing']). "
        "search s is the solve-only time: bounds, DPs, MILP, tie-breaks.",
        f"One-time imports of the process (torch._dynamo for fake tensors), paid by a warm-up "
        f"plan before the table: {warmup:.2f} s.",
        "chosen: the configuration the search picked (K stages, m micro-batches, dp copies, "
        "MASTER when the mirrored replica is used). status (gap): the chosen split's solver "
        "status and relative gap (MASTER descents: against the Lagrangian lower bound). "
        "configuration choice: 'proven' when every candidate that could win was solved to "
        "optimality or pruned by a bound.",
        f"targets: end to end ≤ {FAST_SECONDS:g} s for ≤ {FAST_NODES} nodes, ≤ {BIG_SECONDS:g} s "
        f"up to {BIG_NODES}; the chosen split optimal or gap ≤ {GAP_TARGET:.0%}.",
    ], md))
    print(heading("Summary", md))
    print(summary(quality, speed, md))
    progress(f"done in {time.perf_counter() - _T0:.1f} s")
    return 0


if __name__ == "__main__":
    with recorded("bench_planner", "--results" in sys.argv):
        sys.exit(main())
