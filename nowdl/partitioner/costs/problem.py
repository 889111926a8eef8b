"""The partitioning problem as plain numbers, and its solution (no torch needed).

[Note: cost model] A stage's memory for one rank is
    sum(static) + inflight * sum(act) + recv_factor * received bytes + send_factor * sent bytes
    + max(workspace) + sum over received tensors of skip_wait[producer's stage] * bytes
(received: the activations that arrive; sent: the buffers that receive the gradients of the
tensors it sends, once per tensor however many stages use it; both factors default to inflight,
the runtime's own counts come from :func:`nowdl.partitioner.costs.held_tensors.held_buffers`)
and its time for one micro-batch is
    sum(time) + link_s_per_byte * (received bytes + sent bytes).
A stage with ``parts`` > 1 is a spatial stage: the caller hands it per-node vectors that are
already divided by ``parts`` (plus halo), and only ``tileable`` nodes may sit in it.
A rank's load is the sum of the loads of the stages it holds (MASTER: stage r and K-1-r).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["NodeVectors", "StageSpec", "Problem", "Partition", "boundary_bytes", "evaluate"]


@dataclass(frozen=True)
class NodeVectors:
    """Per-node cost vectors for one kind of stage (plain or spatial with some P)."""

    act: Sequence[float]  # saved activation bytes per micro-batch
    time: Sequence[float]  # fwd + bwd seconds per micro-batch
    workspace: Sequence[float]  # transient bytes (a stage pays its largest)
    out: Sequence[float]  # bytes of the node's output when it crosses a stage boundary
    fwd: Sequence[float] | None = None  # forward seconds (halo wait included); None: time x fwd_s share


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: which cost vectors apply and how many micro-batches it holds."""

    inflight: int = 1  # micro-batches whose activations this stage holds at once
    variant: str = "plain"  # key into Problem.variants
    spatial: bool = False  # only tileable nodes may be placed here
    link_s_per_byte: float = 0.0  # seconds per byte sent or received (fwd + bwd together)
    recv_held: float | None = None  # received bytes held at the peak, per micro-batch (None: inflight)
    send_held: float | None = None  # gradient buffers of sent tensors held at the peak (None: inflight)
    # per earlier stage i: copies of each tensor received from i whose gradient waits here at
    # the peak ([Note: long-skip gradient waits] in skipwait.py); () or missing entries: none
    skip_wait: tuple[float, ...] = ()

    def wait_from(self, i: int) -> float:
        """Gradients of one tensor received from stage ``i`` held at this stage's peak."""
        return self.skip_wait[i] if 0 <= i < len(self.skip_wait) else 0.0

    @property
    def recv_factor(self) -> float:
        return float(self.inflight if self.recv_held is None else self.recv_held)

    @property
    def send_factor(self) -> float:
        return float(self.inflight if self.send_held is None else self.send_held)


@dataclass(frozen=True)
class Problem:
    """Assign each node of a DAG to one of K stages, every edge going forward.

    ``ranks[r]`` lists the stages whose loads add up on rank r (default: rank s holds stage s);
    a stage listed twice counts twice (MASTER with odd K: the middle rank holds both copies).
    ``tileable`` empty means every node may sit in a spatial stage.
    ``objective`` is "memory" (minimise the largest rank memory) or "compute" (the slowest
    rank's time); the other quantity breaks ties. ``mem_cap`` bounds every rank's memory.
    ``pinned`` fixes nodes to stages (placeholders at 0, the output at K-1, say).
    ``tied`` lists groups of nodes that must share a stage (uses of one shared weight: the
    runtime cannot yet sum a weight's gradients across stages).
    """

    names: Sequence[str]
    edges: Sequence[tuple[int, int]]  # (producer, consumer) indices
    static: Sequence[float]  # params + buffers + grads + optimizer bytes
    variants: dict[str, NodeVectors]
    stages: Sequence[StageSpec]
    tileable: Sequence[bool] = ()
    ranks: Sequence[Sequence[int]] = ()
    objective: str = "memory"
    mem_cap: float | None = None
    pinned: dict[int, int] = field(default_factory=dict)
    tied: Sequence[Sequence[int]] = ()

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def k(self) -> int:
        return len(self.stages)

    def rank_stages(self) -> list[list[int]]:
        return [list(r) for r in self.ranks] if self.ranks else [[s] for s in range(self.k)]


@dataclass(frozen=True)
class Partition:
    """A solution: the stage of every node, and the loads it gives."""

    stage_of: list[int]
    stage_mem: list[float]
    stage_time: list[float]
    rank_mem: list[float]
    rank_time: list[float]
    solver: str = ""  # "highs", "cbc", "dp", "brute"
    status: str = ""  # "optimal", "feasible" (time limit hit), ...
    gap: float = 0.0  # relative optimality gap of the primary objective
    seconds: float = 0.0

    @property
    def bottleneck_mem(self) -> float:
        return max(self.rank_mem)

    @property
    def bottleneck_time(self) -> float:
        return max(self.rank_time)


def boundary_bytes(problem: Problem, stage_of: Sequence[int]) -> tuple[list[float], list[float], list[float]]:
    """Per stage, for an assignment: bytes received (per micro-batch), sent (once per tensor
    however many stages use it) and long-skip gradients waiting at the peak (all copies).

    Raises:
        ValueError: an edge goes from a later stage to an earlier one.
    """
    k = problem.k
    recv, send, wait = [0.0] * k, [0.0] * k, [0.0] * k
    consumers: dict[int, set[int]] = {}
    for u, v in problem.edges:
        if stage_of[v] < stage_of[u]:
            raise ValueError(f"edge {problem.names[u]} -> {problem.names[v]} goes backward")
        if stage_of[v] > stage_of[u]:
            consumers.setdefault(u, set()).add(stage_of[v])
    for u, dst in consumers.items():
        src = stage_of[u]
        for j in dst:
            out = problem.variants[problem.stages[j].variant].out[u]
            recv[j] += out
            wait[j] += problem.stages[j].wait_from(src) * out
        send[src] += problem.variants[problem.stages[src].variant].out[u]
    return recv, send, wait


def evaluate(problem: Problem, stage_of: Sequence[int]) -> tuple[list[float], list[float]]:
    """Memory and time of every stage for an assignment, by the cost model above.

    This is the reference the ILP is tested against: the solver's objective must equal it.
    """
    k, n = problem.k, problem.n
    mem_static = [0.0] * k
    act = [0.0] * k
    time = [0.0] * k
    ws = [0.0] * k
    for v in range(n):
        s = stage_of[v]
        vec = problem.variants[problem.stages[s].variant]
        mem_static[s] += problem.static[v]
        act[s] += vec.act[v]
        time[s] += vec.time[v]
        ws[s] = max(ws[s], vec.workspace[v])
    recv_bytes, send_bytes, wait_bytes = boundary_bytes(problem, stage_of)
    mem = []
    tim = []
    for s, spec in enumerate(problem.stages):
        mem.append(mem_static[s] + spec.inflight * act[s] + spec.recv_factor * recv_bytes[s]
                   + spec.send_factor * send_bytes[s] + ws[s] + wait_bytes[s])
        tim.append(time[s] + spec.link_s_per_byte * (recv_bytes[s] + send_bytes[s]))
    return mem, tim
