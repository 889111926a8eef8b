"""Long-skip gradient waits: the replayed counts, the cost model, the solvers, and the runtime.

[Note: long-skip gradient waits] in nowdl/schedule/orders.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from helpers.distributed import run_workers
from helpers.problems import SOLVERS, brute_force, feasible, random_problem
from torch import nn

import nowdl
from nowdl.partitioner.chain.chain_dp import spread_ok
from nowdl.partitioner.costs.problem import NodeVectors, Problem, StageSpec, evaluate
from nowdl.partitioner.costs.skip_waits import without_waits
from nowdl.partitioner.costs.structure import check_problem, make_partition, objective_values
from nowdl.partitioner.exact import wait_search as waitsearch
from nowdl.partitioner.milp.solve import build_ilp, solve_ilp
from nowdl.partitioner.solver import solve
from nowdl.schedule import stage_actions
from nowdl.schedule.orders import pending_grads, skip_waits, stage_order


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_planner_orders_are_the_runtime_orders(schedule: str) -> None:
    for k in range(1, 7):
        for m in range(1, 9):
            for s in range(k):
                got = [(a.kind, a.microbatch) for a in stage_actions(schedule, k, m, s)]
                assert got == list(stage_order(schedule, k, m, s)), (schedule, k, m, s)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
def test_counts_are_non_increasing_and_zero_from_the_stage_before(schedule: str) -> None:
    for k in range(2, 9):
        for m in (1, 2, k, 2 * k):
            waits = skip_waits(schedule, k, m)
            assert waits[0] == ()
            for j, row in enumerate(waits):
                assert len(row) == j
                assert all(a >= b for a, b in zip(row, row[1:], strict=False)), (schedule, k, m, j, row)
                if j:
                    assert row[-1] == 0.0, "the stage just before posts its receives in time"


def test_1f1b_holds_d_minus_1_and_gpipe_none() -> None:
    # 1F1B steady state: a gradient for the stage d back waits d - 1 backwards
    for k in range(3, 9):
        for j in range(2, k):
            assert skip_waits("1f1b", k, 2 * k)[j] == tuple(float(j - i - 1) for i in range(j))
    # GPipe's peak is its first backward, before any gradient was sent
    assert all(x == 0.0 for row in skip_waits("gpipe", 6, 12) for x in row)
    # too few micro-batches for the steady state: fewer wait
    assert skip_waits("1f1b", 6, 3)[5] == (1.0, 1.0, 1.0, 1.0, 0.0)
    assert skip_waits("1f1b", 6, 2)[5] == (0.0,) * 5


def _line(waits: tuple[float, ...], k: int = 3) -> Problem:
    """a -> b -> c with a long skip a -> c: three nodes, one per stage."""
    vec = NodeVectors(act=[1.0, 1.0, 1.0], time=[1.0, 1.0, 1.0], workspace=[0.0] * 3, out=[10.0, 100.0, 1.0])
    stages = [StageSpec(inflight=1, recv_held=1.0, send_held=0.0) for _ in range(k)]
    stages[-1] = dataclasses.replace(stages[-1], skip_wait=waits)
    return Problem(names=["a", "b", "c"], edges=[(0, 1), (1, 2), (0, 2)], static=[0.0] * 3,
                   variants={"plain": vec}, stages=stages, objective="memory")


def test_evaluate_charges_each_received_tensor_by_its_producers_stage() -> None:
    mem, _ = evaluate(_line((2.0, 0.0)), [0, 1, 2])
    # stage 2: its act 1, receives a (10) and b (100) once each, plus 2 waiting copies of a's gradient
    assert mem[2] == 1.0 + 110.0 + 2 * 10.0
    assert evaluate(without_waits(_line((2.0, 0.0))), [0, 1, 2])[0][2] == 111.0
    with pytest.raises(ValueError, match="non-increasing"):
        check_problem(_line((0.0, 1.0)))


def _with_waits(problem: Problem, schedule: str = "1f1b", m: int = 8) -> Problem:
    waits = skip_waits(schedule, problem.k, m)
    return dataclasses.replace(problem, stages=[dataclasses.replace(st, skip_wait=waits[s])
                                                for s, st in enumerate(problem.stages)])


@pytest.mark.parametrize("seed", range(6))
def test_milp_charges_waits_as_evaluate_and_finds_the_optimum(seed: int) -> None:
    rng = random.Random(seed)
    problem = _with_waits(random_problem(rng, 7, 4, skips=0.6, objective=rng.choice(["memory", "compute"])))
    best = brute_force(problem)
    assert best is not None
    for solver in SOLVERS:
        part = solve_ilp(problem, solver=solver, time_limit=20)
        assert part.status == "optimal"
        assert objective_values(problem, part)[0] == pytest.approx(best[0][0], rel=1e-6)
    model = build_ilp(problem)
    split = list(best[1])
    model.set_values(problem, split)  # the MILP's expressions at a split are evaluate()'s
    mem, _ = evaluate(problem, split)
    rank_mem = [e.value() * model.mem_scale for e in model.rank_mem]
    assert rank_mem == pytest.approx(mem, rel=1e-9)


def _one_in_flight(seed: int) -> Problem:
    """A random 7-node, 4-stage problem with waits, every stage holding one micro-batch (so
    the last stages, where the waits are, can be the bottleneck)."""
    base = random_problem(random.Random(seed), 7, 4, skips=0.6)
    return _with_waits(dataclasses.replace(base, stages=[
        dataclasses.replace(st, inflight=1, recv_held=1.0) for st in base.stages]))


@pytest.mark.parametrize("chains", [True, False], ids=["chain-search", "milp"])
def test_solve_finds_the_optimum_when_waits_bind(chains: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The DPs over cuts cannot see the waits: where they raise its split's bottleneck, solve()
    searches the chains of ideals with them ([Note: wait search]) or, past that search's
    budget, goes on to the MILP, and returns the optimum with them either way."""
    if not chains:
        monkeypatch.setattr(waitsearch, "STEP_BUDGET", 0)
    hits = searched = 0
    for seed in range(40):
        problem = _one_in_flight(seed)
        best = brute_force(problem)
        plain = brute_force(without_waits(problem))
        assert best is not None and plain is not None
        part = solve(problem, time_limit=20)
        assert objective_values(problem, part)[0] == pytest.approx(best[0][0], rel=1e-6), seed
        assert part.status == "optimal"
        if part.solver == "ideals+waits":  # the chain search holds the secondary level too
            assert chains
            searched += 1
            # the search's path: screening keeps the DP's split, the finalist's solve searches
            screened = solve(problem, ilp=False)
            assert screened.solver == "ideals+waits" and screened.status == "feasible"
            again = solve(problem, start=screened, time_limit=20)
            assert (again.solver, again.status) == ("ideals+waits", "optimal")
            assert objective_values(problem, again)[0] == pytest.approx(best[0][0], rel=1e-6), seed
            assert objective_values(problem, part)[1] == pytest.approx(best[0][1], rel=1e-6), seed
        if objective_values(problem, make_partition(problem, list(plain[1])))[0] > best[0][0] * (1 + 1e-6):
            hits += 1  # the split optimal without waits is not optimal with them
    assert hits >= 3, "the random problems should include cases where the waits change the optimum"
    assert searched >= 3 if chains else searched == 0


