"""Shrink a partitioning Problem by merging nodes (exactly where provable, greedily on request).

[Note: exact merges] Under the min-max cost model a cut inside a chain of costly nodes is
often what balances the stages (two big convolutions on two GPUs), so "u has one consumer
v and v one producer u" alone does NOT make merging u and v safe, whatever the tensor
sizes. A merge is exact when moving the node M ("mover") to the stage of its anchor A
never raises any stage's memory or time, for every assignment; then some optimum has M
with A. With c(M) = 0 (no static, act, time or workspace bytes in every variant) and M
allowed wherever A is (tileable if A is; unpinned, or pinned with A) these are exact:

1. M has the single producer A, A's only consumer is M, out[M] <= out[A] in every
   variant: A's stage sends M's tensor instead of A's, M's old stage no longer receives
   A's tensor (and receives M's own at most), everyone else receives the same.
2. M has no consumer and the single producer A: M's old stage may stop receiving A.
3. M has no producer and the single consumer A: M's stage stops sending, A's receiving.
4. M's only consumer is A, M has the single producer P whose only consumer is M, and
   out[P] <= out[M] in every variant: P's tensor crosses where M's used to.

With long-skip gradient waits ([Note: long-skip gradient waits] in skipwait.py) a tensor also
costs by how many stages it skips, and rules 1 and 4 make a tensor start earlier (M's consumers
receive from A's stage; A receives from P's): they then also need every node but M to be an
ancestor of the new producer or a descendant of the consumer, so no stage can lie between.

[Note: floating nodes] A node that depends on no input (a random mask drawn in ``forward``,
as EfficientNet's stochastic depth does, or a constant computed there) is placed with its
single consumer, repeatedly, so a chain ``rand -> add -> floor -> mul(x, .)`` ends up with the
``mul``. This is a placement rule rather than an exact merge: such nodes cost microseconds, and
left free each one multiplies the number of convex splits (and of the DAG's ideals) by the
length of its chain, which is what kept graphs like EfficientNet from the exact ideal DP.
The inputs are the pinned sources (``build_problem`` pins every placeholder to stage 0); a
problem with no pinned source has no floating nodes. In a problem with spatial stages a node that cannot
run on tiles does not join one that can (the group would lose its tileability).

Only the output of a group's "exit" node ever leaves the group (every rule keeps it so),
so a group has the costs sum(static, act, time), max(workspace), out[exit], and the
coarse problem's evaluate() equals the original's for the expanded assignment.

With ``max_nodes`` the graph is then shrunk greedily (not exact) by merging a node into
its single consumer group, lightest pairs first, which hides that cut point; plans built
on such a graph are marked "coarse-optimal" by ``expand(..., exact=False)``.
"""

from __future__ import annotations

import heapq
import logging

from nowdl.partitioner.costs.problem import NodeVectors, Problem
from nowdl.partitioner.costs.skip_waits import has_waits
from nowdl.partitioner.costs.structure import check_problem, topological_order
from nowdl.partitioner.exact.coarse_groups import compose_groups, expand

__all__ = ["coarsen", "expand", "compose_groups", "merge_start"]

log = logging.getLogger(__name__)


