"""No idle GPU: the work every stage gets, the 5 % rule, and the warning when it cannot hold.

A stage's work is the fwd + bwd compute of its nodes (per rank of a spatial stage; link
time excluded: a stage that only forwards the input does no work). The rule
(``chain.IDLE_FRACTION``): every stage gets at least 5 % of the busiest stage's work, with
MASTER too (a rank there also holds a mirrored stage, but a near-empty stage still leaves
its replica's pipeline a stage short). The solvers' spread level (see [Note: lexicographic
levels]) enforces it whenever the primary optimum allows; the search prefers candidates
where it holds; when none does, the model has less work than the stages can share and the
plan says so.
"""

from __future__ import annotations

from collections.abc import Sequence

from nowdl.partitioner.chain.chain_dp import IDLE_FRACTION, spread_ok
from nowdl.partitioner.costs.problem import Problem

__all__ = ["stage_work", "idle_stages", "idle_warning", "IDLE_FRACTION", "spread_ok"]


def stage_work(problem: Problem, stage_of: Sequence[int]) -> list[float]:
    """Compute seconds (fwd + bwd, per rank of the stage) of every stage."""
    work = [0.0] * problem.k
    for v, s in enumerate(stage_of):
        work[s] += problem.variants[problem.stages[s].variant].time[v]
    return work


def idle_stages(problem: Problem, stage_of: Sequence[int]) -> list[int]:
    """Stages whose work is below ``IDLE_FRACTION`` of the busiest stage's."""
    work = stage_work(problem, stage_of)
    if spread_ok(work):
        return []
    top = max(work)
    return [s for s, w in enumerate(work) if w < IDLE_FRACTION * top]


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def idle_warning(problem: Problem, stage_of: Sequence[int], names: Sequence[str], *,
                 balance: str, pinned: bool) -> str | None:
    """A one-paragraph warning naming the idle ranks and the fix, or None when none idles.

    Args:
        problem: the candidate's problem.
        stage_of: the chosen split.
        names: node names, to say what an idle stage holds.
        balance: the primary quantity ("memory" or "compute").
        pinned: the user pinned the stage count.
    """
    idle = idle_stages(problem, stage_of)
    if not idle:
        return None
    work = stage_work(problem, stage_of)
    top = max(work)
    parts = []
    for s in idle:
        held = [names[v] for v, st in enumerate(stage_of) if st == s]
        what = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        parts.append(f"stage {s} ({what}): {_ms(work[s])}, {work[s] / top:.1%}")
    fix = (f"pin fewer stages (--stages {max(1, problem.k - len(idle))})" if pinned
           else "pin the stage count or micro-batches yourself")
    if balance == "memory":  # work is not what memory balances: e.g. a stage holding more
        # micro-batches in flight is kept light, down to the input alone on a small model
        why = "the split that keeps the fullest GPU lowest leaves " + ("it" if len(idle) == 1 else "them") + \
            " (almost) no work"
        fix += " or balance compute (--balance compute)"
    else:
        why = f"the model has less work than {problem.k} stages can share"
    # MASTER: a rank also holds the other replica's mirrored stage, so no GPU idles; the empty
    # stages only pass micro-batches through
    shared = any(len(r) > 1 for r in problem.rank_stages())
    goal = ("to give every stage work (each GPU works already: it also holds the other replica's "
            "mirrored stage)") if shared else "to use every GPU"
    return (
        f"{len(idle)} of {problem.k} stages get less than {IDLE_FRACTION:.0%} of the busiest "
        f"stage's work ({_ms(top)} per micro-batch): " + "; ".join(parts) + ". No split with "
        f"the optimal {balance} bottleneck spreads the work further, in any configuration "
        f"searched: {why}. {fix[0].upper() + fix[1:]} {goal}."
    )
