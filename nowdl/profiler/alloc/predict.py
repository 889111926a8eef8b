"""The plan's ``max_memory_reserved`` per rank: each rank's steps replayed through the caching allocator.

[Note: allocator reserve] A plan predicts what ``torch.cuda.max_memory_allocated`` shows (the
tensors, [Note: memory breakdown]); the caching allocator reserves more: rounding, the unsplit
rest of a block, segments of 2 or 20 MiB, and cached free blocks too small or in the wrong place
for the next request ([Note: caching allocator]). :func:`simulate_plan` replays each pipeline
slot's action list twice ([Note: allocation order]: a warm-up step that also makes the gradients
and the optimizer's states, then the measured step, as ``benchmarks/harvest/steps.py`` measures
it) and reports the second step's peaks. The allocator's share of a rank is the simulated
``max_memory_reserved - max_memory_allocated``; the plan adds it to the rank's predicted peak and
keeps it back from the cap (``allocator_bytes`` of the reserve, [Note: memory reserve]) in place
of the assumed ``slack_bytes``. Whether ``expandable_segments`` is on is read from
``PYTORCH_CUDA_ALLOC_CONF`` when the plan is made, and the plan says which it assumed.

Not simulated, so kept at the assumed slack: ranks of spatial stages (tiles, sequential tiles),
and profiles without an allocation log (measured on a CUDA device). Not in any figure: NCCL's own
buffers and the CUDA context (the reserve's other terms), the data-parallel gradient buckets, the
side stream's blocks (the offload's copies are allocated on the compute stream, as simulated).
"""

from __future__ import annotations

import logging
import os

from nowdl.plan.plan import Plan, format_bytes
from nowdl.profiler.alloc.caching import CachingAllocator
from nowdl.profiler.alloc.order import RankOrder, StageNodes, stage_nodes
from nowdl.profiler.alloc.sizes import AllocatorConfig, AllocatorOOM
from nowdl.profiler.cost import Profile

__all__ = ["simulate_plan", "allocator_reserve", "logged"]

log = logging.getLogger(__name__)


def logged(prof: Profile) -> bool:
    """Whether every node that runs has an allocation log ([Note: allocation log])."""
    return all(n.alloc is not None for n in prof.nodes if n.op not in ("placeholder", "get_attr", "output"))


def simulate_plan(prof: Profile, plan: Plan, config: AllocatorConfig | None = None, *,
                  capacity: int | None = None, batch: int | None = None) -> dict[int, dict[str, int]]:
    """Simulated allocator figures of the measured (second) step per pipeline slot rank (data-parallel
    copy 0, part 0) whose stages are simulated ([Note: allocator reserve]); empty without a log.

    ``capacity``: the bytes the allocator may reserve (the GPU's less the context and NCCL);
    ``batch``: the samples the profile was made with (its activations are scaled to the plan's
    micro-batch size). Each rank's figures are :meth:`CachingAllocator.stats` plus ``oom`` (1
    when a request failed even after the cache was released).
    """
    from nowdl.schedule.build import build_schedule

    if not logged(prof):
        return {}
    config = config or AllocatorConfig.from_env()
    train = not plan.config.get("inference")
    b0 = batch or (prof.input_shapes[0][0] if prof.input_shapes and prof.input_shapes[0] else 1)
    scale = float(plan.config.get("micro_batch_size") or b0) / b0
    flat = {s.index for s in plan.stages if s.parts == 1 and s.tiles_per_gpu == 1}
    made: dict[int, StageNodes] = {}
    out: dict[int, dict[str, int]] = {}
    for rank, actions in build_schedule(plan).items():
        held = sorted({(a.replica, a.stage) for a in actions})
        if not held or any(s not in flat for _, s in held):
            continue
        stages = {(r, s): made.setdefault(s, stage_nodes(prof, plan.stages[s].nodes)) for r, s in held}
        sim = CachingAllocator(config, capacity)
        acts = [(a.kind, a.replica, a.stage, a.microbatch) for a in actions]
        oom = 0
        try:
            order = RankOrder(sim, stages, optimizer=prof.optimizer if train else "none", scale=scale,
                              recompute=frozenset(s.index for s in plan.stages if s.recompute),
                              offload=frozenset(s.index for s in plan.stages if s.offload))
            order.step(acts, train)
            sim.reset_peaks()
            order.step(acts, train)
        except AllocatorOOM:
            oom = 1
        out[rank] = {**sim.stats(), "oom": oom}
    return out


