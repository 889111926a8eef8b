"""Random partitioning problems and the brute-force references the solver tests check against.

``random_problem`` and ``resnet_like`` build :class:`Problem` instances (``with_skip_waits``
charges 1F1B's long-skip gradient waits on one); ``feasible``,
``brute_force``, ``all_splits`` and ``lex_reference`` enumerate every monotone split of a small
problem; ``check_valid`` and ``check_levels`` assert a solver's split against them.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from nowdl.partitioner.chain.chain_dp import spread_ok
from nowdl.partitioner.costs.no_idle import stage_work
from nowdl.partitioner.costs.problem import NodeVectors, Partition, Problem, StageSpec, evaluate
from nowdl.partitioner.costs.structure import make_partition, objective_values
from nowdl.partitioner.milp.solve import available_solvers
from nowdl.schedule.orders import skip_waits

__all__ = [
    "SOLVERS",
    "Levels",
    "all_splits",
    "brute_force",
    "check_levels",
    "check_valid",
    "close",
    "feasible",
    "lex_reference",
    "random_problem",
    "resnet_like",
    "with_skip_waits",
]

SOLVERS = available_solvers()


def random_problem(
    rng: random.Random,
    n: int,
    k: int,
    *,
    skips: float = 0.3,
    spatial: bool = False,
    master: bool = False,
    objective: str = "memory",
    zeros: float = 0.2,
) -> Problem:
    """A random DAG (a chain with random extra and long skip edges) and random costs."""
    edges: set[tuple[int, int]] = set()
    for v in range(1, n):
        edges.add((v - 1, v) if rng.random() < 0.8 else (rng.randrange(v), v))
        if rng.random() < skips:
            edges.add((rng.randrange(v), v))

    def vec() -> list[float]:
        return [0.0 if rng.random() < zeros else rng.uniform(0, 10) for _ in range(n)]

    variants = {"plain": NodeVectors(act=vec(), time=vec(), workspace=vec(), out=vec())}
    stages = [
        StageSpec(inflight=rng.randint(1, 3), link_s_per_byte=rng.choice([0.0, 0.1]))
        for _ in range(k)
    ]
    # odd stages hold boundary tensors as the runtime does ([Note: held buffers]), not inflight times
    stages = [st if s % 2 == 0 else dataclasses.replace(st, recv_held=st.inflight + 1.0, send_held=1.0)
              for s, st in enumerate(stages)]
    tileable: list[bool] = []
    if spatial:
        variants["tile2"] = NodeVectors(act=vec(), time=vec(), workspace=vec(), out=vec())
        stages[0] = StageSpec(inflight=2, variant="tile2", spatial=True, link_s_per_byte=0.05)
        tileable = [rng.random() < 0.75 for _ in range(n)]
    ranks = [[r, k - 1 - r] for r in range((k + 1) // 2)] if master else []
    return Problem(
        names=[f"node{i}" for i in range(n)],
        edges=sorted(edges),
        static=vec(),
        variants=variants,
        stages=stages,
        tileable=tileable,
        ranks=ranks,
        objective=objective,
    )


def with_skip_waits(problem: Problem) -> Problem:
    """``problem`` with the long-skip gradient waits of 1F1B at 2K micro-batches on its stages."""
    counts = skip_waits("1f1b", problem.k, 2 * problem.k)
    return dataclasses.replace(problem, stages=[dataclasses.replace(st, skip_wait=counts[s])
                                                for s, st in enumerate(problem.stages)])


def feasible(problem: Problem, stage_of: list[int] | tuple[int, ...], *, cap_rel: float = 0.0) -> bool:
    """Non-empty stages, precedence, pins, tileability (and the cap, with a relative tolerance)."""
    if len(set(stage_of)) != problem.k:
        return False
    if any(stage_of[u] > stage_of[v] for u, v in problem.edges):
        return False
    if any(stage_of[v] != s for v, s in problem.pinned.items()):
        return False
    if any(len({stage_of[v] for v in grp}) > 1 for grp in problem.tied):
        return False
    if problem.tileable and any(
        problem.stages[stage_of[v]].spatial and not problem.tileable[v] for v in range(problem.n)
    ):
        return False
    if problem.mem_cap is not None:
        part = make_partition(problem, stage_of)
        if part.bottleneck_mem > problem.mem_cap * (1 + cap_rel):
            return False
    return True


def brute_force(problem: Problem) -> tuple[tuple[float, float], tuple[int, ...]] | None:
    """Lexicographic (primary, secondary) optimum over all monotone assignments."""
    best: tuple[tuple[float, float], tuple[int, ...]] | None = None
    for a in itertools.product(range(problem.k), repeat=problem.n):
        if not feasible(problem, a):
            continue
        key = objective_values(problem, make_partition(problem, a))
        if best is None or key < best[0]:
            best = (key, a)
    return best


@dataclasses.dataclass(frozen=True)
class Levels:
    """The reference values of [Note: lexicographic levels] over a set of splits."""

    primary: float  # level 1
    secondary: float  # level 2 with level 1 held
    spread: float  # max of the least busy stage's work with levels 1 and 2 held
    spread_relaxed: float  # the same with only level 1 held
    secondary_relaxed: float  # level 2 among the level-1 optima with spread_relaxed held


def lex_reference(problem: Problem, splits: list[tuple[int, ...]]) -> Levels | None:
    """Levels 1-3 over the given feasible splits (brute force)."""
    rows = []
    for a in splits:
        prim, sec = objective_values(problem, make_partition(problem, a))
        rows.append((prim, sec, min(stage_work(problem, a))))
    if not rows:
        return None
    tol = 1e-9
    p = min(r[0] for r in rows)
    p_opt = [r for r in rows if r[0] <= p + tol * abs(p)]
    s = min(r[1] for r in p_opt)
    held = [r for r in p_opt if r[1] <= s + tol * abs(s)]
    w2 = max(r[2] for r in held)
    w1 = max(r[2] for r in p_opt)
    s1 = min(r[1] for r in p_opt if r[2] >= w1 - tol * abs(w1))
    return Levels(p, s, w2, w1, s1)


def all_splits(problem: Problem) -> list[tuple[int, ...]]:
    """Every feasible split of ``problem`` (brute force over all assignments)."""
    return [a for a in itertools.product(range(problem.k), repeat=problem.n) if feasible(problem, a)]


def check_levels(problem: Problem, part: Partition, ref: Levels, rel: float = 1e-6) -> None:
    """The split meets [Note: lexicographic levels]: the primary optimum; the secondary
    optimum unless spreading the work needed the levels swapped; level 3 when a stage
    would otherwise idle; an idle stage only when no primary optimum avoids it."""
    prim, sec = objective_values(problem, part)
    work = stage_work(problem, part.stage_of)
    assert close(prim, ref.primary, rel), (prim, ref)
    if close(sec, ref.secondary, rel):
        assert spread_ok(work) or close(min(work), ref.spread, rel), (work, ref)
    else:  # levels 2 and 3 swapped: the spread then holds and is the best possible
        assert spread_ok(work), (work, ref)
        assert close(min(work), ref.spread_relaxed, rel) and close(sec, ref.secondary_relaxed, rel)


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    """``a`` and ``b`` agree to ``rel`` (relative, with an absolute floor of ``rel``)."""
    return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)


def check_valid(problem: Problem, part: Partition) -> None:
    """``part`` is a feasible split of ``problem`` whose stage costs equal ``evaluate``'s."""
    assert len(part.stage_of) == problem.n
    assert feasible(problem, part.stage_of, cap_rel=1e-6)
    mem, tim = evaluate(problem, part.stage_of)
    assert part.stage_mem == pytest.approx(mem)
    assert part.stage_time == pytest.approx(tim)



