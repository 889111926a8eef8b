"""Wide graphs for the planner benchmark (issue 32): MONAI's transformer hybrids and nested skips.

``bench_planner.py --wide`` plans them end to end; this module holds the networks, the plan call
and the reference values: the split today's search found with a 120 s time limit, measured on the
code of commit f97bb2f (before the anytime search) by

    PYTHONPATH=<f97bb2f tree> .venv/bin/python benchmarks/wide_graphs.py --reference \
        --time-limit 120 --out benchmarks/wide_reference.json

Networks at the docs/models.md widths (``tests/helpers/monai_zoo.py``'s arguments, input batch 1)
and at real widths (UNet++ 512², UNETR 256², SwinUNETR 3D 96³). The plan call:
``nowdl.compile(model, gpus=K, stages=K, micro_batches=K, balance="memory", mode="estimate",
device_spec="h100", progress=False, cache=False).plan(x)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import nowdl

__all__ = ["WideNet", "SMALL", "REAL", "plan_wide", "load_reference", "REFERENCE_PATH"]

REFERENCE_PATH = Path(__file__).resolve().parent / "wide_reference.json"

from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402


@dataclass(frozen=True)
class WideNet:
    """One MONAI network with its constructor arguments and one micro-batch's input shape."""

    label: str
    cls: str
    kwargs: dict[str, Any]
    shape: tuple[int, ...]

    def build(self) -> nn.Module:
        import monai.networks.nets as nets

        torch.manual_seed(0)
        model: nn.Module = getattr(nets, self.cls)(**self.kwargs)
        return model


#: docs/models.md widths (the same arguments as tests/helpers/monai_zoo.py)
SMALL: list[WideNet] = [
    WideNet("SwinUNETR 2D 64²", "SwinUNETR", {"in_channels": 1, "out_channels": 2, "feature_size": 12,
                                              "depths": [1, 1, 1, 1], "num_heads": [1, 1, 1, 1],
                                              "window_size": 4, "spatial_dims": 2}, (1, 1, 64, 64)),
    WideNet("BasicUNetPlusPlus 2D 32²", "BasicUNetPlusPlus",
            {"spatial_dims": 2, "in_channels": 1, "out_channels": 2, "features": [4, 4, 8, 8, 16, 4]},
            (1, 1, 32, 32)),
    WideNet("UNETR 2D 32²", "UNETR", {"in_channels": 1, "out_channels": 2, "img_size": [32, 32],
                                      "feature_size": 4, "hidden_size": 32, "mlp_dim": 64, "num_heads": 2,
                                      "spatial_dims": 2}, (1, 1, 32, 32)),
]

#: real widths (MONAI's defaults)
REAL: list[WideNet] = [
    WideNet("SwinUNETR 3D 96³", "SwinUNETR", {"in_channels": 1, "out_channels": 14, "feature_size": 48,
                                              "spatial_dims": 3}, (1, 1, 96, 96, 96)),
    WideNet("BasicUNetPlusPlus 2D 512²", "BasicUNetPlusPlus",
            {"spatial_dims": 2, "in_channels": 1, "out_channels": 2}, (1, 1, 512, 512)),
    WideNet("UNETR 2D 256²", "UNETR", {"in_channels": 1, "out_channels": 2, "img_size": [256, 256],
                                       "spatial_dims": 2}, (1, 1, 256, 256)),
]


def plan_wide(net: WideNet, k: int, time_limit: float | None = None,
              exact: bool = False) -> dict[str, Any]:
    """Plan ``net`` on K GPUs, K stages, K micro-batches by memory; wall and CPU seconds and the
    predicted bottleneck (the largest rank's peak bytes)."""
    model = net.build()
    x = torch.empty(net.shape, device="meta")
    opts: dict[str, Any] = {}
    if time_limit is not None:
        opts["time_limit"] = time_limit
    if exact:
        opts["exact"] = True
    planner = nowdl.PlannerOptions(**opts)
    cm = nowdl.compile(model, gpus=k, stages=k, micro_batches=k, balance="memory", mode="estimate",
                       device_spec="h100", progress=False, cache=False, planner=planner)
    w0, c0 = time.perf_counter(), time.process_time()
    plan = cm.plan(x)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    sv = plan.solver
    return {"net": net.label, "k": k, "nodes": int(plan.model.get("nodes", 0)),
            "peak_bytes": float(plan.predicted["peak_bytes"]), "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2), "solver": str(sv.get("name")), "status": str(sv.get("status")),
            "gap": float(sv.get("gap") or 0.0), "bound": sv.get("bound"),
            "config": {key: plan.config[key] for key in ("stages", "micro_batches", "replicas", "dp")},
            "timing": dict(sv.get("timing") or {}),
            "load": list(os.getloadavg())}


def load_reference(path: Path = REFERENCE_PATH) -> dict[tuple[str, int], dict[str, Any]]:
    """The reference rows by (network label, K); empty when the file is missing."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {(r["net"], int(r["k"])): r for r in data["rows"]}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="plan the wide MONAI networks; --reference writes the JSON")
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--reference", action="store_true", help="write the rows to --out")
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("--ks", default="4,8")
    ap.add_argument("--only", default="", help="comma-separated substrings of network labels")
    ap.add_argument("--real", action="store_true", help="the real widths instead of the small ones")
    ap.add_argument("--out", default=str(REFERENCE_PATH))
    args = ap.parse_args(argv)
    nets = REAL if args.real else SMALL
    if args.only:
        nets = [n for n in nets if any(s in n.label for s in args.only.split(","))]
    rows = []
    for net in nets:
        for k in (int(s) for s in args.ks.split(",")):
            row = plan_wide(net, k, time_limit=args.time_limit)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.reference:
        out = Path(args.out)
        old = json.loads(out.read_text())["rows"] if out.exists() else []
        keep = [r for r in old if (r["net"], r["k"]) not in {(n["net"], n["k"]) for n in rows}]
        cmd = ("PYTHONPATH=<tree of f97bb2f> .venv/bin/python benchmarks/wide_graphs.py --reference "
               f"--time-limit {args.time_limit:g}" + (f" --only {args.only}" if args.only else "")
               + f" --ks {args.ks}")
        out.write_text(json.dumps({"command": cmd, "commit": "f97bb2f", "time_limit": args.time_limit,
                                   "rows": keep + rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    with recorded("wide_graphs", "--results" in sys.argv):
        sys.exit(main())
