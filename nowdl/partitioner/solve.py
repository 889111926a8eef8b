"""The planner's entry point: coarsen, solve the MILP (DP fallback), expand to the graph."""

from __future__ import annotations

import dataclasses
import logging
import time

from nowdl.partitioner.coarsen import coarsen as coarsen_problem
from nowdl.partitioner.coarsen import compose_groups, expand
from nowdl.partitioner.dp import check_problem
from nowdl.partitioner.ilp import solve_ilp
from nowdl.partitioner.problem import Partition, Problem

__all__ = ["solve"]

log = logging.getLogger(__name__)


def solve(
    problem: Problem,
    *,
    time_limit: float = 30.0,
    solver: str = "auto",
    coarsen: bool = True,
    max_nodes: int | None = None,
    threads: int = 1,
) -> Partition:
    """Partition a problem's DAG into pipeline stages: what the rest of nowdl calls.

    Exact coarsening (see ``coarsen``), then the MILP with the DP as MIP start and fallback,
    then the assignment mapped back and re-evaluated on the original problem.

    Example:
        >>> part = solve(problem, time_limit=10)
        >>> part.stage_of, part.status, part.bottleneck_mem

    Args:
        problem: the problem.
        time_limit: seconds for the solver (model building and solves).
        solver: "auto" (HiGHS, else CBC), "highs" or "cbc".
        coarsen: merge nodes first where that provably loses nothing.
        max_nodes: if given, also merge greedily down to this many nodes (faster, not
            exact: an optimal status then reads "coarse-optimal").
        threads: solver threads (1 is deterministic).

    Returns:
        The Partition of the original problem, evaluated with ``evaluate()``.

    Raises:
        ValueError: if the problem or an argument is malformed.
        InfeasibleError: if no placement respects pins/tileability or fits ``mem_cap``.
    """
    t0 = time.perf_counter()
    check_problem(problem)
    work, groups, exact = problem, [[v] for v in range(problem.n)], True
    if coarsen:
        work, groups = coarsen_problem(problem)
    if max_nodes is not None and work.n > max_nodes:
        small, inner = coarsen_problem(work, max_nodes=max_nodes)
        if small.n < work.n:
            groups = compose_groups(groups, inner)
            work, exact = small, False
    if work.n < problem.n:
        log.info("solve: %d nodes -> %d (%s)", problem.n, work.n,
                 "exact merges" if exact else "greedy merges: not exact")
    part = solve_ilp(work, time_limit=time_limit, solver=solver, threads=threads)
    if work is not problem:
        part = expand(part, groups, problem, exact=exact)
    part = dataclasses.replace(part, seconds=time.perf_counter() - t0)
    log.info(
        "solve: %s %s (gap %.3g) in %.2f s: max rank memory %.4g GiB, max rank time %.4g s",
        part.solver, part.status, part.gap, part.seconds, part.bottleneck_mem / 2**30,
        part.bottleneck_time,
    )
    return part
