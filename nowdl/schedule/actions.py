"""The vocabulary of pipeline schedules: actions, schedules, and the stage dependency graph.

An :class:`Action` is the forward (``F``), backward (``B``) or deferred weight gradient (``W``,
zero-bubble only) of one stage on one micro-batch
of one replica; a :data:`Schedule` maps each pipeline slot to its actions in order; :data:`Deps`
is the stage DAG (which stages feed which), built from a plan's cross-stage tensors
(:func:`stage_deps`), a chain (:func:`chain_deps`) or explicit edges (:func:`dag_deps`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from nowdl.errors import NowdlError

if TYPE_CHECKING:
    from nowdl.plan.plan import Plan

__all__ = ["Action", "Schedule", "Deps", "ScheduleError", "SCHEDULES", "FORWARD_ONLY", "stage_deps", "chain_deps", "dag_deps"]

SCHEDULES = ("gpipe", "1f1b", "zb")

FORWARD_ONLY = "forward"
"""The schedule of an inference plan: each stage runs ``F0 .. F(m-1)``, no backward (not a training choice)."""


class ScheduleError(NowdlError):
    """A schedule is malformed, incomplete, or deadlocks (the message names the stuck ranks).

    Attributes:
        stuck: rank -> the action it is blocked at (empty unless the schedule deadlocked).
        step: the time step at which no rank could progress (-1 if not a deadlock).
    """

    def __init__(self, message: str, *, stuck: Mapping[int, Action] | None = None, step: int = -1) -> None:
        super().__init__(message)
        self.stuck: dict[int, Action] = dict(stuck or {})
        self.step = step


@dataclass(frozen=True, order=True)
class Action:
    """One forward (``"F"``), backward (``"B"``) or weight-gradient pass (``"W"``) of ``stage`` on
    ``microbatch``.

    Under the zero-bubble schedule ``B`` computes only the input gradients (sent upstream at
    once) and ``W`` the deferred weight gradients of the same micro-batch; the other schedules
    have no ``W`` (their ``B`` computes both).

    ``microbatch`` is the index within the replica (0 .. m-1). ``str()`` gives ``"2F0"`` (stage 2,
    forward, micro-batch 0) and ``"2F0'"`` for replica 1.
    """

    kind: str
    stage: int
    microbatch: int
    replica: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B", "W"):
            raise ScheduleError(f"action kind must be 'F', 'B' or 'W', got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}" + "'" * self.replica


Schedule: TypeAlias = dict[int, list[Action]]
"""Pipeline slot (rank of dp copy 0 holding part 0 of its stages) -> actions in execution order."""

Deps: TypeAlias = tuple[dict[int, set[int]], dict[int, set[int]]]
"""(stage -> producer stages, stage -> consumer stages), as :func:`stage_deps` returns."""


# ---- stage dependency graphs -------------------------------------------------------------------
def stage_deps(plan: Plan) -> Deps:
    """The stage DAG of ``plan``: (stage -> producer stages, stage -> consumer stages).

    Built from ``plan.tensors`` (long skips included); tensors from or to a stage outside
    ``0 .. K-1`` (model inputs, placeholders: stage -1) and self-edges are ignored. Every stage
    appears as a key of both maps.
    """
    k = len(plan.stages)
    return dag_deps(k, ((t.from_stage, j) for t in plan.tensors for j in t.to_stages))


def chain_deps(k: int) -> Deps:
    """The dependencies of a simple chain ``0 -> 1 -> ... -> K-1``."""
    return dag_deps(k, ((s, s + 1) for s in range(k - 1)))


def dag_deps(k: int, edges: Iterable[tuple[int, int]]) -> Deps:
    """Dependencies of ``k`` stages from ``(producer, consumer)`` stage edges.

    Edges with an end outside ``0 .. k-1`` or from a stage to itself are ignored.

    Raises:
        ScheduleError: an edge goes backward (consumer < producer): pipelines need forward edges.
    """
    if k < 1:
        raise ScheduleError(f"a pipeline needs at least one stage, got {k}")
    producers: dict[int, set[int]] = {s: set() for s in range(k)}
    consumers: dict[int, set[int]] = {s: set() for s in range(k)}
    for src, dst in edges:
        if src < 0 or dst < 0 or src >= k or dst >= k or src == dst:
            continue
        if dst < src:
            raise ScheduleError(f"stage edge {src} -> {dst} goes backward: every edge must go to a later stage")
        producers[dst].add(src)
        consumers[src].add(dst)
    return producers, consumers

