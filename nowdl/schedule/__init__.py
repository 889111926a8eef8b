"""Pipeline schedules: which forward and backward each rank runs, in what order.

A *schedule* gives every pipeline slot (a rank of data-parallel copy 0 that holds part 0 of its
stage) the list of actions it executes during one training step. An action is the forward
(``F``) or backward (``B``) of one stage on one micro-batch, for replica 0 or (GEMS-MASTER)
replica 1. Three orders are built:

* **GPipe** (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
  Parallelism", NeurIPS 2019): every stage runs all ``m`` forwards, then all ``m`` backwards.
  Peak in-flight micro-batches per stage: ``m``.
* **1F1B** (PipeDream-Flush; Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
  Training", ICML 2021): stage ``s`` of ``K`` runs ``min(m, K - s)`` warm-up forwards, then
  alternates one backward and one forward, then drains the remaining backwards. Peak in-flight
  micro-batches at stage ``s``: ``min(m, K - s)``.
* **Zero bubble** (ZB-H1; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), ``"zb"``:
  each backward is split into ``B`` (input gradients, sent upstream at once) and ``W`` (weight
  gradients, deferred into what would be bubbles); see
  :mod:`~nowdl.schedule.zero_bubble_order`. In flight (forward ran, ``W`` not yet) on every
  stage: at most ``min(m, K)``.
* **Forward only** (``"forward"``, inference plans): each stage runs ``F0 .. F(m-1)``.
* **GEMS-MASTER** (Jain et al., "GEMS: GPU-Enabled Memory-Aware Model-Parallelism System for
  Distributed DNN Training", SC'20), ``replicas=2``: a second, mirrored replica whose stage ``s``
  lives on the ranks of replica 0's stage ``K-1-s`` (``K`` odd: the middle rank holds both
  copies of the middle stage). Replica 1 trains on its own ``m`` micro-batches (micro-batches
  ``m .. 2m-1`` of the global batch; :attr:`Action.microbatch` is the index *within* the
  replica). A rank's two lists (each a GPipe or 1F1B list) are merged by the time step at which
  each action runs in its own replica's schedule, replica 0 first on ties. Each replica keeps
  its own program order, so its in-flight bound is unchanged.

:func:`simulate` runs a schedule in unit time steps under blocking-receive semantics (an action
runs once every action it depends on ran at an earlier step, and only after the actions before
it on its rank); :func:`format_grid` draws the result, rows = ranks, columns = steps, like
``torch.distributed.pipelining``'s schedule printouts.

Example:
    >>> print(format_grid(simulate(one_f_one_b(4, 4), chain_deps(4))))

The package holds one module per concern: :mod:`~nowdl.schedule.actions` (actions and
the stage DAG), :mod:`~nowdl.schedule.build` (the orders, the MASTER merge, a plan's
per-rank lists), :mod:`~nowdl.schedule.simulation` (validation, simulation, in-flight
peaks) and :mod:`~nowdl.schedule.grid` (the grid); this module only re-exports.
"""

from typing import TYPE_CHECKING

from nowdl.lazy import lazy_exports

if TYPE_CHECKING:
    from nowdl.schedule.actions import (
        FORWARD_ONLY,
        SCHEDULES,
        Action,
        Deps,
        Schedule,
        ScheduleError,
        chain_deps,
        dag_deps,
        stage_deps,
    )
    from nowdl.schedule.build import (
        build_schedule,
        gpipe,
        one_f_one_b,
        rank_actions,
        stage_actions,
        zero_bubble,
    )
    from nowdl.schedule.grid import LEGEND, format_grid, format_plan_schedule
    from nowdl.schedule.simulation import inflight_peaks, simulate, validate_schedule

__all__ = [
    "Action",
    "Schedule",
    "Deps",
    "ScheduleError",
    "SCHEDULES",
    "FORWARD_ONLY",
    "LEGEND",
    "stage_deps",
    "chain_deps",
    "dag_deps",
    "stage_actions",
    "gpipe",
    "one_f_one_b",
    "zero_bubble",
    "build_schedule",
    "rank_actions",
    "validate_schedule",
    "simulate",
    "inflight_peaks",
    "format_grid",
    "format_plan_schedule",
]

__getattr__ = lazy_exports(__name__, {
    "build_schedule": "build", "gpipe": "build", "one_f_one_b": "build", "rank_actions": "build",
    "stage_actions": "build", "zero_bubble": "build", "SCHEDULES": "actions", "FORWARD_ONLY": "actions", "Action": "actions",
    "Deps": "actions", "Schedule": "actions", "ScheduleError": "actions", "chain_deps": "actions",
    "dag_deps": "actions", "stage_deps": "actions", "LEGEND": "grid", "format_grid": "grid",
    "format_plan_schedule": "grid", "inflight_peaks": "simulation", "simulate": "simulation",
    "validate_schedule": "simulation",
})
