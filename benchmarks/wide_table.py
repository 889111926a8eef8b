"""Table 3 of bench_planner (``--wide``): wide graphs planned in seconds (issue 32).

Rows: SwinUNETR, BasicUNetPlusPlus and UNETR at the docs/models.md widths, K = 4 and 8
(``wide_graphs.plan_wide``: gpus = stages = micro-batches = K, balance memory, default
PlannerOptions: the anytime search, no MILP), one warm-up plan first (one-time imports). Each
against its reference in ``wide_reference.json`` (today's search with a 120 s time limit, commit
f97bb2f) and the targets: end to end <= 3 s at K = 4, <= 5 s at K = 8, predicted peak <= 1.01x
the reference. Wall and CPU seconds (``time.process_time``) with the load average: on a shared
machine the wall time is inflated. AmoebaNet-D (1024², K = 8, memory, bench_planner's Table 1
problem): end to end through ``plan()`` with default PlannerOptions (the target row, its split scored
on that problem), then ``solve`` anytime (``ilp=False``, time limits 10 and 30 s) and with the MILP for 10 s, against its proven
optimum 7.513e9 bytes. The "exact?" column says what each split is proven to be (``proof``):
the anytime split carries the assignment LP's bound, and no coarse graph's optimum is certified
exact for the fine graph (the DPs over ideals leave long-skip gradient waits out). ``--wide-real`` adds the real widths (no reference: they take minutes
with the MILP).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from wide_graphs import REAL, SMALL, WideNet, load_reference, plan_wide

from nowdl.partitioner.costs.problem import Problem

__all__ = ["run_wide", "proof", "AMOEBA_OPT"]

AMOEBA_OPT = 7.513e9  # bytes: AmoebaNet-D 1024², K = 8, memory, proven by HiGHS (issue 32)
TARGET_S = {4: 3.0, 8: 5.0}
RATIO = 1.01
OK, BAD, NA = "✓", "✗", "—"


def _render(headers: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        return "\n".join(["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
                         + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)), "  ".join("-" * w for w in widths)]
    return "\n".join(out + ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows])


def proof(status: str, gap: float) -> str:
    """What a row's split is proven to be: "optimal (proven)" when a bound meets it,
    "optimal on the coarse graph only" for a greedy coarsening's optimum, else "heuristic, gap
    X% to the LP bound" (``gap`` = 1 - bound / value, the solver's own)."""
    if status == "optimal":
        return "optimal (proven)"
    if status == "coarse-optimal":
        return "optimal on the coarse graph only"
    return f"heuristic, gap {gap:.1%} to the LP bound" if gap == gap else "heuristic, no bound"


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def cold_plan(label: str, k: int) -> float:
    """Wall seconds of ``plan()`` as the first plan of a fresh process (imports of torch, nowdl and
    MONAI done before the clock starts; no cache on disk: ``cache=False``)."""
    code = ("import sys, json; sys.path.insert(0, 'benchmarks'); import torch, nowdl, monai.networks.nets; "
            "from wide_graphs import SMALL, REAL, plan_wide; "
            f"net = next(n for n in SMALL + REAL if n.label == {label!r}); "
            f"print(json.dumps(plan_wide(net, {k})['wall_s']))")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])})
    if out.returncode != 0:
        raise RuntimeError(f"cold plan of {label} K={k} failed: {out.stderr[-500:]}")
    return float(out.stdout.strip().splitlines()[-1])


def _row(net: WideNet, k: int, repeats: int, ref: dict[str, object] | None) -> list[str]:
    cold = statistics.median(cold_plan(net.label, k) for _ in range(repeats))
    runs = [plan_wide(net, k) for _ in range(repeats)]
    r = runs[-1]
    wall = statistics.median(x["wall_s"] for x in runs)
    cpu = statistics.median(x["cpu_s"] for x in runs)
    peak = float(r["peak_bytes"])
    if ref is not None:
        ratio = peak / float(ref["peak_bytes"])  # type: ignore[arg-type]
        ref_txt = f"{float(ref['peak_bytes']):.6g} ({ref['solver']} {ref['status']}, {ref['cpu_s']} s CPU)"  # type: ignore[arg-type]
        ratio_txt, ratio_ok = f"{ratio:.4f}", OK if ratio <= RATIO else BAD
    else:
        ref_txt, ratio_txt, ratio_ok = NA, NA, NA
    target = TARGET_S.get(k)
    time_ok = NA if target is None or ref is None else (OK if max(cold, wall) <= target else BAD)
    tm = r.get("timing") or {}
    parts = "/".join(f"{float(tm.get(key, float('nan'))):.2f}" for key in ("trace_s", "profile_s", "search_s"))
    return [net.label, str(k), str(r["nodes"]), f"{peak:.6g}", ref_txt, ratio_txt,
            f"{r['solver']} {r['status']}", proof(str(r["status"]), float(r["gap"])),
            f"{cold:.2f}", f"{wall:.2f}", parts, f"{cpu:.2f}", _load(), f"{ratio_ok} / {time_ok}"]