def resnet_like(blocks: int, k: int, *, seed: int = 0, objective: str = "memory") -> Problem:
    """A ResNet-shaped chain: stem, then blocks conv,bn,relu,conv,bn,add,relu with a skip."""
    rng = random.Random(seed)
    names: list[str] = []
    edges: list[tuple[int, int]] = []
    static: list[float] = []
    act: list[float] = []
    tim: list[float] = []
    ws: list[float] = []
    out: list[float] = []

    def add(name: str, st: float, a: float, t: float, w: float, o: float, preds: list[int]) -> int:
        names.append(name)
        static.append(st)
        act.append(a)
        tim.append(t)
        ws.append(w)
        out.append(o)
        i = len(names) - 1
        edges.extend((q, i) for q in preds)
        return i

    hw, c = 512 * 512, 64
    x = add("x", 0, 0, 0, 0, hw * 12, [])
    h = add("stem", c * 3 * 49 * 16, hw * 12, 0.02, 1e7, hw * c * 4, [x])
    per = max(1, blocks // 4)
    for b in range(blocks):
        if b and b % per == 0:
            hw, c = hw // 4, c * 2
        sz = hw * c * 4.0
        j = lambda: rng.uniform(0.9, 1.1)  # noqa: E731
        c1 = add(f"b{b}_conv1", c * c * 9 * 16, sz * j(), 0.01 * j(), 2e6 * j(), sz, [h])
        b1 = add(f"b{b}_bn1", c * 32, sz, 0.003 * j(), 0, sz, [c1])
        r1 = add(f"b{b}_relu1", 0, sz, 0.002 * j(), 0, sz, [b1])
        c2 = add(f"b{b}_conv2", c * c * 9 * 16, sz * j(), 0.01 * j(), 2e6 * j(), sz, [r1])
        b2 = add(f"b{b}_bn2", c * 32, sz, 0.003 * j(), 0, sz, [c2])
        a = add(f"b{b}_add", 0, 0, 0.001 * j(), 0, sz, [b2, h])
        h = add(f"b{b}_relu2", 0, sz, 0.002 * j(), 0, sz, [a])
    f = add("fc", c * 4000 * 4, c * 4, 0.0001, 0, 4000, [h])
    o = add("loss", 0, 0, 0.00001, 0, 4, [f])
    return Problem(
        names=names, edges=edges, static=static,
        variants={"plain": NodeVectors(act=act, time=tim, workspace=ws, out=out)},
        stages=[StageSpec(inflight=min(4, k - s), link_s_per_byte=1e-11) for s in range(k)],
        objective=objective, pinned={x: 0, o: k - 1},
    )