class _Groups:
    """Mutable coarse graph: groups of original nodes with their summed costs."""

    def __init__(self, problem: Problem) -> None:
        n = problem.n
        self.p = problem
        self.alive = [True] * n
        self.members: list[list[int]] = [[v] for v in range(n)]
        self.exit = list(range(n))
        self.static = [float(x) for x in problem.static]
        keys = sorted(problem.variants)
        self.keys = keys
        self.act = {k: [float(x) for x in problem.variants[k].act] for k in keys}
        self.time = {k: [float(x) for x in problem.variants[k].time] for k in keys}
        self.ws = {k: [float(x) for x in problem.variants[k].workspace] for k in keys}
        self.tile = [bool(t) for t in problem.tileable] if problem.tileable else [True] * n
        self.pin: list[int | None] = [problem.pinned.get(v) for v in range(n)]
        self.preds: list[set[int]] = [set() for _ in range(n)]
        self.succs: list[set[int]] = [set() for _ in range(n)]
        for u, v in problem.edges:
            self.succs[u].add(v)
            self.preds[v].add(u)
        self.version = [0] * n
        # long-skip waits ([Note: long-skip gradient waits]) charge a tensor by how far it
        # travels: a merge may not let any tensor skip more stages (see between_free)
        self.waits = has_waits(problem)
        if self.waits:
            order = topological_order(problem)
            self.bits = [1 << v for v in range(n)]
            self.anc = list(self.bits)
            self.desc = list(self.bits)
            for v in order:
                for u in self.preds[v]:
                    self.anc[v] |= self.anc[u]
            for v in reversed(order):
                for w in self.succs[v]:
                    self.desc[v] |= self.desc[w]
            self.full = (1 << n) - 1

    def out(self, g: int, key: str) -> float:
        return float(self.p.variants[key].out[self.exit[g]])

    def zero(self, g: int, tol: float) -> bool:
        if self.static[g] > tol:
            return False
        return all(
            self.act[k][g] <= tol and self.time[k][g] <= tol and self.ws[k][g] <= tol
            for k in self.keys
        )

    def out_le(self, a: int, b: int) -> bool:
        return all(self.out(a, k) <= self.out(b, k) for k in self.keys)

    def may_move(self, mover: int, anchor: int) -> bool:
        """The mover is allowed wherever the anchor is."""
        if self.tile[anchor] and not self.tile[mover]:
            return False
        return self.pin[mover] is None or self.pin[mover] == self.pin[anchor]

    def compatible(self, a: int, b: int) -> bool:
        """Same tileability and no conflicting pins (for heuristic merges)."""
        if self.tile[a] != self.tile[b]:
            return False
        return self.pin[a] is None or self.pin[b] is None or self.pin[a] == self.pin[b]

    def between_free(self, lo: int, hi: int, mover: int) -> bool:
        """No group but ``mover`` can sit in a stage strictly between ``lo``'s and ``hi``'s
        (every other node is an ancestor of ``lo`` or a descendant of ``hi``), so a tensor from
        ``lo``'s stage to ``hi``'s skips no stage once the mover has moved. Always true
        without long-skip waits."""
        if not self.waits:
            return True
        return self.full & ~self.anc[lo] & ~self.desc[hi] & ~self.bits[mover] == 0

    def merge(self, keep: int, gone: int, new_exit: int) -> None:
        """Merge group ``gone`` into ``keep``; ``new_exit`` is the merged group's exit."""
        if self.waits:
            self.anc[keep] |= self.anc[gone]
            self.desc[keep] |= self.desc[gone]
            self.bits[keep] |= self.bits[gone]
        self.members[keep] += self.members[gone]
        self.members[gone] = []
        self.exit[keep] = new_exit
        self.static[keep] += self.static[gone]
        for k in self.keys:
            self.act[k][keep] += self.act[k][gone]
            self.time[k][keep] += self.time[k][gone]
            self.ws[k][keep] = max(self.ws[k][keep], self.ws[k][gone])
        self.tile[keep] = self.tile[keep] and self.tile[gone]
        if self.pin[keep] is None:
            self.pin[keep] = self.pin[gone]
        for q in self.preds[gone]:
            self.succs[q].discard(gone)
            if q != keep:
                self.succs[q].add(keep)
                self.preds[keep].add(q)
        for q in self.succs[gone]:
            self.preds[q].discard(gone)
            if q != keep:
                self.preds[q].add(keep)
                self.succs[keep].add(q)
        self.preds[keep].discard(keep)
        self.succs[keep].discard(keep)
        self.preds[gone] = set()
        self.succs[gone] = set()
        self.alive[gone] = False
        self.version[keep] += 1
        self.version[gone] += 1

    def exact_pass(self, tol: float) -> int:
        """Apply the exact rules of [Note: exact merges] until none applies."""
        merged = 0
        changed = True
        while changed:
            changed = False
            for m in range(len(self.alive)):
                if not self.alive[m] or not self.zero(m, tol):
                    continue
                preds, succs = self.preds[m], self.succs[m]
                if len(preds) == 1:
                    a = next(iter(preds))
                    rule1 = (self.succs[a] == {m} and self.out_le(m, a)
                             and all(self.between_free(a, w, m) for w in succs))
                    if (rule1 or not succs) and self.may_move(m, a):
                        self.merge(a, m, self.exit[m] if rule1 else self.exit[a])
                        merged += 1
                        changed = True
                        continue
                if len(succs) == 1:
                    a = next(iter(succs))
                    if not preds:
                        ok = True
                    elif len(preds) == 1:
                        q = next(iter(preds))
                        ok = self.succs[q] == {m} and self.out_le(q, m) and self.between_free(q, a, m)
                    else:
                        ok = False
                    if ok and self.may_move(m, a):
                        self.merge(a, m, self.exit[a])
                        merged += 1
                        changed = True
        return merged

    def floating_pass(self) -> int:
        """Place input-independent nodes with their single consumer ([Note: floating nodes])."""
        merged = 0
        spatial = any(st.spatial for st in self.p.stages)
        todo = [m for m in range(len(self.alive)) if self.alive[m] and not self.preds[m]]
        if not any(self.pin[m] is not None for m in todo):
            return 0  # the inputs are not known (not pinned): no source can be told apart from them
        while todo:
            m = todo.pop()
            if not self.alive[m] or self.preds[m] or len(self.succs[m]) != 1 or self.pin[m] is not None:
                continue
            a = next(iter(self.succs[m]))
            if spatial and not self.may_move(m, a):
                continue
            self.merge(a, m, self.exit[a])
            merged += 1
            if not self.preds[a]:
                todo.append(a)
        return merged

    def load(self, g: int) -> tuple[float, float]:
        """(memory, time) of a group, averaged over variants (for the greedy order)."""
        mem = self.static[g] + sum(self.act[k][g] for k in self.keys) / len(self.keys)
        tim = sum(self.time[k][g] for k in self.keys) / len(self.keys)
        return mem, tim

    def greedy_pass(self, max_nodes: int, warn: bool = True) -> int:
        """Merge a group into its single consumer group, lightest pairs first."""
        n = len(self.alive)
        count = sum(self.alive)
        live = [g for g in range(n) if self.alive[g]]
        tot_mem = max(sum(self.load(g)[0] for g in live), 1e-300)
        tot_time = max(sum(self.load(g)[1] for g in live), 1e-300)
        limit = 1.0 / (2 * self.p.k)  # never build a group heavier than half a stage
        key0 = self.keys[0]
        heap: list[tuple[float, float, int, int, int, int]] = []

        def pair_weight(u: int, g: int) -> float:
            (mu, tu), (mg, tg) = self.load(u), self.load(g)
            return max((mu + mg) / tot_mem, (tu + tg) / tot_time)

        def push(u: int) -> None:
            if not self.alive[u] or len(self.succs[u]) != 1:
                return
            g = next(iter(self.succs[u]))
            if not self.compatible(u, g):
                return
            w = pair_weight(u, g)
            if w > limit:
                return
            heapq.heappush(heap, (w, -self.out(u, key0), u, g, self.version[u], self.version[g]))

        for u in range(n):
            push(u)
        merged = 0
        while count > max_nodes and heap:
            _, _, u, g, vu, vg = heapq.heappop(heap)
            if vu != self.version[u] or vg != self.version[g] or not self.alive[u]:
                continue
            self.merge(g, u, self.exit[g])
            merged += 1
            count -= 1
            push(g)
            for q in sorted(self.preds[g]):
                push(q)
        if count > max_nodes and warn:
            log.warning(
                "coarsen: stopped at %d groups (asked for %d): no light single-consumer link left",
                count, max_nodes,
            )
        return merged

    def build(self) -> tuple[Problem, list[list[int]]]:
        p = self.p
        gids = sorted((g for g in range(len(self.alive)) if self.alive[g]),
                      key=lambda g: min(self.members[g]))
        index = {g: i for i, g in enumerate(gids)}
        groups = [sorted(self.members[g]) for g in gids]
        where = [0] * p.n
        for i, grp in enumerate(groups):
            for v in grp:
                where[v] = i
        edges: set[tuple[int, int]] = set()
        for u, v in p.edges:
            a, b = where[u], where[v]
            if a != b:
                if u != self.exit[gids[a]]:  # pragma: no cover - the rules keep one exit
                    raise RuntimeError(f"coarsen: {p.names[u]} leaves its group but is not its exit")
                edges.add((a, b))
        names: list[str] = []
        taken = set(p.names)
        for g, grp in zip(gids, groups, strict=True):
            if len(grp) == 1:
                names.append(p.names[grp[0]])
                continue
            name = f"{p.names[grp[0]]}..{p.names[self.exit[g]]}"
            while name in taken:
                name += "#"
            taken.add(name)
            names.append(name)
        variants = {
            k: NodeVectors(
                act=[self.act[k][g] for g in gids],
                time=[self.time[k][g] for g in gids],
                workspace=[self.ws[k][g] for g in gids],
                out=[self.out(g, k) for g in gids],
            )
            for k in self.keys
        }
        pinned = {index[g]: s for g in gids if (s := self.pin[g]) is not None}
        tied = [sorted({where[v] for v in grp}) for grp in p.tied]
        coarse = Problem(
            names=names,
            edges=sorted(edges),
            static=[self.static[g] for g in gids],
            variants=variants,
            stages=p.stages,
            tileable=[self.tile[g] for g in gids] if p.tileable else (),
            ranks=p.ranks,
            objective=p.objective,
            mem_cap=p.mem_cap,
            pinned=pinned,
            tied=[t for t in tied if len(t) > 1],
        )
        return coarse, groups


