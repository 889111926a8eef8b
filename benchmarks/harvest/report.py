"""Markdown tables of a records file (what ``gpu_check.py`` prints last, and ``--report FILE``)."""

from __future__ import annotations

from typing import Any

__all__ = ["report"]


def _b(v: Any) -> str:
    if v is None:
        return "-"
    v = float(v)
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= k:
            return f"{v / k:.2f} {unit}"
    return f"{v:.0f} B"


def _ms(v: Any) -> str:
    return "-" if v is None else f"{float(v) * 1e3:.2f}"


def _r(a: Any, b: Any) -> str:
    return f"{float(a) / float(b):.2f}" if a is not None and b else "-"


def _shape(r: dict[str, Any]) -> str:
    return "x".join(map(str, r.get("input", [])))


def report(d: dict[str, Any]) -> str:
    dev = d.get("device", {})
    out = [f"## GPU harvest on {dev.get('name')} (torch {d.get('torch')}, driver {dev.get('driver')}, "
           f"cuDNN {dev.get('cudnn')}), {d.get('wall_s', 0):.0f} s of a {d.get('budget_s', 0):.0f} s budget",
           "", f"command: `{d.get('command')}`; CUDA context {_b(dev.get('context_bytes'))}", "",
           "| section | status | s | note |", "|---|---|---|---|"]
    for name, s in d.get("sections", {}).items():
        out.append(f"| {name} | {s.get('status')} | {s.get('wall_s', 0):.1f} | "
                   f"{(s.get('error') or s.get('reason') or '')[:120]} |")
    steps = [r for r in d.get("steps", []) if "skipped" not in r]
    if steps:
        out += ["", "### Steps against their plans (max_memory_allocated; step time the median)", "",
                "| row | measured | reserved | planned | meas/plan | step ms | planned ms | meas/plan |",
                "|---|---|---|---|---|---|---|---|"]
        for r in steps:
            if "error" in r:
                out.append(f"| {r['label']} | error: {r['error'][:100]} |||||||")
                continue
            out.append(f"| {r['label']} | {_b(r.get('max_allocated'))} | {_b(r.get('max_reserved'))} | "
                       f"{_b(r.get('predicted_peak'))} | {_r(r.get('max_allocated'), r.get('predicted_peak'))} | "
                       f"{_ms(r.get('step_s'))} | {_ms(r.get('predicted_step_s'))} | "
                       f"{_r(r.get('step_s'), r.get('predicted_step_s'))} |")
    ranks = [r for r in d.get("ranks", []) if "skipped" not in r]
    if ranks:
        out += ["", "### Ranks on one device against one process", "",
                "| config | ranks | ok | loss diff | weight diff | per-rank measured / planned |", "|---|---|---|---|---|---|"]
        for r in ranks:
            if not r.get("ok"):
                err = r.get("error")
                text = str(next(iter(err.values())) if isinstance(err, dict) and err else err)
                out.append(f"| {r['config']} | {r['world']} | no | {text.strip().splitlines()[-1][:120] if text else ''} |||")
                continue
            per = ", ".join(f"{_b(p.get('max_allocated'))} / {_b(p.get('predicted_peak'))}" for p in r.get("per_rank", []))
            out.append(f"| {r['config']} | {r['world']} | yes | {r['loss_diff']:.1e} | {r['weight_diff']:.1e} | {per} |")
    eager = [r for r in d.get("eager", []) if "step_s" in r]
    if eager:
        names = list(eager[0]["step_s"])
        out += ["", "### One rank against eager PyTorch (median step ms)", "",
                "| row | " + " | ".join(names) + " | nowdl / eager |", "|---" * (len(names) + 2) + "|"]
        for r in eager:
            out.append(f"| {r['label']} | " + " | ".join(_ms(r["step_s"].get(n)) for n in names)
                       + f" | {r['nowdl_over_eager']:.3f} |")
    bw = d.get("bandwidth", [])
    if bw:
        out += ["", "### Host copies", "", "| direction | pinned | size | GB/s |", "|---|---|---|---|"]
        out += [f"| {r['direction']} | {r['pinned']} | {_b(r['bytes'])} | {r['bytes_per_s'] / 1e9:.1f} |" for r in bw]
    ops = [r for r in d.get("ops", []) if "error" not in r]
    if ops:
        out += ["", f"### Ops: {len(ops)} rows (the 12 slowest; all in the records)", "",
                "| op | dtype | input | fwd ms | bwd ms | fwd TFLOP/s | fwd GB/s | fwd ws | bwd ws |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(ops, key=lambda r: -(r["fwd_s"] + r["bwd_s"]))[:12]:
            out.append(f"| {r['op']} | {r['dtype']} | {_shape(r)} | {_ms(r['fwd_s'])} | {_ms(r['bwd_s'])} | "
                       f"{r['flops'] / r['fwd_s'] / 1e12:.1f} | {r['bytes'] / r['fwd_s'] / 1e9:.0f} | "
                       f"{_b(r['fwd_ws'])} | {_b(r['bwd_ws'])} |")
    sync = d.get("sync_debug")
    if isinstance(sync, dict) and "nowdl" in sync:
        out += ["", f"sync debug: nowdl step {sync['nowdl']['count']} synchronising call(s), "
                f"eager step {sync['eager']['count']}"]
    nccl = d.get("nccl")
    if isinstance(nccl, dict) and "ok" in nccl:
        out += [f"NCCL {nccl.get('nccl_version')}: one rank init + all_reduce ok={nccl['ok']} "
                f"in {nccl.get('init_and_allreduce_s', 0):.2f} s"]
    return "\n".join(out)