def test_chain_search_and_milp_agree_on_the_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    """``make demo``'s plan (built-in UNet, 2048², 8 stages, memory): the waits raise the DP's
    split, the chain search proves one, and the MILP (the search with no steps) finds one no
    better, within its 1% ``mip_gap``."""
    from nowdl.models import unet

    def plan() -> Any:
        cm = nowdl.compile(unet(), gpus=8, stages=8, balance="memory", mode="estimate", device_spec="h100",
                           cache=False, progress=False)
        return cm.plan(torch.empty(1, 3, 2048, 2048, device="meta"))

    searched = plan()
    assert (searched.solver["name"], searched.solver["status"]) == ("ideals+waits", "optimal")
    monkeypatch.setattr(waitsearch, "STEP_BUDGET", 0)
    milp = plan()
    assert milp.solver["name"] == "highs"
    peak, milp_peak = searched.predicted["peak_bytes"], milp.predicted["peak_bytes"]
    assert peak <= milp_peak * (1 + 1e-9) and peak >= milp_peak * (1 - 0.01)


def _work(problem: Problem, stage_of: Sequence[int]) -> list[float]:
    """Every stage's compute (no link time), as [Note: lexicographic levels] spreads it."""
    work = [0.0] * problem.k
    for v, s in enumerate(stage_of):
        work[s] += problem.variants[problem.stages[s].variant].time[v]
    return work