def _amoeba() -> list[list[str]]:
    import bench_planner as bp

    from nowdl.models import amoebanetd
    from nowdl.partitioner.costs.costmodel import build_problem
    from nowdl.partitioner.solver import solve

    prof = bp.profile_at(amoebanetd(), 1024)
    problem = build_problem(prof.costs, bp.candidate(8), "memory")
    rows = [_amoeba_plan(problem, [n.name for n in prof.costs.profile.nodes])]
    for label, kw in (("anytime (ilp=False)", {"ilp": False, "time_limit": 10.0}),
                      ("anytime (ilp=False), time_limit=30", {"ilp": False, "time_limit": 30.0}),
                      ("MILP, time_limit=10", {"time_limit": 10.0})):
        w, c = time.perf_counter(), time.process_time()
        part = solve(problem, **kw)  # type: ignore[arg-type]
        wall, cpu = time.perf_counter() - w, time.process_time() - c
        ratio = part.bottleneck_mem / AMOEBA_OPT
        rows.append([f"AmoebaNet-D 1024² {label}", "8", str(prof.nodes), f"{part.bottleneck_mem:.6g}",
                     f"{AMOEBA_OPT:.4g} (proven optimum)", f"{ratio:.4f}",
                     f"{part.solver} {part.status}", proof(part.status, part.gap), "—", f"{wall:.2f}", "—", f"{cpu:.2f}", _load(),
                     f"{OK if ratio <= 1.01 else BAD} / {OK if wall <= 10 else BAD}"])
    return rows


def _amoeba_plan(problem: Problem, names: list[str]) -> list[str]:
    """AmoebaNet-D end to end through ``plan()`` (default PlannerOptions, the anytime search),
    its split scored on the Table 1 problem whose optimum is ``AMOEBA_OPT`` (the solvers' bound of
    the fullest stage; the plan itself reports that less what each stage has freed by its peak)."""
    import torch

    import nowdl
    from nowdl.models import amoebanetd
    from nowdl.partitioner.costs.structure import make_partition

    cm = nowdl.compile(amoebanetd(), gpus=8, stages=8, micro_batches=8, balance="memory", mode="estimate",
                       device_spec="h100", progress=False, cache=False)
    w, c = time.perf_counter(), time.process_time()
    plan = cm.plan(torch.empty(1, 3, 1024, 1024, device="meta"))
    wall, cpu = time.perf_counter() - w, time.process_time() - c
    where = {name: st.index for st in plan.stages for name in st.nodes}
    part = make_partition(problem, [where[name] for name in names])
    ratio = part.bottleneck_mem / AMOEBA_OPT
    sv, tm = plan.solver, plan.solver.get("timing") or {}
    parts = "/".join(f"{float(tm.get(key, float('nan'))):.2f}" for key in ("trace_s", "profile_s", "search_s"))
    return ["AmoebaNet-D 1024² plan() (default PlannerOptions)", "8", str(problem.n), f"{part.bottleneck_mem:.6g}",
            f"{AMOEBA_OPT:.4g} (proven optimum)", f"{ratio:.4f}", f"{sv.get('name')} {sv.get('status')}",
            proof(str(sv.get("status")), float(sv.get("gap") or float("nan"))), "—", f"{wall:.2f}", parts, f"{cpu:.2f}",
            _load(), f"{OK if ratio <= 1.01 else BAD} / {OK if wall <= 10 else BAD}"]


def run_wide(markdown: bool, *, real: bool = False, repeats: int = 1) -> str:
    """Table 3 as text (see the module docstring)."""
    refs = load_reference()
    plan_wide(SMALL[1], 2)  # warm-up: one-time imports (torch.export, fake tensors)
    rows = [_row(net, k, repeats, refs.get((net.label, k))) for net in SMALL for k in (4, 8)]
    if real:
        rows += [_row(net, k, 1, refs.get((net.label, k))) for net in REAL for k in (4, 8)]
    rows += _amoeba()
    headers = ["graph", "K", "nodes", "peak bytes", "reference (120 s, f97bb2f)", "ratio", "solver status", "exact?",
               "cold wall s", "warm wall s", "trace/profile/search wall s (warm)", "CPU s", "load avg", "≤1.01× / ≤time"]
    title = "Table 3: wide graphs, gpus = stages = micro-batches = K, balance memory, default PlannerOptions"
    head = f"\n### {title}\n" if markdown else f"\n{title}\n{'=' * len(title)}"
    return head + "\n" + _render(headers, rows, markdown)
