"""The zero-bubble schedule (ZB-H1): backward split into B (input gradients) and W (weight gradients).

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): the input-gradient half of a
backward (``B``) is what the stage before waits for; the weight-gradient half (``W``) is
needed by nobody until the optimizer step. Sending B's result upstream at once and running the
W's in the gaps where 1F1B idles shrinks the bubble from ``(K-1)(F+B+W)`` to about
``(K-1)(F+B-W)``, i.e. about ``(K-1) F`` when B and W cost the same.

[Note: zero-bubble order] The per-stage orders come from a greedy list schedule of unit-time
actions over the chain ``0 -> 1 -> ... -> K-1`` (so they hold for any forward-edge DAG, see
[Note: long skips] in build.py). At every step each stage runs, by priority:

1. its next ``B`` (micro-batch order 0 .. m-1), once its forward ran and every later stage's
   ``B`` of that micro-batch ran at an earlier step;
2. its next ``F``, once the stage before ran it, if fewer than ``min(m, K)`` micro-batches are
   in flight on the stage (forward ran, ``W`` not yet): ZB-H1's memory rule, which keeps every
   stage at or below the peak of 1F1B's first stage (later stages hold more than under 1F1B);
3. its next ``W`` (micro-batch order), once that micro-batch's ``B`` ran.

Both ``B`` and ``W`` keep micro-batch order, so the gradients accumulate in the order of a
single process (see [Note: backward order] in build.py).
"""

from __future__ import annotations

from functools import lru_cache

from nowdl.runtime.schedule.deps import Action, ScheduleError

__all__ = ["zero_bubble_orders", "zb_inflight_limit"]


def zb_inflight_limit(k: int, m: int) -> int:
    """Most micro-batches in flight (forward ran, ``W`` not yet) on any stage: ``min(m, K)``."""
    return max(1, min(m, k))


@lru_cache(maxsize=64)
def zero_bubble_orders(k: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """Per stage (replica 0), its actions in ZB-H1 order ([Note: zero-bubble order]).

    Raises:
        ScheduleError: ``k`` or ``m`` not positive.
    """
    if k < 1 or m < 1:
        raise ScheduleError(f"stages and micro-batches must be positive, got K={k}, m={m}")
    limit = zb_inflight_limit(k, m)
    nf = [0] * k
    nb = [0] * k
    nw = [0] * k
    f_at: dict[tuple[int, int], int] = {}
    b_at: dict[tuple[int, int], int] = {}
    out: list[list[Action]] = [[] for _ in range(k)]
    t = 0
    while any(w < m for w in nw):
        ran = False
        for s in range(k):
            i = nb[s]
            if (i < nf[s] and f_at[(s, i)] < t
                    and (s == k - 1 or b_at.get((s + 1, i), t) < t)):
                out[s].append(Action("B", s, i))
                b_at[(s, i)] = t
                nb[s] += 1
            elif (nf[s] < m and nf[s] - nw[s] < limit
                  and (s == 0 or f_at.get((s - 1, nf[s]), t) < t)):
                out[s].append(Action("F", s, nf[s]))
                f_at[(s, nf[s])] = t
                nf[s] += 1
            elif nw[s] < nb[s] and b_at[(s, nw[s])] < t:
                out[s].append(Action("W", s, nw[s]))
                nw[s] += 1
            else:
                continue
            ran = True
        if not ran and t > 3 * k * m + k:  # cannot happen on a chain; a guard, not a rule
            raise ScheduleError(f"zero-bubble order for K={k}, m={m} made no progress at step {t}")
        t += 1
    return tuple(tuple(o) for o in out)
