"""Pipeline schedules: completeness, deadlock freedom (chains, long skips, MASTER), memory, grid, CLI."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from nowdl import Plan
from nowdl.cli.commands import main
from nowdl.schedule import (
    Action,
    Deps,
    Schedule,
    ScheduleError,
    build_schedule,
    chain_deps,
    dag_deps,
    format_grid,
    gpipe,
    inflight_peaks,
    one_f_one_b,
    rank_actions,
    simulate,
    stage_actions,
    stage_deps,
    validate_schedule,
)

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
PLANS = sorted(EXPERIMENTS.glob("*.json"))
BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b}


def unet_deps(k: int) -> Deps:
    """A chain plus UNet skips from stage s to its mirror K-1-s."""
    return dag_deps(k, [(s, s + 1) for s in range(k - 1)] + [(s, k - 1 - s) for s in range(k // 2)])


def random_deps(k: int, rng: random.Random) -> Deps:
    """A random forward-only stage DAG (edges i -> j > i), not necessarily connected."""
    p = rng.random()
    return dag_deps(k, [(i, j) for i in range(k) for j in range(i + 1, k) if rng.random() < p])


def check(schedule: Schedule, deps: Deps, name: str, k: int, m: int, replicas: int = 1) -> None:
    """Complete, runs to the end, and the in-flight memory bound holds per (replica, stage)."""
    validate_schedule(schedule, k, m, replicas)
    steps = simulate(schedule, deps)
    assert sum(a is not None for row in steps for a in row.values()) == 2 * k * m * replicas
    peaks = inflight_peaks(steps)
    for (_, s), peak in peaks.items():
        assert peak == (m if name == "gpipe" else min(m, k - s)), (s, peak)
    # F before B for every micro-batch, and backwards in micro-batch order 0..m-1 on every stage
    when = {a: t for t, row in enumerate(steps) for a in row.values() if a is not None}
    for a, t in when.items():
        if a.kind == "B":
            assert when[Action("F", a.stage, a.microbatch, a.replica)] < t
            if a.microbatch:
                assert when[Action("B", a.stage, a.microbatch - 1, a.replica)] < t


def test_action_str_and_order() -> None:
    assert str(Action("F", 2, 0)) == "2F0"
    assert str(Action("B", 3, 1, replica=1)) == "3B1'"
    with pytest.raises(ScheduleError):
        Action("X", 0, 0)


def test_stage_orders() -> None:
    assert [str(a) for a in stage_actions("1f1b", 4, 4, 1)] == "1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3".split()
    assert [str(a) for a in stage_actions("1f1b", 4, 4, 3)] == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3".split()
    assert [str(a) for a in stage_actions("1f1b", 4, 2, 0)] == "0F0 0F1 0B0 0B1".split()
    assert [str(a) for a in stage_actions("gpipe", 2, 3, 0)] == "0F0 0F1 0F2 0B0 0B1 0B2".split()
    with pytest.raises(ScheduleError, match="unknown pipeline schedule"):
        stage_actions("zigzag", 2, 2, 0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_chain_and_unet_skips(name: str, k: int, m: int) -> None:
    for deps in (chain_deps(k), unet_deps(k)):
        check(BUILDERS[name](k, m), deps, name, k, m)
        check(BUILDERS[name](k, m, deps, replicas=2), deps, name, k, m, replicas=2)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_random_forward_dags_never_deadlock(name: str) -> None:
    rng = random.Random(1234)
    for _ in range(150):
        k, m = rng.randint(1, 8), rng.choice([1, 2, 4, 8])
        deps = random_deps(k, rng)
        check(BUILDERS[name](k, m, deps), deps, name, k, m)
        check(BUILDERS[name](k, m, deps, replicas=2), deps, name, k, m, replicas=2)


def test_backward_edge_is_refused() -> None:
    with pytest.raises(ScheduleError, match="goes backward"):
        dag_deps(3, [(2, 1)])


@pytest.mark.parametrize("k", [4, 5])
def test_master_layout(k: int) -> None:
    sched = one_f_one_b(k, 4, replicas=2)
    for r, acts in sched.items():
        assert {(a.replica, a.stage) for a in acts} == {(0, r), (1, k - 1 - r)}
        # each replica keeps its own 1F1B order inside the merged list
        for rep, st in ((0, r), (1, k - 1 - r)):
            assert [a for a in acts if a.replica == rep] == stage_actions("1f1b", k, 4, st, rep)
    if k % 2:
        mid = sched[k // 2]
        assert {a.replica for a in mid} == {0, 1} and {a.stage for a in mid} == {k // 2}


def test_master_k4_m2_grid() -> None:
    grid = format_grid(simulate(one_f_one_b(4, 2, replicas=2), chain_deps(4)))
    rows = {line.split("|")[0].strip(): line.split("|")[1].split() for line in grid.splitlines()[2:]}
    assert rows["rank 0"][:2] == ["0F0", "0F1"] and "3F0'" in rows["rank 0"]
    assert rows["rank 3"][:2] == ["0F0'", "0F1'"]


@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_experiment_plans(path: Path) -> None:
    plan = Plan.load(path)
    k, m, reps = len(plan.stages), plan.config["micro_batches"], plan.config["replicas"]
    for name in ("1f1b", "gpipe"):
        plan.config["schedule"] = name
        sched = build_schedule(plan)
        assert all(rp.dp == 0 for rp in plan.ranks if rp.rank in sched)
        check(sched, stage_deps(plan), name, k, m, reps)
        simulate(sched, plan)
        for rp in plan.ranks:
            acts = rank_actions(plan, rp.rank, sched)
            held = {(e["replica"], e["stage"]) for e in rp.stages}
            assert {(a.replica, a.stage) for a in acts} == held
            twin = next(r for r in plan.ranks if r.dp == 0 and r.rank in sched and
                        any((e["replica"], e["stage"]) in held for e in r.stages))
            assert acts == [a for a in sched[twin.rank] if (a.replica, a.stage) in held]


def test_unet_plan_deps_have_long_skip() -> None:
    plan = Plan.load(EXPERIMENTS / "unet_2048_8gpu_memory.json")
    producers, consumers = stage_deps(plan)
    want_c: dict[int, set[int]] = {s: set() for s in range(len(plan.stages))}
    want_p: dict[int, set[int]] = {s: set() for s in range(len(plan.stages))}
    for t in plan.tensors:  # the dependencies are exactly the plan's cross-stage tensors
        want_c[t.from_stage].update(t.to_stages)
        for j in t.to_stages:
            want_p[j].add(t.from_stage)
    assert consumers == want_c and producers == want_p and producers[0] == set()
    assert any(j > i + 1 for i, cs in consumers.items() for j in cs), "no long skip in the UNet plan"


def test_deadlock_names_stuck_ranks() -> None:
    sched = one_f_one_b(4, 4)
    acts = sched[0]
    acts[1], acts[4] = acts[4], acts[1]  # rank 0 now waits for 0B0 before sending 0F1: a cycle
    assert [str(a) for a in acts[:5]] == ["0F0", "0B0", "0F2", "0F3", "0F1"]
    with pytest.raises(ScheduleError, match="deadlocks") as err:
        simulate(sched, chain_deps(4))
    msg = str(err.value)
    for text in ("rank 0 at 0B0", "rank 1 at 1F1", "rank 2 at 2F1", "rank 3 at 3F1"):
        assert text in msg
    assert err.value.stuck == {0: Action("B", 0, 0), 1: Action("F", 1, 1), 2: Action("F", 2, 1),
                               3: Action("F", 3, 1)}


def test_invalid_schedules() -> None:
    sched = gpipe(2, 2)
    sched[1].append(Action("F", 0, 0))
    with pytest.raises(ScheduleError, match="twice"):
        simulate(sched, chain_deps(2))
    with pytest.raises(ScheduleError, match="missing 1B1"):
        validate_schedule({0: stage_actions("gpipe", 2, 2, 0), 1: stage_actions("gpipe", 2, 2, 1)[:-1]}, 2, 2)
    with pytest.raises(ScheduleError, match="never scheduled"):
        simulate({0: [Action("F", 1, 0)]}, chain_deps(2))


def test_grid_k4_m4_1f1b() -> None:
    grid = format_grid(simulate(one_f_one_b(4, 4), chain_deps(4)))
    lines = grid.splitlines()
    assert lines[0].split("|")[1].split() == [str(t) for t in range(14)]
    width = 4

    def cell(rank: int, step: int) -> str:
        row = lines[2 + rank].split("|", 1)[1]
        return row[step * width:(step + 1) * width].strip()
    assert cell(0, 0) == "0F0" and cell(0, 3) == "0F3" and cell(0, 4) == "" and cell(0, 7) == "0B0"
    assert cell(3, 3) == "3F0" and cell(3, 4) == "3B0" and cell(3, 10) == "3B3"
    assert cell(1, 6) == "1B0" and cell(1, 7) == "1F3" and cell(2, 5) == "2B0" and cell(2, 6) == "2F2"
    assert lines[2].split()[-1] == "0B3"
    failed = format_grid(simulate(one_f_one_b(4, 4), chain_deps(4)), failed=(2, 5))
    assert "2B0!" in failed and "rank 2 failed at step 5 while running 2B0" in failed


def test_cli_show_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(EXPERIMENTS / "resnet110v2_1024_4gpu_master.json"), "--schedule"]) == 0
    out = capsys.readouterr().out
    assert "GEMS-MASTER" in out and "legend" in out and "3F0'" in out
    assert out.index("predicted") < out.index("schedule:")
    assert main(["show", str(EXPERIMENTS / "amoebanet_2048_sp4.json"), "--schedule"]) == 0
    assert "ranks 0-3" in capsys.readouterr().out


def test_unknown_plan_schedule() -> None:
    plan = Plan.load(EXPERIMENTS / "unet_2048_8gpu_memory.json")
    plan.config["schedule"] = "zigzag"
    with pytest.raises(ScheduleError, match="zigzag"):
        build_schedule(plan)
