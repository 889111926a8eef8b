"""The caching allocator's simulation against hand-worked sequences ([Note: caching allocator]),
and a plan's predicted ``max_memory_reserved`` ([Note: allocator reserve]).

The H200 records (benchmarks/records/) hold ``max_memory_allocated`` only, so the reserved
prediction is checked here against hand-worked figures and its own invariants, not a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import nowdl
from nowdl.cli.commands import main
from nowdl.plan.allocator import format_allocator, predicted_reserved
from nowdl.profiler.alloc.caching import CachingAllocator
from nowdl.profiler.alloc.sizes import AllocatorConfig, AllocatorOOM, allocation_size, round_size
from nowdl.profiler.devices import fitted_specs

MiB = 2**20
KiB = 2**10


def test_rounding_and_segment_sizes() -> None:
    """512 B blocks; 2 MiB segments for <= 1 MiB, 20 MiB for 1-10 MiB, 2 MiB multiples above."""
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert round_size(5 * MiB + 1, divisions=4) == 6 * MiB  # roundup_power2_divisions: [4, 8) MiB in 1 MiB steps
    assert [allocation_size(n) for n in (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 11 * MiB + 512)] == [
        2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB, 10 * MiB, 12 * MiB]
    sim = CachingAllocator()
    sim.malloc(1)
    assert (sim.allocated, sim.reserved, sim.requested) == (512, 2 * MiB, 1)


def test_small_pool_splits_a_segment_and_reuses_it() -> None:
    """Three 600 KiB requests share one 2 MiB segment (split, 248 KiB left); the fourth takes a new one,
    and a freed block serves the next request of its size."""
    sim = CachingAllocator()
    h = [sim.malloc(600 * KiB) for _ in range(3)]
    assert (sim.allocated, sim.reserved, sim.segments) == (1800 * KiB, 2 * MiB, 1)
    h.append(sim.malloc(600 * KiB))
    assert (sim.allocated, sim.reserved, sim.segments) == (2400 * KiB, 4 * MiB, 2)
    sim.free(h[1])
    sim.malloc(500 * KiB)  # best fit: the freed 600 KiB block, split (100 KiB left)
    assert (sim.allocated, sim.reserved) == (2300 * KiB, 4 * MiB)


def test_large_pool_splits_only_above_1_mib_and_counts_the_unsplit_block() -> None:
    sim = CachingAllocator()
    sim.malloc(5 * MiB)  # a 20 MiB segment, split: 15 MiB free
    sim.malloc(12 * MiB)  # from the 15 MiB block: 3 MiB left (> 1 MiB), split
    assert (sim.allocated, sim.reserved) == (17 * MiB, 20 * MiB)
    sim.malloc(2 * MiB + 512 * KiB)  # the 3 MiB block: 512 KiB would be left, not split: the whole block counts
    assert (sim.allocated, sim.requested, sim.reserved) == (20 * MiB, 19 * MiB + 512 * KiB, 20 * MiB)
    big = CachingAllocator()
    big.malloc(11 * MiB + 1)  # 11 MiB + 512 rounded to a 12 MiB segment; 1 MiB - 512 left: not split
    assert (big.allocated, big.reserved) == (12 * MiB, 12 * MiB)


def test_blocks_merge_within_a_segment_never_across() -> None:
    """Freed neighbours merge back into one block of their segment; two freed 30 MiB segments do not
    serve a 50 MiB request (fragmentation: reserved grows to 110 MiB for 50 MiB allocated)."""
    sim = CachingAllocator()
    a, b = sim.malloc(5 * MiB), sim.malloc(5 * MiB)
    sim.free(a)
    sim.free(b)
    sim.malloc(18 * MiB)  # the whole 20 MiB segment again
    assert (sim.reserved, sim.segments) == (20 * MiB, 1)
    frag = CachingAllocator()
    x, y = frag.malloc(30 * MiB), frag.malloc(30 * MiB)
    frag.free(x)
    frag.malloc(40 * MiB)  # the free 30 MiB block is too small: a new segment
    assert (frag.allocated, frag.reserved) == (70 * MiB, 100 * MiB)
    frag.free(y)
    assert frag.stats()["peak_reserved"] == 100 * MiB
    frag.malloc(50 * MiB)  # 60 MiB free, in two segments of 30: a new 50 MiB segment
    assert (frag.allocated, frag.reserved, frag.segments) == (90 * MiB, 150 * MiB, 4)


def test_a_failing_segment_releases_the_cache_then_raises() -> None:
    sim = CachingAllocator(capacity=100 * MiB)
    sim.free(sim.malloc(60 * MiB))
    sim.malloc(70 * MiB)  # 60 + 70 > 100: the cached 60 MiB segment goes back to the driver first
    assert (sim.reserved, sim.num_alloc_retries) == (70 * MiB, 1)
    with pytest.raises(AllocatorOOM, match="simulated CUDA out of memory"):
        sim.malloc(40 * MiB)


def test_expandable_segments_map_pages_as_needed() -> None:
    """One segment per pool grown in 20 MiB pages (large pool): reserved is allocated rounded up to
    pages, and a freed hole is reused without a new segment."""
    cfg = AllocatorConfig.from_env("expandable_segments:True,max_split_size_mb:512")
    assert cfg.expandable_segments and cfg.max_split_size == 512 * MiB
    sim = CachingAllocator(AllocatorConfig(expandable_segments=True))
    a = sim.malloc(5 * MiB)
    b = sim.malloc(30 * MiB)
    assert (sim.allocated, sim.reserved, sim.segments) == (35 * MiB, 40 * MiB, 1)
    sim.free(a)
    sim.malloc(4 * MiB)
    assert (sim.reserved, sim.segments) == (40 * MiB, 1)
    sim.free(b)
    sim.malloc(34 * MiB)  # b's 30 MiB merged with the free 1 MiB before and 5 MiB after: no new page
    assert sim.reserved == 40 * MiB


def test_a_plan_predicts_reserved_above_allocated_and_shows_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With a GPU spec the plan records the allocator it assumes and each rank's predicted
    max_memory_reserved (>= its predicted peak); ``nowdl show`` prints it."""
    spec = fitted_specs()["h200"]
    model = nowdl.models.unet(3, 2, depth=2, base_width=8)
    plan = nowdl.compile(model, gpus=1, mode="estimate", device_spec=spec, cache=False, progress=False).plan(
        torch.empty(2, 3, 128, 128, device="meta"))
    info = plan.config["allocator"]
    assert info["expandable_segments"] is False and info["simulated"] == "yes"
    reserved = predicted_reserved(plan)
    peak = {r.rank: r.predicted_peak_bytes for r in plan.ranks}
    assert reserved and all(reserved[r] >= peak[r] for r in reserved)
    for v in info["ranks"].values():
        assert v["simulated_reserved_bytes"] >= v["simulated_allocated_bytes"] > 0
        assert v["simulated_reserved_bytes"] % (2 * MiB) == 0  # segments are 2 MiB multiples
    assert plan.predicted["reserved_bytes"] == max(reserved.values())
    assert plan.config["reserve"]["allocator_bytes"] == max(v["share_bytes"] for v in info["ranks"].values())
    path = tmp_path / "plan.json"
    plan.save(path)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert format_allocator(nowdl.Plan.load(path)) in out and "expandable_segments off" in out
    assert "predicted max_memory_reserved" in out
