"""The zero-bubble (ZB-H1) action order and its step length, for the planner and the runtime.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): the input-gradient half of a
backward (``B``) is what the stage before waits for; the weight-gradient half (``W``) is
needed by nobody until the optimizer step. Sending B's result upstream at once and running the
W's in the gaps where 1F1B idles shrinks the bubble from ``(K-1)(F+B+W)`` to about
``(K-1)(F+B-W)``, i.e. about ``(K-1) F`` when B and W cost the same.

[Note: zero-bubble order] The per-stage orders come from a greedy list schedule of unit-time
actions over the chain ``0 -> 1 -> ... -> K-1`` (so they hold for any forward-edge DAG, see
[Note: long skips] in schedule/build.py). At every step each stage runs, by priority:

1. its next ``B`` (micro-batch order 0 .. m-1), once its forward ran and the next stage's
   ``B`` of that micro-batch ran at an earlier step;
2. its next ``F``, once the stage before ran it, if fewer than ``min(m, K - s)`` forwards await
   their ``B`` (1F1B's count, whose activations are whole) and fewer than ``min(m, K)``
   micro-batches are in flight on the stage (forward ran, ``W`` not yet): ZB-H1's memory rule;
   ``F`` goes before ``B`` while fewer than ``min(m, K - s)`` forwards await their ``B`` (1F1B's
   warm-up), which feeds the later stages sooner;
3. its next ``W`` (micro-batch order), once that micro-batch's ``B`` ran.

So stage s holds at most 1F1B's ``min(m, K - s)`` micro-batches' whole activations, and besides
them up to about ``s`` whose ``B`` ran and whose ``W`` waits (what a ``W`` needs: [Note:
deferred weight gradients] in runtime/pipeline/deferred_wgrad.py), as in torch.distributed.pipelining's
ZB1P (warm-up ``K - 1 - s`` forwards, ``W`` deferred by ``s``): :func:`zb_held`. The step
needs it: the last stage must run its ``m`` forwards and ``B``'s by step ``3m - 2`` for the
first stage to finish by ``3m + K - 1``, leaving its last ``min(m, K) - 1`` ``W``'s pending.

With F = B = W this reaches ZB-H1's step, ``3m + K - 1`` units against 1F1B's ``3(m + K - 1)``,
for every (K, m) tried (K = 2..8, m = K..2K; ``tests/schedule/test_zero_bubble.py``).

Both ``B`` and ``W`` keep micro-batch order, so the gradients accumulate in the order of a
single process. :func:`zb_slots` replays the orders with real proportions of F, B and W (the
runtime's blocking receives) and gives the step in units of one micro-batch's F+B+W, the
counterpart of GPipe's and 1F1B's ``m + K - 1``.
"""

from __future__ import annotations

from functools import lru_cache

from nowdl.errors import NowdlError
from nowdl.schedule.actions import Action, ScheduleError

__all__ = ["zb_orders", "zb_inflight_limit", "zb_slots", "zb_held", "zero_bubble_orders"]

Order = tuple[tuple[tuple[str, int, int], ...], ...]
"""Per stage: (kind, stage, micro-batch) in execution order."""


def zb_inflight_limit(k: int, m: int) -> int:
    """Most micro-batches in flight (forward ran, ``W`` not yet) on any stage: ``min(m, K)``."""
    return max(1, min(m, k))


@lru_cache(maxsize=64)
def zb_orders(k: int, m: int) -> Order:
    """Per stage, its actions in ZB-H1 order ([Note: zero-bubble order]).

    Raises:
        NowdlError: ``k`` or ``m`` not positive.
    """
    if k < 1 or m < 1:
        raise NowdlError(f"stages and micro-batches must be positive, got K={k}, m={m}")
    limit = zb_inflight_limit(k, m)
    nf, nb, nw = [0] * k, [0] * k, [0] * k
    f_at: dict[tuple[int, int], int] = {}
    b_at: dict[tuple[int, int], int] = {}
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(k)]
    t = 0
    while any(w < m for w in nw):
        for s in range(k):
            i = nb[s]
            can = {
                "B": i < nf[s] and f_at[(s, i)] < t and (s == k - 1 or b_at.get((s + 1, i), t) < t),
                "F": (nf[s] < m and nf[s] - nw[s] < limit and nf[s] - nb[s] < min(m, k - s)
                      and (s == 0 or f_at.get((s - 1, nf[s]), t) < t)),
                "W": nw[s] < nb[s] and b_at.get((s, nw[s]), t) < t,
            }
            warm = nf[s] - nb[s] < min(m, k - s)  # 1F1B's warm-up: forwards first
            kind = next((x for x in ("FBW" if warm else "BFW") if can[x]), None)
            if kind == "B":
                b_at[(s, i)] = t
                nb[s] += 1
            elif kind == "F":
                f_at[(s, nf[s])] = t
                i = nf[s]
                nf[s] += 1
            elif kind == "W":
                i = nw[s]
                nw[s] += 1
            if kind is not None:
                out[s].append((kind, s, i))
        t += 1
        if t > 4 * k * m + 4 * k:  # a chain always progresses; a guard, not a rule
            raise NowdlError(f"zero-bubble order for K={k}, m={m} made no progress by step {t}")
    return tuple(tuple(o) for o in out)


def zb_slots(k: int, m: int, fwd_frac: float) -> float:
    """Step of the ZB-H1 orders in units of one micro-batch's F+B+W on one stage.

    Every stage costs the same: F = ``fwd_frac``, B = W = half the rest; each action starts
    when its rank is free and what it needs has finished. 1F1B and GPipe give ``m + K - 1``.
    """
    f = min(max(fwd_frac, 0.0), 1.0)
    dur = {"F": f, "B": (1.0 - f) / 2, "W": (1.0 - f) / 2}
    orders = zb_orders(k, m)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * k
    pos = [0] * k
    while any(pos[s] < len(orders[s]) for s in range(k)):
        for s in range(k):
            while pos[s] < len(orders[s]):
                kind, _, i = orders[s][pos[s]]
                need = ([("F", s - 1, i)] if s > 0 else []) if kind == "F" else (
                    [("F", s, i)] + ([("B", s + 1, i)] if s < k - 1 else []) if kind == "B" else [("B", s, i)])
                if any(n not in done for n in need):
                    break
                free[s] = max([free[s]] + [done[n] for n in need]) + dur[kind]
                done[(kind, s, i)] = free[s]
                pos[s] += 1
    return max(free)


@lru_cache(maxsize=64)
def zb_held(k: int, m: int) -> tuple[tuple[int, int], ...]:
    """Per stage, what it holds at its memory peak under :func:`zb_orders`: (micro-batches with
    whole activations, forward ran and ``B`` not yet; micro-batches whose ``B`` ran and ``W`` waits).

    The peak is taken at the ``B`` with the most micro-batches in flight (then the most whole
    ones), counting the one it runs as whole: ``(min(m, K - s), s)`` in the steady state.

    >>> zb_held(4, 8)
    ((4, 0), (3, 1), (2, 2), (1, 3))
    """
    out = []
    for row in zb_orders(k, m):
        whole = waiting = 0
        best = (0, 0)
        for kind, _, _ in row:
            if kind == "F":
                whole += 1
            elif kind == "B":
                if (whole + waiting, whole) > (sum(best), best[0]):
                    best = (whole, waiting)
                whole, waiting = whole - 1, waiting + 1
            else:
                waiting -= 1
        out.append(best)
    return tuple(out)


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