@pytest.mark.parametrize("objective", ["memory", "compute"])
def test_chain_search_is_the_lexicographic_optimum(objective: str) -> None:
    """``solve_waits`` on the whole lattice against brute force: both levels, with a cap, and
    a level-1 gap that is a true bound."""
    from nowdl.partitioner.exact.downsets import enumerate_ideals

    checked = secondary = 0
    for seed in range(30):
        rng = random.Random(300 + seed)
        base = random_problem(rng, 7, 4, skips=0.6, objective=objective, spatial=seed % 3 == 0)
        problem = _with_waits(dataclasses.replace(base, stages=[
            dataclasses.replace(st, inflight=rng.choice([1, 2]), recv_held=1.0) for st in base.stages],
            pinned={3: 2} if seed % 4 == 1 else {}))  # spatial stages and pins: allowed steps only
        best = brute_force(problem)
        if best is None:
            continue
        start = brute_force(without_waits(problem))
        assert start is not None
        lat = enumerate_ideals(problem)
        assert lat is not None
        part = waitsearch.solve_waits(problem, lat, make_partition(problem, list(start[1])))
        assert part is not None and part.solver == "ideals+waits" and part.status == "optimal"
        assert objective_values(problem, part)[0] == pytest.approx(best[0][0], rel=1e-6), seed
        if spread_ok(_work(problem, best[1])):  # else level 3 may give up some secondary to spread
            assert objective_values(problem, part)[1] == pytest.approx(best[0][1], rel=1e-6), seed
            secondary += 1
        assert part.gap == pytest.approx(0.0, abs=1e-6)
        # out of time or steps at once: None (the caller's MILP decides)
        assert waitsearch.solve_waits(problem, lat, part, time_limit=0.0) is None
        assert waitsearch.solve_waits(problem, lat, part, budget=0) is None
        # a cap just above the optimum's memory: still found, and nothing over it
        capped = dataclasses.replace(problem, mem_cap=part.bottleneck_mem * (1 + 1e-6))
        got = waitsearch.solve_waits(capped, lat, make_partition(capped, list(part.stage_of)))
        assert got is not None and got.bottleneck_mem <= part.bottleneck_mem * (1 + 1e-6)
        # a level-1 gap of 30%: a split within it, and the gap it reports is a true bound
        loose = waitsearch.solve_waits(problem, lat, make_partition(problem, list(start[1])), gap=0.3,
                                      exact_first=False)
        assert loose is not None
        value = objective_values(problem, loose)[0]
        assert value * (1 - loose.gap) <= best[0][0] * (1 + 1e-9) and value <= best[0][0] / (1 - 0.3) * (1 + 1e-9)
        checked += 1
    assert checked >= 20 and secondary >= 10


# ---- the runtime holds what the model counts ---------------------------------------------------

def _unet() -> nn.Module:
    from monai.networks.nets import UNet

    torch.manual_seed(0)
    return UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1)


_SCHEDULES = ("1f1b", "gpipe", "zb")


def _count_worker(rank: int, world: int, m: int) -> dict[str, tuple[list[dict[str, int]], Any]]:
    """Per schedule, per backward of this rank: how many gradient sends of each tensor are
    still held (one process group for the three schedules: spawning costs more than a step)."""
    from nowdl.runtime.pipeline import transfers
    seen: list[dict[str, int]] = []
    held: list[Any] = []
    release = transfers.Transfers.release_done

    def spy_release(self: Any, sends: list[Any]) -> list[Any]:
        left = release(self, sends)
        held[:] = [what for _, what, _, _, _ in left]
        return left

    backward = torch.autograd.backward

    def spy_backward(*args: Any, **kwargs: Any) -> None:
        counts: dict[str, int] = {}
        for what in held:
            if what.startswith("gradient of "):
                name = what[len("gradient of "):].rsplit(" to stage ", 1)[0]
                counts[name] = counts.get(name, 0) + 1
        seen.append(counts)
        backward(*args, **kwargs)

    transfers.Transfers.release_done = spy_release  # type: ignore[method-assign]
    torch.autograd.backward = spy_backward  # type: ignore[assignment]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(m, 1, 16, 16, generator=g), torch.randn(m, 2, 16, 16, generator=g)
    out = {}
    for schedule in _SCHEDULES:
        cm = nowdl.compile(_unet(), gpus=world, stages=world, dp=1, replicas=1, spatial_parts=1, micro_batches=m,
                           schedule=schedule, mode="estimate", optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                           loss_fn=nn.MSELoss(), cache=False, progress=False, timeout_s=60)
        cm.train_step(x, y)
        tensors = [(t.producer, t.from_stage, list(t.to_stages)) for t in cm.plan(x[:1]).tensors]
        seen.clear()  # planning ran backwards too (profiling): keep the second step's only
        cm.train_step(x, y)
        out[schedule] = (list(seen), tensors)
        held.clear()
    return out