def allocator_reserve(plan: Plan, prof: Profile, reserve: dict[str, int], cap: float | None,
                      config: AllocatorConfig | None = None) -> int:
    """Record in ``plan`` the allocator it assumes and, where simulated, each rank's predicted
    ``max_memory_reserved``; the reserve's assumed slack becomes the simulated allocator share
    (``allocator_bytes``) when every rank is simulated ([Note: allocator reserve]). ``cap``: the
    GPU's memory. Returns by how many bytes the fullest rank's peak plus its share passes what the
    allocator may reserve (the cap less the context and NCCL): 0 when the plan fits as simulated."""
    if not reserve:  # not a GPU spec: no allocator to simulate
        return 0
    config = config or AllocatorConfig.from_env()
    info: dict[str, object] = {"assumes": config.describe(), "expandable_segments": config.expandable_segments,
                               "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""}
    plan.config["allocator"] = info
    room = None if cap is None else int(cap) - sum(v for k, v in reserve.items() if k not in ("slack_bytes", "allocator_bytes"))
    free = simulate_plan(prof, plan, config)
    if not free:
        info["simulated"] = "no: " + ("spatial stages" if logged(prof) else "the profile has no allocation log")
        return 0
    tight = ({} if room is None or all(f["peak_reserved"] <= room for f in free.values())
             else simulate_plan(prof, plan, config, capacity=room))  # torch releases its cache before failing
    peak = {r.rank: r.predicted_peak_bytes for r in plan.ranks}
    ranks: dict[str, dict[str, int]] = {}
    over = 0.0
    for r, f in free.items():
        g = tight.get(r, f) if not tight.get(r, {}).get("oom") else f
        share = g["peak_reserved"] - g["peak_allocated"]
        ranks[str(r)] = {"predicted_reserved_bytes": int(peak[r] + share), "share_bytes": share,
                         "simulated_allocated_bytes": f["peak_allocated"], "simulated_reserved_bytes": f["peak_reserved"],
                         "kept_bytes": f["peak_kept"], "released": int(bool(tight.get(r, {}).get("num_alloc_retries"))),
                         "oom": int(tight.get(r, {}).get("oom", 0))}
        if room is not None:
            over = max(over, peak[r] + share - room, 1.0 if ranks[str(r)]["oom"] else 0.0)
    info["ranks"] = ranks
    slots = {r.rank for r in plan.ranks if r.dp == 0 and any(int(e.get("part", 0)) == 0 for e in r.stages)}
    if len(free) == len(slots):
        info["simulated"] = "yes"
        reserve.pop("slack_bytes", None)
        reserve["allocator_bytes"] = max(v["share_bytes"] for v in ranks.values())
    else:
        info["simulated"] = f"{len(free)} of {len(slots)} pipeline ranks (the others hold spatial stages)"
    plan.predicted["reserved_bytes"] = max(v["predicted_reserved_bytes"] for v in ranks.values())
    if over > 0:
        worst = max(ranks, key=lambda k: ranks[k]["predicted_reserved_bytes"])
        log.warning("rank %s: predicted max_memory_reserved %s (%s of tensors + %s the caching allocator keeps, %s) "
                    "passes the %s the allocator may reserve by %s: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                    "before planning, or plan with a lower gpu_memory ([Note: allocator reserve])", worst,
                    format_bytes(ranks[worst]["predicted_reserved_bytes"]), format_bytes(peak[int(worst)]),
                    format_bytes(ranks[worst]["share_bytes"]), config.describe(), format_bytes(room or 0), format_bytes(over))
    return int(over)
