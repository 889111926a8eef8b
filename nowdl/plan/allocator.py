"""What a plan says about PyTorch's CUDA caching allocator: the options it assumes and the
``max_memory_reserved`` it predicts per rank (``config["allocator"]``, ``predicted["reserved_bytes"]``).

The figures are made by the allocator's simulation at planning ([Note: allocator reserve] in
nowdl/profiler/alloc/predict.py); this module only reads them back, for ``nowdl plan`` and
``nowdl show``. A plan for a device without a memory reserve (the CPU, the nominal specs) has no
allocator section, and prints no line.
"""

from __future__ import annotations

from typing import Any

from nowdl.plan.plan import Plan, format_bytes

__all__ = ["format_allocator", "predicted_reserved"]


def predicted_reserved(plan: Plan) -> dict[int, int]:
    """Each simulated rank's predicted ``torch.cuda.max_memory_reserved`` in bytes (empty when
    the plan has no simulation)."""
    info = plan.config.get("allocator") or {}
    ranks: dict[str, Any] = info.get("ranks") or {}
    return {int(r): int(v["predicted_reserved_bytes"]) for r, v in ranks.items()}


def format_allocator(plan: Plan) -> str:
    """One line under the plan: the allocator options assumed (``expandable_segments`` on or off)
    and the predicted ``max_memory_reserved`` of the fullest rank, with the allocator's share
    above the predicted peak; ``""`` when the plan has no allocator section."""
    info = plan.config.get("allocator")
    if not isinstance(info, dict):
        return ""
    conf = info.get("conf") or ""
    head = (f"allocator: CUDA caching allocator, {info.get('assumes', '?')} "
            f"(PYTORCH_CUDA_ALLOC_CONF {conf!r} when planned)" if conf else
            f"allocator: CUDA caching allocator, {info.get('assumes', '?')} (PYTORCH_CUDA_ALLOC_CONF unset when planned)")
    ranks: dict[str, Any] = info.get("ranks") or {}
    if not ranks:
        why = str(info.get('simulated', 'no')).removeprefix('no: ')
        return f"{head}; not simulated ({why}): the reserve keeps the assumed slack"
    worst = max(ranks, key=lambda r: ranks[r]["predicted_reserved_bytes"])
    v = ranks[worst]
    share = int(v["share_bytes"])
    tail = ("" if info.get("simulated") == "yes"
            else f"; simulated on {info.get('simulated')}, the others keep the assumed slack")
    note = ", the cache released once to fit" if v.get("released") else ""
    oom = "; the simulation ran out of memory even after releasing its cache" if v.get("oom") else ""
    return (f"{head}: predicted max_memory_reserved {format_bytes(v['predicted_reserved_bytes'])} on rank {worst} "
            f"(peak {format_bytes(v['predicted_reserved_bytes'] - share)} + {format_bytes(share)} of rounding, segments "
            f"and cached blocks{note}){oom}{tail}")
