"""The memory cap, its charge, the guard's decisions and the records a restart reads (one process,
small fakes; the jobs themselves are in tests/cli/test_replan_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan
from nowdl.runtime.training.checkpoint import CheckpointError
from nowdl.runtime.training.memory_cap import (
    CapTracker,
    Use,
    charged_budget,
    injected_cap,
    memory_cap,
    oom_bytes,
)
from nowdl.runtime.training.memory_guard import WATCH_STEPS, MemoryGuard, restart_charge
from nowdl.runtime.training.reshard import HeldState

KIB = 1024


@pytest.fixture(scope="module")
def plan_json() -> str:
    """A real plan of a one-conv model on one GPU."""
    import nowdl

    cm = nowdl.compile(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), gpus=1, mode="estimate", cache=False,
                       progress=False)
    return cm.plan(torch.empty(1, 3, 8, 8, device="meta")).to_json()


@pytest.fixture
def make_plan(plan_json: str) -> Any:
    def make(gpu_memory: int | None = 10 * KIB, reserve: int = 2 * KIB, planned: float = 6 * KIB) -> Plan:
        plan = Plan.from_json(plan_json)
        plan.config.pop("gpu_memory", None)
        plan.config.pop("reserve", None)
        if gpu_memory is not None:
            plan.config.update(gpu_memory=gpu_memory, reserve={"context_bytes": reserve})
        plan.ranks[0].predicted_peak_bytes = planned
        return plan

    return make


def test_the_cap_is_the_budget_or_the_injected_bytes(monkeypatch: pytest.MonkeyPatch, make_plan: Any) -> None:
    monkeypatch.delenv("NOWDL_MEMORY_CAP", raising=False)
    assert memory_cap(make_plan()) == 8 * KIB  # the GPU's memory less the reserve
    assert memory_cap(make_plan(gpu_memory=None)) is None
    monkeypatch.setenv("NOWDL_MEMORY_CAP", "3KiB")
    assert memory_cap(make_plan()) == 3 * KIB and injected_cap() == (3 * KIB, False)
    monkeypatch.setenv("NOWDL_MEMORY_CAP", "1000,oom")
    assert injected_cap() == (1000, True)
    monkeypatch.setenv("NOWDL_MEMORY_CAP", "1000,boom")
    with pytest.raises(NowdlError, match=r"NOWDL_MEMORY_CAP='1000,boom': give a size in bytes"):
        injected_cap()


def test_the_charge_scales_the_cap_by_the_worst_factor() -> None:
    # rank 1 measured 2x its plan, rank 0 1.25x: the budget is the cap over 2, below rank 1's own plan
    over = [Use(0, 1250, 1000), Use(1, 1600, 800)]
    assert charged_budget(1000, over) == 500 < 800
    assert charged_budget(1000, [Use(0, 1100, 1300)]) == 1181  # measured below its plan: still below it
    with pytest.raises(ValueError):
        charged_budget(1000, [])


def test_a_cap_tracker_raises_out_of_memory_at_the_crossing_allocation() -> None:
    with pytest.raises(torch.OutOfMemoryError) as e, CapTracker(cap=4096, static=1024):
        a = torch.zeros(256)  # 1 KiB: 2 KiB in use
        torch.zeros(1024)  # 4 KiB more: over
    assert "Tried to allocate 4096 bytes with 2048 bytes in use of a cap of 4096 bytes" in str(e.value)
    assert oom_bytes(e.value, cuda=False) == 2048 + 4096
    del a
    cuda_text = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has ...")
    assert oom_bytes(cuda_text, cuda=False) == 2 * 2**20


def test_held_state_reads_by_name_and_refuses_what_it_lacks() -> None:
    held = HeldState({"model/w": torch.ones(2, 3)}, {"steps": 4, "plan": {}}, world=2)
    assert held.step == 4 and set(held.index()) == {"model/w"}
    assert torch.equal(held.read({"model/w": (2, 3)})["model/w"], torch.ones(2, 3))
    assert held.read({"model/v": None}, optional=frozenset({"model/v"})) == {}
    with pytest.raises(CheckpointError, match="needs 'model/v'"):
        held.read({"model/v": None})
    with pytest.raises(CheckpointError, match=r"holds 'model/w' with shape \[3, 2\]"):
        held.read({"model/w": (3, 2)})


class _Trainer:
    def __init__(self, plan: Plan) -> None:
        self.plan, self.world, self.optimizer = plan, 1, None
        self.engine: Any = object()
        self._evaluator: Any = None

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return {"model/w": torch.ones(2)}, {"steps": 2}


class _Compiled:
    def __init__(self, plan: Plan) -> None:
        self._trainer = _Trainer(plan)
        self.model = torch.nn.Linear(2, 2)

    def _train(self) -> _Trainer:
        return self._trainer


def test_the_guard_re_plans_once_then_stops(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, make_plan: Any) -> None:
    monkeypatch.delenv("NOWDL_MEMORY_CAP", raising=False)
    lines: list[str] = []
    asked: list[int] = []
    new_plan = tmp_path / "new.json"
    make_plan(planned=3 * KIB).save(new_plan)
    built: list[HeldState] = []

    def replan(gpu_memory: int, old: Plan, step: int) -> tuple[str, Any]:
        asked.append(gpu_memory)

        def build(state: HeldState) -> _Compiled:
            built.append(state)
            return _Compiled(Plan.load(new_plan))

        return str(new_plan), build

    guard = MemoryGuard(0, 1, lines.append, replan, records=tmp_path / "ck")
    cm = _Compiled(make_plan())
    assert guard.check(cm, 7 * KIB, 1) is cm and not lines  # under the cap of 8 KiB
    new = guard.check(cm, 12 * KIB, 2)  # 12 KiB used, 6 planned: the budget is 8 / 2 = 4 KiB, + 2 reserved
    assert new is not cm and asked == [6 * KIB] and torch.equal(built[0].read({"model/w": None})["model/w"], torch.ones(2))
    assert cm._trainer.engine is None  # the old plan's engine was let go
    assert lines == ["memory: rank 0 used 12.0 KiB in step 2, above its cap of 8.0 KiB (planned 6.0 KiB); re-planned "
                     "for 4.0 KiB per rank (the cap x planned/measured) and went on from step 3 with the same weights: "
                     "plan: 1 stage(s) x 1 micro-batch(es) (1f1b), replicas 1, dp 1, 1 rank(s)"]
    record = json.loads((tmp_path / "ck" / "memory-rank-0.json").read_text())
    assert record["measured"] == 12 * KIB and record["stopped"] == ""
    for step in range(3, 3 + WATCH_STEPS):
        assert guard.watching
        assert guard.check(new, 3 * KIB, step) is new
    assert not guard.watching
    guard.seen = 0
    with pytest.raises(NowdlError) as e:
        guard.check(new, 9 * KIB, 7)
    text = str(e.value)
    assert text.startswith("rank 0 used 9.0 KiB in step 7, above its cap of 8.0 KiB (planned 3.0 KiB), on a plan "
                           "already re-planned for 4.0 KiB per rank") and "the job stops (exit status 2)" in text
    assert "\n" not in text and len(asked) == 1  # one paragraph, no second re-plan
    assert json.loads((tmp_path / "ck" / "memory-rank-0.json").read_text())["stopped"] == text


def test_a_re_plan_that_finds_nothing_stops(monkeypatch: pytest.MonkeyPatch, make_plan: Any) -> None:
    monkeypatch.delenv("NOWDL_MEMORY_CAP", raising=False)

    def replan(gpu_memory: int, old: Plan, step: int) -> tuple[str, Any]:
        raise NowdlError("nothing fits in 4.0 KiB per GPU with 1 GPUs: the leanest split needs 5 KiB. Raise the cap, "
                         "or use more GPUs: 2 GPUs would fit it")

    guard = MemoryGuard(0, 1, print, replan)
    with pytest.raises(NowdlError) as e:
        guard.check(_Compiled(make_plan()), 12 * KIB, 1)
    assert str(e.value).startswith("rank 0 used 12.0 KiB in step 1, above its cap of 8.0 KiB (planned 6.0 KiB): no "
                                   "plan fits 4.0 KiB per rank")
    assert "[nothing fits in 4.0 KiB per GPU with 1 GPUs: the leanest split needs 5 KiB]" in str(e.value)
    assert "more GPUs (2 would fit it)" in str(e.value)


def test_a_restart_reads_the_records_of_its_job_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     make_plan: Any) -> None:
    monkeypatch.delenv("NOWDL_MEMORY_CAP", raising=False)
    for var in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    guard = MemoryGuard(0, 1, print, lambda *a: ("", None), records=tmp_path)
    err = guard.out_of_memory(torch.OutOfMemoryError("Tried to allocate 4096 bytes with 8192 bytes in use"),
                              _Compiled(make_plan()), 2)
    assert str(err).startswith("rank 0 ran out of memory in step 2: it needed at least 12.0 KiB, above its cap of "
                               "8.0 KiB (planned 6.0 KiB): the job stops (exit status 2); a restart")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    charge = restart_charge(tmp_path, 0, 1)
    assert charge is not None and charge.budget == 4 * KIB and charge.gpu_memory == 6 * KIB
    assert charge.said.startswith("rank 0 ran out of memory in step 2 of an earlier attempt")
    # the re-planned attempt runs out of memory too: it stops, and so does every later attempt, at once
    again = MemoryGuard(0, 1, print, lambda *a: ("", None), records=tmp_path, budget=charge.budget)
    stop = str(again.out_of_memory(torch.OutOfMemoryError("Tried to allocate 1 bytes with 8192 bytes in use"),
                                   _Compiled(make_plan()), 1))
    assert "on a plan already re-planned for 4.0 KiB per rank" in stop
    with pytest.raises(NowdlError, match="a restart does not try again"):
        restart_charge(tmp_path, 0, 1)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a new job: the records are the old job's
    assert restart_charge(tmp_path, 0, 1) is None and not list(tmp_path.glob("memory-rank-*.json"))
