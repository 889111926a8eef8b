"""The zero-bubble schedule (ZB-H1) as :class:`Action` lists: backward split into ``B`` (input
gradients, sent upstream at once) and ``W`` (weight gradients, deferred into the bubbles).

The order itself is pure and shared with the planner's step prediction: see
[Note: zero-bubble order] in partitioner/zborder.py. The runtime side of the split is
[Note: deferred weight gradients] in runtime/zerobubble.py.
"""

from __future__ import annotations

from nowdl.errors import NowdlError
from nowdl.partitioner.zborder import zb_inflight_limit, zb_orders
from nowdl.runtime.schedule.deps import Action, ScheduleError

__all__ = ["zero_bubble_orders", "zb_inflight_limit"]


def zero_bubble_orders(k: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """Per stage (replica 0), its actions in ZB-H1 order.

    Raises:
        ScheduleError: ``k`` or ``m`` not positive.
    """
    try:
        orders = zb_orders(k, m)
    except NowdlError as e:
        raise ScheduleError(str(e)) from None
    return tuple(tuple(Action(kind, s, i) for kind, s, i in row) for row in orders)
