"""Per-stage action orders, and the long-skip gradients a stage holds at its peak because of them.

[Note: long-skip gradient waits] A stage sends the gradient of a received tensor back to its
producer at the end of its backward, and frees it once it knows the producer has posted the
matching receive (``runtime/pipeline/transfers.py``, ``release_done``). It learns that only from the
messages the producer sends it, and a producer posts a gradient's receive one action
(``RECV_LOOKAHEAD``) before its own backward of that micro-batch. From the stage just before,
that is in time. From a stage ``d >= 2`` back (a UNet's encoder-to-decoder skip), the only
messages are that skip's forward activations, and under 1F1B the one that shows the receive
posted arrives ``d - 1`` backwards later: the consumer holds ``d - 1`` such gradients at its
peak (MONAI UNet, K = 4, last stage: 2 of 128 KiB, 1.12x its prediction without them).

:func:`skip_waits` replays the orders with the runtime's release rule and counts, for every
pair (producer stage i, consumer stage j), the gradients of one tensor from i still held on j
during j's peak backward (the one with the most micro-batches in flight, as in
``zborder.zb_held``; among equals, the one holding the most). The cost model charges that
many copies of every tensor j receives from i (``StageSpec.skip_wait``). Counts are made
non-increasing in i (the nearer producer never waits longer) so the MILP can charge them with
one variable per threshold stage ([Note: ILP formulation]).
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache

from nowdl.errors import NowdlError
from nowdl.schedule.zero_bubble_order import zb_orders

__all__ = ["RECV_LOOKAHEAD", "stage_order", "pending_grads", "skip_waits"]

Order = tuple[tuple[str, int], ...]  # (kind, micro-batch) in execution order

RECV_LOOKAHEAD = 1
"""Receives are posted this many actions ahead of the action that needs them (the runtime's)."""


def stage_order(schedule: str, k: int, m: int, stage: int) -> Order:
    """One stage's actions: GPipe ``F0..F(m-1) B0..B(m-1)``; 1F1B ``min(m, K - s)`` warm-up
    forwards, then B and F alternately, then the remaining B's; ``"zb"`` the ZB-H1 order.

    Raises:
        NowdlError: unknown schedule, or K, m, stage out of range.
    """
    if k < 1 or m < 1 or not 0 <= stage < k:
        raise NowdlError(f"no stage {stage} of K={k} with m={m} micro-batches")
    if schedule == "zb":
        return tuple((kind, i) for kind, _, i in zb_orders(k, m)[stage])
    fwd = [("F", i) for i in range(m)]
    bwd = [("B", i) for i in range(m)]
    if schedule == "gpipe":
        return tuple(fwd + bwd)
    if schedule != "1f1b":
        raise NowdlError(f"unknown pipeline schedule {schedule!r}: use gpipe, 1f1b or zb")
    warm = min(m, k - stage)
    out = fwd[:warm]
    for i in range(m - warm):
        out += [bwd[i], fwd[warm + i]]
    return tuple(out + bwd[m - warm:])


def pending_grads(src: Order, dst: Order) -> list[tuple[int, int, int]]:
    """Replay ``dst``'s order with the runtime's release rule, for one tensor from ``src``'s
    stage: per ``B`` of ``dst``, (micro-batches in flight, whole ones, gradients of that
    tensor still held during it).

    In flight: forwarded and not yet ``W``'d (zero bubble) or ``B``'d; whole: not yet ``B``'d.
    """
    b_at = {i: a for a, (kind, i) in enumerate(src) if kind == "B"}
    f_at = {i: a for a, (kind, i) in enumerate(src) if kind == "F"}
    done = -1  # the latest src action dst knows ran (from the forward messages it took)
    pending: deque[int] = deque()  # src action index that consumes each held gradient, ascending
    whole = deferred = 0
    has_w = any(kind == "W" for kind, _ in dst)
    out = []
    for kind, i in dst:
        if kind == "F":
            done = max(done, f_at[i])  # this micro-batch's skip arrived: src ran F(i)
            whole += 1
        while pending and pending[0] <= done + RECV_LOOKAHEAD:  # src's B's run in order: a prefix is released
            pending.popleft()
        if kind == "B":
            out.append((whole + deferred, whole, len(pending)))
            pending.append(b_at[i])
            whole -= 1
            deferred += has_w
        elif kind == "W":
            deferred -= 1
    return out


@lru_cache(maxsize=256)
def skip_waits(schedule: str, k: int, m: int) -> tuple[tuple[float, ...], ...]:
    """Per consumer stage j, per producer stage i < j: gradients of one received tensor from i
    held on j at its peak ([Note: long-skip gradient waits]), non-increasing in i.

    >>> skip_waits("1f1b", 4, 8)[3]  # last stage: from stage 0, two wait; from 1, one
    (2.0, 1.0, 0.0)
    >>> skip_waits("gpipe", 4, 8)[3]  # GPipe's peak is its first backward: nothing sent yet
    (0.0, 0.0, 0.0)
    """
    orders = [stage_order(schedule, k, m, s) for s in range(k)]
    # stages whose orders are equal wait alike (under 1F1B every stage with K - s >= m warms up
    # the same m forwards): one replay per pair of distinct orders, not per pair of stages
    ids: dict[Order, int] = {}
    key = [ids.setdefault(o, len(ids)) for o in orders]
    peak: dict[tuple[int, int], float] = {}

    def held(i: int, j: int) -> float:
        pair = (key[i], key[j])
        if pair not in peak:
            # the peak backward: the most micro-batches in flight, then the most whole, then held
            peak[pair] = float(max(pending_grads(orders[i], orders[j]), default=(0, 0, 0))[2])
        return peak[pair]

    out = []
    for j in range(k):
        row = [held(i, j) for i in range(j)]
        for i in range(j - 2, -1, -1):  # a farther producer waits at least as long
            row[i] = max(row[i], row[i + 1])
        out.append(tuple(row))
    return tuple(out)
