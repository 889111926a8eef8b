"""[Note: search deadline]: the search starts no work after its time limit and says so; [Note:
leanest tiles first]: sequential-tile candidates a larger T proves over the cap are not solved."""

from __future__ import annotations

import re
import time
import types
from typing import Any

import pytest
import torch

import nowdl
import nowdl.partitioner.search.best_plan as best_plan
import nowdl.partitioner.search.deadline as search_deadline
from nowdl.errors import InfeasibleError
from nowdl.partitioner.search.deadline import REFUSAL_S, TileGroups, refusal_budget


def _plan(model: torch.nn.Module, side: int, **kw: Any) -> nowdl.Plan:
    cm = nowdl.compile(model, mode="estimate", device_spec="h100", cache=False, progress=False, global_batch=1, **kw)
    return cm.plan(torch.empty(1, 3, side, side, device="meta"))


def _unet(norm: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return nowdl.models.unet(base_width=4, depth=2, norm=norm)


def _clock_jumps_after_first_solve(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From the first candidate solved on, the search's clock reads a day later."""
    offset = [0]
    fake = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset[0])
    monkeypatch.setattr(best_plan, "time", fake)
    solve_one = best_plan._evaluate

    def evaluate(*a: Any, **kw: Any) -> Any:
        out = solve_one(*a, **kw)
        offset[0] = 86400
        return out

    monkeypatch.setattr(best_plan, "_evaluate", evaluate)
    return offset


def test_a_search_cut_short_returns_its_best_plan_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = _plan(_unet(), 256, gpus=4, planner=nowdl.PlannerOptions(time_limit=30))
    assert "untried" not in whole.solver["search"] and not any("ran out" in w for w in whole.warnings)
    _clock_jumps_after_first_solve(monkeypatch)
    cut = _plan(_unet(), 256, gpus=4, planner=nowdl.PlannerOptions(time_limit=30))
    stats = cut.solver["search"]
    assert stats["evaluated"] == 1 and stats["untried"] > 0
    assert stats["untried"] + stats["evaluated"] + stats["pruned_by_bound"] + stats["over_cap_by_bound"] <= stats["enumerated"]
    warning = next(w for w in cut.warnings if "ran out of its" in w)
    assert f"after trying {stats['enumerated'] - stats['untried']} of {stats['enumerated']} candidate" in warning
    assert cut.predicted["throughput"] <= whole.predicted["throughput"] * (1 + 1e-9)


def test_a_search_cut_short_before_anything_fits_refuses_naming_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    kw: dict[str, Any] = dict(gpus=4, gpu_memory="3.5MiB", recompute="off", offload="off", tiles_per_gpu=1,
                              planner=nowdl.PlannerOptions(time_limit=30))
    with pytest.raises(InfeasibleError, match="^nothing fits"):  # the whole search: nothing fits
        _plan(_unet(), 256, **kw)
    _clock_jumps_after_first_solve(monkeypatch)
    with pytest.raises(InfeasibleError) as e:
        _plan(_unet(), 256, **kw)
    msg = str(e.value)
    assert re.match(r"time limit: the search ran out of its \d+\.\d s after trying \d+ of \d+ candidate configurations "
                    r"of 4 GPUs, none of which fits 3\.5 MiB per GPU; the leanest split it made needs ", msg), msg
    assert "raise the time limit (--time-limit 120" in msg and "\n" not in msg


def test_a_limit_spent_bounding_still_answers_with_the_easy_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: easy candidates first]: when the time limit ends while candidates are still being
    bounded (2,048 GPUs under load), the search solves what it bounded, one stage first, and
    answers with a plan that fits and the number it left untried, not with "0 tried"."""
    offset = [0.0]
    fake = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + offset[0])
    monkeypatch.setattr(best_plan, "time", fake)
    monkeypatch.setattr(search_deadline, "time", fake)
    bound_one = search_deadline.candidate_bounds
    bounded: list[Any] = []

    def bounds(cc: Any, cand: Any, *a: Any, **kw: Any) -> Any:
        bounded.append(cand)
        if len(bounded) == 3:
            offset[0] = 86400.0  # the limit ends after three candidates are bounded
        return bound_one(cc, cand, *a, **kw)

    monkeypatch.setattr(search_deadline, "candidate_bounds", bounds)
    plan = _plan(_unet(), 256, gpus=64, planner=nowdl.PlannerOptions(time_limit=30))
    stats = plan.solver["search"]
    assert bounded[0].stages == 1 and stats["evaluated"] >= 1 and stats["untried"] > 0
    assert plan.predicted["peak_bytes"] <= plan.config["gpu_memory"]
    assert any("ran out of its" in w for w in plan.warnings)


def test_refusal_figures_get_what_is_left_but_a_floor() -> None:
    now = time.perf_counter()
    assert refusal_budget(now + 1000, 20.0) == 20.0
    assert refusal_budget(now - 5, 20.0) == REFUSAL_S
    assert REFUSAL_S < refusal_budget(now + 10, 20.0) <= 10


def test_leanest_tiles_first_skips_only_what_cannot_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A UNet with BatchNorm at 2048² on 2 GPUs under 110 MiB: the sequential-tile candidates are solved
    only after the lever ones fit, and every one whose largest T is proven over the cap is
    skipped; the plan is the one the search makes solving them all."""
    kw: dict[str, Any] = dict(gpus=2, gpu_memory="110MiB", planner=nowdl.PlannerOptions(time_limit=30))
    pruned = _plan(_unet(norm=True), 2048, **kw)
    monkeypatch.setattr(TileGroups, "dominated_over", lambda self, cand: False)
    every = _plan(_unet(norm=True), 2048, **kw)
    a, b = pruned.solver["search"], every.solver["search"]
    assert a["over_cap_by_bound"] > b["over_cap_by_bound"] and a["evaluated"] < b["evaluated"]
    assert pruned.predicted == every.predicted
    assert [(s.nodes, s.parts, s.tiles_per_gpu, s.offload, s.recompute) for s in pruned.stages] == \
        [(s.nodes, s.parts, s.tiles_per_gpu, s.offload, s.recompute) for s in every.stages]


@pytest.mark.slow
def test_the_anytime_winner_alone_gets_the_wait_refinement(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: winner refinement]: in the anytime search the chosen candidate's split is refined
    once, within its per-node budget, and the plan keeps it only if its reported peak does not
    rise; with a time limit (the MILP's search) it is not refined."""
    import monai.networks.nets as nets

    import nowdl.partitioner.search.deadline as deadline

    calls: list[tuple[int, float]] = []
    real = deadline.refine_winner

    def spy(problem: Any, part: Any, *, budget_s: float) -> Any:
        calls.append((problem.n, budget_s))
        return real(problem, part, budget_s=budget_s)

    monkeypatch.setattr(deadline, "refine_winner", spy)
    torch.manual_seed(0)
    model = nets.BasicUNetPlusPlus(spatial_dims=2, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4))
    x = torch.empty(1, 1, 32, 32, device="meta")
    kw: dict[str, Any] = dict(gpus=4, stages=4, micro_batches=4, balance="memory", mode="estimate",
                              device_spec="h100", progress=False, cache=False)
    plan = nowdl.compile(model, **kw).plan(x)
    assert len(calls) == 1 and 0 < calls[0][1] <= deadline.REFINE_S_PER_NODE * calls[0][0]
    assert plan.solver["status"] in ("feasible", "heuristic")
    calls.clear()
    nowdl.compile(model, planner=nowdl.PlannerOptions(time_limit=4), **kw).plan(x)
    assert not calls