def test_runtime_holds_the_replayed_gradients() -> None:
    """Every gradient a stage sends back is held into its later backwards exactly as the
    replay says (long skips and, for GPipe, the stage before too), for each schedule."""
    k, m = 4, 4
    results = run_workers(_count_worker, k, m, timeout_s=300)
    for schedule in _SCHEDULES:
        tensors = results[0][schedule][1]
        sent = [(name, i, j) for name, i, to in tensors for j in to if j < k]
        assert any(j - i >= 2 for _, i, j in sent), "the 4-stage UNet plan should send a long skip"
        orders = [stage_order(schedule, k, m, s) for s in range(k)]
        for name, i, j in sent:
            seen = [c.get(name, 0) for c in results[j][schedule][0]]
            assert seen == [c for _, _, c in pending_grads(orders[i], orders[j])], (schedule, name, i, j, seen)


def test_screening_reports_the_dp_split_with_a_valid_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the MILP (the search's screening), a DP split the waits made unproven (the
    search over chains out of budget) says so, and its gap is measured from a true lower bound."""
    monkeypatch.setattr(waitsearch, "STEP_BUDGET", 0)
    seen = 0
    for seed in range(40):
        problem = _one_in_flight(seed)
        part = solve(problem, ilp=False)
        if not part.solver.endswith("+waits"):
            continue
        seen += 1
        best = brute_force(problem)
        assert best is not None
        value = objective_values(problem, part)[0]
        assert part.status == "feasible" and 0 < part.gap < 1
        assert value * (1 - part.gap) <= best[0][0] * (1 + 1e-9) <= value * (1 + 1e-9)
    assert seen >= 3


def _zero_cost_nodes(problem: Problem, rng: random.Random, count: int) -> tuple[Problem, set[int]]:
    """``problem`` with ``count`` nodes made free (views, reshapes): coarsening may merge them."""
    free = set(rng.sample(range(1, problem.n - 1), count))

    def cut(xs: Any) -> list[float]:
        return [0.0 if v in free else float(x) for v, x in enumerate(xs)]

    variants = {k: NodeVectors(act=cut(vec.act), time=cut(vec.time), workspace=cut(vec.workspace), out=list(vec.out))
                for k, vec in problem.variants.items()}
    return dataclasses.replace(problem, static=cut(problem.static), variants=variants), free


def _best_without_free_stages(problem: Problem, free: set[int]) -> float:
    """Brute-force optimum over the splits where no stage holds only free nodes (a GPU with
    nothing to do: the exact merges of coarsen.py assume no optimum needs one)."""
    best = math.inf
    for a in itertools.product(range(problem.k), repeat=problem.n):
        if not feasible(problem, a) or any(all(v in free for v in range(problem.n) if a[v] == s)
                                           for s in range(problem.k)):
            continue
        best = min(best, objective_values(problem, make_partition(problem, a))[0])
    return best


def test_exact_merges_stay_exact_with_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Merging a free node into its producer lets its tensor start stages earlier; with waits
    that may cost more, so the merge also needs no stage to fit in between."""
    from nowdl.partitioner import solver
    from nowdl.partitioner.exact.coarsen import _Groups, coarsen

    def misses() -> int:
        bad = merged = 0
        for seed in range(80):
            rng = random.Random(900 + seed)
            problem, free = _zero_cost_nodes(random_problem(rng, 7, 4, skips=0.8), rng, 2)
            problem = _with_waits(problem)
            if coarsen(problem)[0].n == problem.n:
                continue
            merged += 1
            got = objective_values(problem, solve(problem, time_limit=20))[0]
            bad += got > _best_without_free_stages(problem, free) * (1 + 1e-9)
        assert merged >= 10
        return bad

    assert misses() == 0
    monkeypatch.setattr(_Groups, "between_free", lambda self, lo, hi, mover: True)  # the rules without the check
    monkeypatch.setattr(solver, "solve_unmerged", lambda *a, **k: False)  # and the merged graph's split kept
    assert misses() > 0, "the random problems should include a merge the waits make unsafe"