def merge_start(problem: Problem) -> tuple[_Groups, list[tuple[float, float]], float, float]:
    """Fresh groups of ``problem`` for a merging pass (tileability ignored where no stage is spatial:
    it only matters there), each node's (memory, time) load, and the loads' totals."""
    g = _Groups(problem)
    if not any(st.spatial for st in problem.stages):
        g.tile = [True] * problem.n
    loads = [g.load(v) for v in range(problem.n)]
    return g, loads, max(sum(m for m, _ in loads), 1e-300), max(sum(t for _, t in loads), 1e-300)


def coarsen(
    problem: Problem, *, max_nodes: int | None = None, zero_tol: float = 0.0, warn: bool = True
) -> tuple[Problem, list[list[int]]]:
    """Merge nodes where no optimum needs them apart, then optionally down to ``max_nodes``.

    Example:
        >>> small, groups = coarsen(problem)
        >>> part = expand(solve_ilp(small), groups, problem)

    Args:
        problem: the problem.
        max_nodes: if given, keep merging greedily (not exact, see [Note: exact merges])
            until at most this many groups remain or no light link is left.
        zero_tol: costs at or below this count as zero for the exact rules (0: exact).
        warn: log a warning when the greedy merges stop above ``max_nodes``.

    Returns:
        (coarse problem, groups): ``groups[i]`` lists the original node indices of coarse
        node i, sorted; groups are ordered by their smallest member.

    Raises:
        ValueError: if the problem is malformed or ``max_nodes`` < 1.
    """
    check_problem(problem)
    if max_nodes is not None and max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1 (got {max_nodes})")
    if zero_tol < 0:
        raise ValueError(f"zero_tol must be >= 0 (got {zero_tol})")
    g = _Groups(problem)
    floating = g.floating_pass()
    exact = g.exact_pass(zero_tol)
    greedy = 0
    if max_nodes is not None and sum(g.alive) > max_nodes:
        greedy = g.greedy_pass(max_nodes, warn)
        exact += g.exact_pass(zero_tol)
    coarse, groups = g.build()
    log.debug(  # solve() logs the merge at INFO; the coarse DP's binary search calls this ~10 times
        "coarsen: %d -> %d nodes (%d floating, %d exact merges, %d greedy)",
        problem.n, coarse.n, floating, exact, greedy,
    )
    return coarse, groups
