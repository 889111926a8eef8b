"""The predicted ``torch.cuda.max_memory_reserved`` of every recorded GPU step, beside its measured
``max_memory_allocated`` ([Note: allocator reserve] in nowdl/profiler/alloc/predict.py).

    python benchmarks/alloc_reserved.py            # every step row of benchmarks/records/*.json

Each row is planned on CPU with the default (fitted) spec of its GPU, as
tests/profiler/test_gpu_fit.py plans it; the plan's caching-allocator simulation gives the
simulated allocated and reserved peaks with ``expandable_segments`` off (the plan's assumption
unless ``PYTORCH_CUDA_ALLOC_CONF`` says otherwise), and the same plan is replayed with it on. A
records row that holds ``max_reserved`` (the harvest writes it) is compared with the prediction.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from harvest.steps import build_model  # noqa: E402

import nowdl  # noqa: E402
import nowdl.compiled as compiled  # noqa: E402
from nowdl.profiler.alloc.predict import simulate_plan  # noqa: E402
from nowdl.profiler.alloc.sizes import AllocatorConfig  # noqa: E402
from nowdl.profiler.calibrate.records import load_records  # noqa: E402
from nowdl.profiler.cost import Profile  # noqa: E402
from nowdl.profiler.devices import fitted_specs  # noqa: E402

GiB = 2**30


def _plan(row: dict[str, Any], spec: Any) -> tuple[nowdl.Plan, Profile]:
    """The row's plan and the profile it was simulated with (caught at the simulation's call)."""
    seen: list[Profile] = []
    reserve = compiled.allocator_reserve

    def spy(plan: nowdl.Plan, prof: Profile, *args: Any) -> int:
        seen.append(prof)
        return reserve(plan, prof, *args)

    compiled.allocator_reserve = spy  # type: ignore[assignment]
    try:
        kw = {k: v for k, v in row["compile"].items() if k not in ("mode", "device_spec")}
        cm = nowdl.compile(build_model(row["model"], row["args"]), mode="estimate", device_spec=spec, device="cpu",
                           loss_fn=nn.CrossEntropyLoss(), cache=False, progress=False, **kw)
        shape = row["input"]
        y = (torch.zeros(shape[0], dtype=torch.long) if row["model"] == "resnet110v2"
             else torch.zeros(shape[0], *shape[2:], dtype=torch.long))
        plan = cm.plan(torch.empty(*shape, device="meta"), target=y, train=row["kind"] != "inference")
    finally:
        compiled.allocator_reserve = reserve
    return plan, seen[-1]


def main() -> None:
    specs = fitted_specs()
    print("| row | measured allocated | plan peak | simulated allocated (x measured) | simulated reserved (off / on) "
          "| predicted max_memory_reserved | measured reserved |")
    print("|---|---|---|---|---|---|---|")
    for path in sorted((ROOT / "benchmarks" / "records").glob("*.json")):
        if path.name.endswith(".history.json"):
            continue
        for row in load_records(path, warn=False).rows("steps"):
            plan, prof = _plan(row, specs["h200" if "h200" in path.name else "h100"])
            info = plan.config.get("allocator") or {}
            r = (info.get("ranks") or {}).get("0")
            if r is None:
                print(f"| {row['label']} | not simulated: {info.get('simulated', 'no allocator section')} |")
                continue
            on = simulate_plan(prof, plan, AllocatorConfig(expandable_segments=True))[0]
            measured = row["max_allocated"]
            peak = max(x.predicted_peak_bytes for x in plan.ranks)
            got = row.get("max_reserved")
            print(f"| {row['label']} | {measured / GiB:.2f} GiB | {peak / GiB:.2f} GiB | "
                  f"{r['simulated_allocated_bytes'] / GiB:.2f} GiB ({r['simulated_allocated_bytes'] / measured:.2f}x) | "
                  f"{r['simulated_reserved_bytes'] / GiB:.2f} / {on['peak_reserved'] / GiB:.2f} GiB | "
                  f"{r['predicted_reserved_bytes'] / GiB:.2f} GiB | "
                  + (f"{got / GiB:.2f} GiB ({r['predicted_reserved_bytes'] / got:.2f}x) |" if got else "not recorded |"))


if __name__ == "__main__":
    main()
