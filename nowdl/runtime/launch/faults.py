"""Named kill points for fault-injection tests: inert unless ``NOWDL_FAULT`` names one.

[Note: kill points] The code calls :func:`point` at the places a cluster may kill a job (a step's
forward, backward and optimizer step; each phase of a checkpoint save; a resume's load; predict's
writes). ``NOWDL_FAULT`` holds comma-separated kills ``name:rank:attempt:hit``: the process of
global rank ``rank`` (``RANK``), in restart ``attempt`` of the job (``TORCHELASTIC_RESTART_COUNT``
plus ``SLURM_RESTART_COUNT``, 0 the first), SIGKILLs itself at its ``hit``-th pass (1-based) through
point ``name``, as the OOM killer or a lost node would end it: no handler, no flush. ``attempt`` and
``hit`` default to 0 and 1. Without the variable a point is one dictionary lookup.
The points, in the order a run meets them, are :data:`POINTS`; rank 0 publishes a save alone,
so the other ranks pass its four publishing points together while they wait for it.
tests/runtime/launch/test_kill_points.py kills rank 0 and rank 1 at every point.
"""

from __future__ import annotations

import os
import signal

__all__ = ["POINTS", "point", "parse"]

POINTS = (
    "train.forward",  # a step's forward has started on this rank
    "train.backward",  # its backward has started
    "train.optimizer",  # the optimizer step is about to change the weights
    "save.shards_half",  # this rank's shards are written, DCP's metadata not yet
    "save.metadata",  # every shard and DCP's .metadata are written; nowdl's record not yet
    "save.before_rename",  # the record is written; the folder is still .saving-step-N
    "save.after_rename",  # the folder is step-N; `latest` still names the previous step
    "save.before_latest",  # the new pointer is written to a temporary file, not yet renamed
    "save.after_latest",  # `latest` names the new step; older steps are not yet removed
    "load.read",  # a resume is reading the checkpoint's tensors
    "predict.write",  # predict has written part of its output
)

_hits: dict[str, int] = {}


def parse(spec: str) -> list[tuple[str, int, int, int]]:
    """``NOWDL_FAULT``'s kills as (point, rank, attempt, hit); an unknown point or a bad field raises ValueError."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        if parts[0] not in POINTS or not 2 <= len(parts) <= 4 or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"NOWDL_FAULT entry {item!r} is not name:rank[:attempt[:hit]] with a name of {POINTS}")
        nums = [int(p) for p in parts[1:]] + [0, 1][len(parts) - 2:]
        out.append((parts[0], nums[0], nums[1], nums[2]))
    return out


def _attempt() -> int:
    return sum(int(v) for v in (os.environ.get("TORCHELASTIC_RESTART_COUNT", ""), os.environ.get("SLURM_RESTART_COUNT", ""))
               if v.strip().isdigit())


def point(name: str) -> None:
    """Die here (SIGKILL) if ``NOWDL_FAULT`` asks for it ([Note: kill points])."""
    spec = os.environ.get("NOWDL_FAULT")
    if not spec:
        return
    _hits[name] = hit = _hits.get(name, 0) + 1
    rank = int(os.environ.get("RANK", "0") or 0)
    for p, r, attempt, h in parse(spec):
        if p == name and r == rank and attempt == _attempt() and h == hit:
            os.kill(os.getpid(), signal.SIGKILL)
