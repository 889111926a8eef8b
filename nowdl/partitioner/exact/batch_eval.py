"""``evaluate()`` for many assignments at once, as numpy matrices (one row per assignment).

The refinement of [Note: window refinement] scores thousands of splits that differ in one cut,
long-skip gradient waits included ([Note: long-skip gradient waits]): a stage's waits depend on
which earlier stage produced each tensor it receives, so they are not a function of the stage's
two ideals and the DP over ideals leaves them out. Per stage ``t`` (with ``S[i, v]``, node v's
stage in assignment i): a tensor ``u`` reaches ``t`` when some consumer of u is in ``t`` and u is
in an earlier stage (an OR over u's out-edges, ``np.logical_or.reduceat`` over the edges sorted by
producer); it is sent once when any consumer is in a later stage than u. The sums, the largest
workspace, the received, sent and waiting bytes then follow ``evaluate``'s formula term by term.
"""

from __future__ import annotations

import numpy as np

from nowdl.partitioner.costs.problem import Problem

__all__ = ["evaluate_many"]


def evaluate_many(problem: Problem, stage_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Memory and time of every stage for each row of ``stage_of`` (an (I, n) integer array of
    convex assignments): two (I, K) arrays equal to ``evaluate``'s, to float rounding."""
    k = problem.k
    s = np.asarray(stage_of, dtype=np.int64)
    rows = s.shape[0]
    edges = np.array(sorted(set(problem.edges)), dtype=np.int64).reshape(-1, 2)
    static = np.asarray(problem.static, dtype=np.float64)
    mem = np.zeros((rows, k))
    tim = np.zeros((rows, k))
    if edges.size:
        eu, ev = edges[:, 0], edges[:, 1]
        starts = np.flatnonzero(np.r_[True, eu[1:] != eu[:-1]])
        prod = eu[starts]  # each producer once, in edge order
        src = s[:, prod]  # (I, U): the producer's stage
        later = np.logical_or.reduceat(s[:, ev] > s[:, eu], starts, axis=1)  # sent at all
    for t, spec in enumerate(problem.stages):
        vec = problem.variants[spec.variant]
        here = s == t
        hf = here.astype(np.float64)
        act, time_ = hf @ np.asarray(vec.act, dtype=np.float64), hf @ np.asarray(vec.time, dtype=np.float64)
        ws = np.where(here, np.asarray(vec.workspace, dtype=np.float64)[None, :], 0.0).max(axis=1)
        recv = sent = wait = np.zeros(rows)
        if edges.size:
            out = np.asarray(vec.out, dtype=np.float64)[prod]
            reach = np.logical_or.reduceat(here[:, ev], starts, axis=1) & (src < t)
            recv = reach @ out
            waits = np.array([spec.wait_from(i) for i in range(k)], dtype=np.float64)[src]
            wait = (reach * waits) @ out
            sent = (later & (src == t)) @ out
        mem[:, t] = (hf @ static + spec.inflight * act + spec.recv_factor * recv + spec.send_factor * sent
                     + ws + wait)
        tim[:, t] = time_ + spec.link_s_per_byte * (recv + sent)
    return mem, tim
