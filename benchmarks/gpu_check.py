"""GPU harvest: one prepared run on one CUDA GPU that records what the cost model needs, as JSON.

Run on a machine with one GPU (about 8 minutes; ``--budget`` bounds it)::

    python benchmarks/gpu_check.py --records benchmarks/records/h200-2026-11-28.json
    python benchmarks/gpu_check.py --cpu --records /tmp/cpu.json          # the small CPU mode (CI tests it)
    python benchmarks/gpu_check.py --report benchmarks/records/h200-2026-11-28.json   # tables of a records file

Sections, in priority order, each written to the records file as soon as it ends (a run cut short
by its time limit keeps what it measured; a section that fails is recorded with its traceback and
the run goes on):

1. ``bandwidth``: host<->device copies, pinned and pageable (``harvest/eager.py``).
2. ``ops``: forward/backward time, FLOPs, bytes and workspace of single ops over a grid: 2D/3D
   convolutions across channels and sizes, transposed convs, norms, pools, upsampling,
   elementwise, in float32 (TF32 as torch's defaults allow) and bfloat16; then the convs again in
   channels_last, without TF32 and under ``cudnn.benchmark`` (``harvest/ops.py``).
3. ``steps``: allocator peaks (allocated and reserved) and step times of training, recompute,
   offload, sequential-tile and inference steps of the built-in UNet, MONAI's UNet (instance
   norm, 2D and 3D) and ResNet-110-v2 against their plans, with the allocator's event trace of
   one step (``harvest/steps.py``; the trace goes to ``<records>.history.json``).
4. ``profiles``: nowdl's per-node measure against estimate for those models (``harvest/profiles.py``).
5. ``eager``: one rank against plain eager PyTorch (and eager channels_last / cudnn.benchmark).
6. ``sync_debug``: the synchronising CUDA calls of one nowdl step.
7. ``ranks``: 2 and 4 ranks on the one GPU over gloo with CUDA tensors staged through pinned host
   memory, against one process (``harvest/ranks.py``); ``nccl``: a one-rank NCCL group.
8. ``ops_wscap``: the convs again in a child process with cuDNN's workspace capped by torch's
   ``CUDNN_CONV_WSCAP_DBG`` (MiB).

The records become the cost model's test data: commit them under ``benchmarks/records/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harvest.eager import bandwidth_section, eager_section, sync_section  # noqa: E402
from harvest.ops import op_grid, run_op  # noqa: E402
from harvest.profiles import profiles_section  # noqa: E402
from harvest.ranks import nccl_section, ranks_section  # noqa: E402
from harvest.records import Records, log  # noqa: E402
from harvest.report import report  # noqa: E402
from harvest.steps import Row, dump_history, step_rows, steps_section  # noqa: E402
from harvest.torch_tools import torch_tools_section  # noqa: E402
from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402


def TOOL_ROWS(cpu: bool) -> list[Row]:  # noqa: N802
    """torch's estimators run on the first step rows (the H200 rows of docs/benchmarks.md; on CPU,
    where their FakeTensor runs take minutes, the first one)."""
    return [r for r in step_rows(cpu) if r.kind in ("train", "inference")][:1 if cpu else 4]

SECTIONS = ("bandwidth", "ops", "steps", "ranks", "eager", "sync_debug", "profiles", "ops_variants", "nccl", "ops_wscap",
            "torch_tools", "torch_tools_here")
#: seconds each section may take at most (GPU); a section starts only with its share left
CAPS = {"bandwidth": 10, "ops": 60, "steps": 170, "ranks": 110, "eager": 35, "sync_debug": 10, "profiles": 40,
        "ops_variants": 30, "nccl": 15, "ops_wscap": 30, "torch_tools": 45, "torch_tools_here": 45}


def spec_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return next((k for k in ("h200", "h100", "a100", "v100") if k in name), "h100")


def ops_section(recs: Records, cpu: bool, device: torch.device, key: str, only: str | None, variants: bool) -> None:
    """The op grid (``variants``: the convs in channels_last, without TF32 and under cudnn.benchmark)."""
    reps = (2, 1) if cpu else (5, 2)
    runs: list[tuple[str, bool, bool]] = ([("contiguous", True, False)] if not variants else
                                          [("channels_last", True, False), ("contiguous", False, False),
                                           ("contiguous", True, True)])
    for layout, tf32, bench in runs:
        for op, params, make, dtypes in op_grid(cpu):
            if only and not op.startswith(only):
                continue
            if variants and not op.startswith("conv"):
                if not (layout == "channels_last" and op.endswith("norm")):
                    continue
            for dt in dtypes:
                if variants and not tf32 and dt != "float32":
                    continue
                if recs.left() < 3:
                    recs.data["sections"].setdefault(key, {})["truncated"] = True
                    return
                old = (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
                torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = tf32, bench
                try:
                    row = run_op(op, params, make, getattr(torch, dt), device, *reps, layout=layout)
                except Exception as e:  # noqa: BLE001 - an op this build or size refuses is a row too
                    row = {"op": op, "dtype": dt, "layout": layout, **params, "error": f"{type(e).__name__}: {e}"[:500]}
                finally:
                    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = old
                recs.add(key, row)
            if device.type == "cuda":
                torch.cuda.empty_cache()


def child_section(recs: Records, key: str, section: str, cap_s: float, records: Path, cpu: bool,
                  env: dict[str, str] | None = None, extra: tuple[str, ...] = (), rows_key: str | None = None) -> None:
    """Run ``section`` in a child process (its own environment; a crash there, such as a C++
    ``terminate``, ends the child only) and keep what it recorded under ``key``."""
    child = records.with_name(records.stem + f".{key}.json")
    cmd = [sys.executable, __file__, "--only", section, "--records", str(child), "--budget", str(max(10.0, cap_s - 15)),
           *(["--cpu"] if cpu else []), *extra]
    try:
        proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=cap_s + 20)
        rc, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = "timeout", str(e.stderr or "")
    data = json.loads(child.read_text()) if child.exists() else {}
    recs.put(key, {"env": env or {}, "returncode": rc, "stderr": err[-1500:] if rc else "",
                   "settings": data.get("settings"), "sections": data.get("sections"), "rows": data.get(rows_key or section, [])})
    child.unlink(missing_ok=True)
    if rc != 0 and not data.get(rows_key or section):
        raise RuntimeError(f"child exited {rc}: {err[-800:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="the small CPU mode (default when CUDA is not available)")
    ap.add_argument("--records", metavar="FILE", help="the records file to write (default: benchmarks/records/"
                    "<gpu>-<date>.json, or /tmp/nowdl-gpu-check-cpu.json in CPU mode)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds the whole harvest may take (default 480 on a GPU; 1800 in the CPU mode, which CI runs "
                         "on a loaded machine and which must run every section)")
    ap.add_argument("--only", action="append", choices=SECTIONS, help="run only these sections (repeatable)")
    ap.add_argument("--skip", action="append", default=[], choices=SECTIONS, help="leave a section out (repeatable)")
    ap.add_argument("--ops-only", metavar="PREFIX", help="op grid rows whose op starts with PREFIX only")
    ap.add_argument("--report", metavar="FILE", help="print the tables of an existing records file and exit")
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    args = ap.parse_args(argv)
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return 0
    cpu = args.cpu or not torch.cuda.is_available()
    device = torch.device("cpu") if cpu else torch.device("cuda", 0)
    caps = dict(CAPS) if not cpu else {k: 4 * v for k, v in CAPS.items()}  # slow shared CPUs: every section runs
    if args.budget is None:
        args.budget = 1800.0 if cpu else 480.0
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = spec_name(device)
    name = ("/tmp/nowdl-gpu-check-cpu.json" if cpu else
            str(Path(__file__).parent / "records" / f"{spec}-{time.strftime('%Y-%m-%d')}.json"))
    path = Path(args.records or name)
    path.parent.mkdir(parents=True, exist_ok=True)
    recs = Records(path, device, args.budget, " ".join([Path(sys.executable).name, *sys.argv]))
    log(f"{recs.data['device'].get('name')}, torch {torch.__version__}, spec {spec}; records -> {path}")
    want = [s for s in (args.only or SECTIONS) if s not in args.skip]
    history = dump_history(path.with_name(path.stem + ".history.json"))
    timed = 2 if cpu else 5
    runners: dict[str, Any] = {
        "bandwidth": lambda: bandwidth_section(recs, device),
        "ops": lambda: ops_section(recs, cpu, device, "ops", args.ops_only, False),
        "ops_variants": lambda: ops_section(recs, cpu, device, "ops_variants", args.ops_only, True),
        "steps": lambda: steps_section(recs, cpu, spec, device, timed, history),
        "profiles": lambda: profiles_section(recs, cpu, spec, device, (2, 0) if cpu else (5, 2)),
        "eager": lambda: eager_section(recs, cpu, spec, device, 3 if cpu else 8),
        "sync_debug": lambda: sync_section(recs, cpu, spec, device),
        "ranks": lambda: ranks_section(recs, cpu, spec, device),
        "nccl": lambda: nccl_section(recs, device),
        "ops_wscap": lambda: child_section(recs, "ops_wscap", "ops", caps["ops_wscap"], path, cpu,
                                           {"CUDNN_CONV_WSCAP_DBG": "64"}, ("--ops-only", "conv")),
        "torch_tools": lambda: child_section(recs, "torch_tools", "torch_tools_here", caps["torch_tools"], path, cpu,
                                             rows_key="torch_tools"),
        "torch_tools_here": lambda: torch_tools_section(recs, TOOL_ROWS(cpu), device, timed),
    }
    if not args.only:
        want = [s for s in want if s != "torch_tools_here"]  # "torch_tools" runs it in a child process
    for sec in want:
        if sec == "ops_wscap" and cpu:
            continue
        # a section starts only while the later ones keep a third of their caps
        later = sum(caps[s] for s in want[want.index(sec) + 1:]) / 3
        with recs.section(sec, need_s=min(caps[sec], 10) + later, cap_s=caps[sec]) as ok:
            if ok:
                runners[sec]()
    recs.flush()
    print(report(recs.data))
    log(f"done in {recs.data['wall_s']:.0f} s; records: {path}")
    return 0


if __name__ == "__main__":
    with recorded("gpu_check", "--results" in sys.argv):
        sys.exit(main())
