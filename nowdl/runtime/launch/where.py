"""Where this rank is in the job: the step and the schedule action it runs, for failure messages.

The trainer sets the step (1-based, the one in flight) and the pipeline engine the action
before running it; :func:`here` gives ``"step 6, action 1F0 (forward of stage 1, micro-batch
0)"`` for the messages that name a lost peer. One process runs one step at a time, so a
module-level record is enough (the watcher threads only read it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["set_step", "set_action", "here", "current_step"]

_NOW: dict[str, Any] = {"step": None, "action": None}
_KINDS = {"F": "forward", "B": "backward", "W": "weight gradients"}


def set_step(step: int | None) -> None:
    """This rank now runs ``step`` (1-based; None: between steps)."""
    _NOW["step"] = step
    _NOW["action"] = None


def set_action(action: Any) -> None:
    """This rank now runs ``action`` (a schedule :class:`~nowdl.schedule.actions.Action`; None: none)."""
    _NOW["action"] = action


def current_step() -> int | None:
    """The step in flight (None: none recorded)."""
    step = _NOW["step"]
    return None if step is None else int(step)


def here() -> str:
    """``"step S, action A (...)"``, or what of it is known (``""``: nothing)."""
    parts = []
    if _NOW["step"] is not None:
        parts.append(f"step {_NOW['step']}")
    act = _NOW["action"]
    if act is not None:
        kind = _KINDS.get(getattr(act, "kind", ""), "")
        what = (f" ({kind} of stage {act.stage}, micro-batch {act.microbatch}"
                + (f", replica {act.replica}" if getattr(act, "replica", 0) else "") + ")") if kind else ""
        parts.append(f"action {act}{what}")
    return ", ".join(parts)
