"""What each stage's predicted peak memory is made of, term by term of the cost model.

[Note: memory breakdown] :func:`nowdl.partitioner.costs.problem.evaluate` charges a stage
``static + inflight x saved + recv_held x received + send_held x sent + workspace + waiting``
(the two factors: what the runtime holds, [Note: held buffers] in partitioner/costs/held_tensors.py; waiting:
long-skip gradients, [Note: long-skip gradient waits] in schedule/orders.py). :func:`stage_memory`
returns the same terms separately so a plan can record them (``stages[i].predicted``, docs/plan-format.md)
and ``nowdl show --plot`` can stack them; their sum, less ``freed_bytes``, is the stage's ``peak_bytes``.

[Note: freed by the peak] The solvers charge every in-flight micro-batch's whole activations
plus the stage's largest transient: an upper bound, since the backward of node ``v`` of the
oldest micro-batch runs after the nodes behind ``v`` have freed what they saved, and a forward's
node ``v`` runs before the nodes behind it have saved anything. A stage's peak is at most
``(inflight - 1) x saved + max over v (saved up to v + workspace of v)`` (nodes in graph order,
the order the stage runs them; a zero-bubble stage's deferred ``W`` share is not freed by a ``B``
and is left whole). Besides, a stage keeps of its outputs only their autograd edges ([Note:
backward roots] in runtime/pipeline/output_roots.py): an output that only later stages read, and that they save
(not its own node), is charged to its producer by the profile's attribution, but the producer
frees it once sent. The plan reports the tighter figure: ``freed_bytes`` is ``inflight x`` those
outputs plus ``saved + workspace - max over v (...)`` with them left out, never negative.
Measured on the runtime benchmark (72 rows) the two took the over-predictions at 0.86-0.90 of
the plan to 0.91 and the under-predictions at 1.10 to 1.06 and below; the memory cap is still
checked against the solvers' bound, so a plan never exceeds it by this term.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nowdl.partitioner.config.candidate import Candidate
from nowdl.partitioner.costs.costmodel import Costs, build_problem
from nowdl.partitioner.costs.problem import boundary_bytes

__all__ = ["MEMORY_KEYS", "stage_memory"]

MEMORY_KEYS = ("weight_bytes", "grad_bytes", "optim_bytes", "saved_bytes", "recv_bytes", "send_bytes",
               "workspace_bytes", "wait_bytes", "recv_held", "send_held", "freed_bytes", "fused_bytes")
"""Keys :func:`stage_memory` fills (bytes per rank of the stage; saved, recv and send per
micro-batch, ``workspace_bytes`` held once; ``recv_held``/``send_held``: how many micro-batches'
worth of recv and send bytes the stage holds at its peak; ``wait_bytes``: gradients of received
long skips held at the peak until their producer takes them, all copies counted; ``freed_bytes``:
what one micro-batch has freed by the stage's peak, [Note: freed by the peak]; ``fused_bytes``:
how much the fused halo runs raise ``workspace_bytes`` above the solvers' figure, [Note: fused
workspace] in partitioner/search/halo_fusion.py)."""


def stage_memory(costs: Costs, cand: Candidate, stage_of: Sequence[int],
                 fused_ws: Mapping[str, float] | None = None) -> list[dict[str, float]]:
    """Per-stage memory terms (per rank of the stage) for the node-to-stage map ``stage_of``.

    ``weight_bytes`` (parameters and buffers), ``grad_bytes`` and ``optim_bytes`` are held for
    the whole step; ``saved_bytes`` (activations saved for backward, halo-padded tiles included),
    ``recv_bytes`` and ``send_bytes`` (boundary tensors) are per micro-batch; saved bytes are held
    for ``inflight`` micro-batches, received ones ``recv_held`` times and the gradient buffers of
    sent ones ``send_held`` times; ``workspace_bytes`` is the largest transient of one op and
    ``wait_bytes`` the long-skip gradients waiting for their producer. So ``weight + grad + optim
    + inflight x saved + recv_held x recv + send_held x send + workspace + wait`` is the solvers'
    bound of the stage's peak, and that less ``freed_bytes`` the plan's ``peak_bytes``.
    ``fused_ws`` raises the workspace of the nodes it names (the first op of a fused halo run,
    [Note: fused workspace] in partitioner/search/halo_fusion.py).
    """
    prof = costs.profile
    problem = build_problem(costs, cand, "memory")
    k = cand.stages
    out = [dict.fromkeys(MEMORY_KEYS, 0.0) for _ in range(k)]
    fused = fused_ws or {}
    base = [problem.variants[problem.stages[stage_of[v]].variant].workspace[v] for v in range(len(prof.nodes))]
    ws = [max(b, fused.get(n.name, 0.0)) for b, n in zip(base, prof.nodes, strict=True)]  # each node's transient
    for v, n in enumerate(prof.nodes):
        s = stage_of[v]
        vec = problem.variants[problem.stages[s].variant]
        out[s]["weight_bytes"] += n.param_bytes + n.buffer_bytes
        out[s]["grad_bytes"] += n.grad_bytes
        out[s]["optim_bytes"] += n.optim_bytes
        out[s]["saved_bytes"] += vec.act[v]
        out[s]["workspace_bytes"] = max(out[s]["workspace_bytes"], ws[v])
        out[s]["fused_bytes"] = max(out[s]["fused_bytes"], base[v])  # the solvers' workspace, for now
    recv, send, wait = boundary_bytes(problem, stage_of)
    for s, spec in enumerate(problem.stages):
        out[s].update(recv_bytes=recv[s], send_bytes=send[s], wait_bytes=wait[s],
                      recv_held=spec.recv_factor, send_held=spec.send_factor)
    # [Note: freed by the peak]
    readers: list[set[int]] = [set() for _ in prof.nodes]  # stages that read each node's output
    for u, v in problem.edges:
        readers[u].add(stage_of[v])
    cum = [0.0] * k
    top = [0.0] * k
    sent = [0.0] * k
    for v, n in enumerate(prof.nodes):
        s = stage_of[v]
        name = problem.stages[s].variant
        vec = problem.variants["plain" if name.startswith("plain+w") else name]
        gone = 0.0  # an output only other stages read, saved by them, not by its own node: freed once sent
        if (n.op not in ("placeholder", "get_attr", "output") and readers[v] and s not in readers[v]
                and not n.self_saved and 0 < vec.out[v] <= vec.act[v]):
            gone = float(vec.out[v])
        sent[s] += gone
        cum[s] += vec.act[v] - gone
        top[s] = max(top[s], cum[s] + ws[v])
    for s, spec in enumerate(problem.stages):
        out[s]["freed_bytes"] = spec.inflight * sent[s] + max(0.0, cum[s] + out[s]["workspace_bytes"] - top[s])
        out[s]["fused_bytes"] = out[s]["workspace_bytes"] - out[s]["fused_bytes"]
    if not costs.inference:
        _recompute_peaks(out, cand, sent)
    return out


def _recompute_peaks(out: list[dict[str, float]], cand: Candidate, gone: Sequence[float]) -> None:
    """A recomputed stage's ``freed_bytes`` so that its peak is the larger of its backward's and its
    recompute forward's ([Note: recompute pending sends] in levers.py): the solvers' bound charges
    ``inflight`` more sends on top of the workspace; the backward peak has them released, the
    forward peak holds them (``gone``: the part of one micro-batch's outputs already in its saved
    bytes) but no backward workspace."""
    inflight = cand.inflight()
    for s in cand.recompute:
        m = out[s]
        extra = inflight[s] * m["send_bytes"]
        bound = (m["weight_bytes"] + m["grad_bytes"] + m["optim_bytes"] + m["saved_bytes"]
                 + m["recv_held"] * m["recv_bytes"] + m["send_held"] * m["send_bytes"] + m["workspace_bytes"]
                 + m["wait_bytes"])
        backward = bound - extra - m["freed_bytes"]
        forward = bound - m["workspace_bytes"] - gone[s]
        m["freed_bytes"] = max(0.0, bound - max(backward, forward))
