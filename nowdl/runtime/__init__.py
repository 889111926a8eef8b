"""Distributed runtime: launch, schedules, the pipeline engine and the trainer."""

from nowdl.runtime.engine import PipelineEngine
from nowdl.runtime.launch import (
    LaunchEnv,
    PeerError,
    default_backend,
    init_distributed,
    launch_env,
    wait,
)
from nowdl.runtime.schedule import (
    Action,
    ScheduleError,
    build_schedule,
    format_grid,
    rank_actions,
    simulate,
)

__all__ = [
    "PipelineEngine", "LaunchEnv", "PeerError", "default_backend", "init_distributed", "launch_env", "wait",
    "Action", "ScheduleError", "build_schedule", "rank_actions", "simulate", "format_grid",
]
