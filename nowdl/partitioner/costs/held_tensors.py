"""What the runtime holds of a stage's boundary tensors at its peak, per micro-batch of bytes.

[Note: held buffers] The engine (runtime/pipeline/engine.py, runtime/pipeline/transfers.py) posts each receive
``RECV_LOOKAHEAD`` action ahead into a fresh buffer, keeps a micro-batch's received activations
until its backward has run, receives the gradients of its outputs into buffers freed after that
backward, and waits a send (freeing its tensor) as soon as the receiver is known to have posted
the matching receive. The activations peak during the backward of the oldest micro-batch in
flight, with ``inflight`` micro-batches' activations alive. So a stage holds:

* received activations: one buffer per micro-batch in flight, plus the next forward's, posted
  ahead during a backward followed by a forward (1F1B's steady state);
* gradients of its outputs: one backward's buffer, plus the next one's, posted ahead during a
  backward followed by a backward (GPipe; 1F1B's cool-down: every schedule with M > 1);
* the input gradients the backward sends are made at its end, when its saved activations are
  gone, and are freed before the next backward: they do not add to the peak, except a long
  skip's (to a stage two or more before), which waits until that stage posts its receive:
  ``StageSpec.skip_wait`` ([Note: long-skip gradient waits] in skipwait.py);
* zero bubble (``"zb"``): a micro-batch's whole activations live until its ``B`` (stage s holds
  1F1B's ``min(M, K - s)`` of them), and then, until its ``W``, only each convolution's and
  linear layer's input and output gradient ([Note: deferred weight gradients] in
  runtime/pipeline/deferred_wgrad.py; :func:`deferred_bytes`), about ``s`` micro-batches of them at the
  peak (``zborder.zb_held``);
* while autograd runs a node's backward, the gradient of its output and the new gradients of
  its inputs are alive together on top of the activations still saved
  (:func:`backward_grad_bytes`, which the cost model takes as a node's workspace when larger).
  A concatenation's backward allocates nothing: its inputs' gradients are slices (views) of its
  output's (:data:`VIEW_GRAD_TARGETS`), so only that one gradient counts (the plain last stage
  of bench_spatial's Table 6 was charged a cat's output gradient twice: 4 MiB at 256²).
"""

from __future__ import annotations

from collections.abc import Sequence

from nowdl.schedule.orders import RECV_LOOKAHEAD

__all__ = ["DEFERRED_LAYERS", "VIEW_GRAD_TARGETS", "held_buffers", "backward_grad_bytes", "deferred_bytes"]

_NO_GRAD_OPS = ("placeholder", "get_attr", "output")

DEFERRED_LAYERS = tuple(f"torch.nn.modules.{m}" for m in (
    "conv.Conv1d", "conv.Conv2d", "conv.Conv3d", "conv.ConvTranspose1d", "conv.ConvTranspose2d",
    "conv.ConvTranspose3d", "linear.Linear"))
"""Module classes (profile targets) whose weight gradients zero bubble defers (runtime/pipeline/deferred_wgrad.py's ``_SWAP``)."""

VIEW_GRAD_TARGETS = ("torch.cat", "torch.concat", "torch.concatenate", "torch._ops.aten.aten::cat")
"""Profile targets whose backward gives each input a view of the output's gradient (no new bytes);
the last is how ``profiler.runner.target_name`` names ``aten.cat`` in torch.export graphs."""



def held_buffers(schedule: str, micro_batches: int, inflight: int) -> tuple[float, float]:
    """(received, sent) bytes factors: how many micro-batches' worth of each a stage holds at its peak.

    Args:
        schedule: "gpipe", "1f1b" or "zb".
        micro_batches: M, micro-batches per step.
        inflight: micro-batches whose activations the stage holds at once (GPipe M;
            1F1B min(M, K - s); zero bubble min(M, K), counted until the deferred ``W``).

    Returns:
        Multipliers of the stage's received bytes and of its sent bytes (whose gradients it
        receives) in its peak memory.

    >>> held_buffers("1f1b", 4, 1)  # last stage: F0 B0 F1 B1 ...; F1's input posted during B0
    (2.0, 2.0)
    >>> held_buffers("gpipe", 4, 4)  # B1's output gradients posted during B0
    (4.0, 2.0)
    """
    n = max(1, min(inflight, micro_batches))
    forward_after_backward = schedule in ("1f1b", "zb") and n < micro_batches
    backward_after_backward = micro_batches > 1  # the last two backwards of any schedule
    ahead = 1 if RECV_LOOKAHEAD > 0 else 0
    return float(n + ahead * forward_after_backward), float(1 + ahead * backward_after_backward)


def backward_grad_bytes(ops: Sequence[str], out_bytes: Sequence[float], floating: Sequence[bool],
                        edges: Sequence[tuple[int, int]], targets: Sequence[str] = ()) -> list[float]:
    """Per node: bytes of gradients alive while autograd runs its backward.

    The gradient of the node's output plus one gradient per distinct producer of its inputs
    (each the size of that producer's output); inputs that get no gradient (model inputs,
    constants, integer tensors) count nothing, nor does the graph's ``output`` node. A node
    whose ``targets`` entry is in :data:`VIEW_GRAD_TARGETS` counts its output's gradient only.

    Args:
        ops: fx op of each node ("placeholder", "call_module", ...).
        out_bytes: bytes of each node's output.
        floating: whether each node's output is a floating-point tensor.
        edges: (producer, consumer) node indices.

    >>> backward_grad_bytes(["placeholder", "call_module", "call_function", "output"],
    ...                     [8, 16, 16, 0], [True] * 4, [(0, 1), (1, 2), (1, 2), (2, 3)])
    [0.0, 16.0, 32.0, 0.0]
    >>> backward_grad_bytes(["call_module", "call_module", "call_function"], [8, 8, 16], [True] * 3,
    ...                     [(0, 2), (1, 2)], ["conv", "conv", "torch.cat"])
    [8.0, 8.0, 16.0]
    """
    producers: list[set[int]] = [set() for _ in ops]
    for u, v in edges:
        producers[v].add(u)
    out = []
    for v, op in enumerate(ops):
        if op in _NO_GRAD_OPS or not floating[v]:
            out.append(0.0)
            continue
        g = float(out_bytes[v])
        if targets and targets[v] in VIEW_GRAD_TARGETS:
            out.append(g)
            continue
        g += sum(float(out_bytes[u]) for u in producers[v] if ops[u] not in _NO_GRAD_OPS and floating[u])
        out.append(g)
    return out


def deferred_bytes(targets: Sequence[str], out_bytes: Sequence[float], edges: Sequence[tuple[int, int]]) -> list[float]:
    """Per node: bytes one micro-batch keeps for its deferred ``W`` once its ``B`` ran.

    A layer of :data:`DEFERRED_LAYERS` keeps its output's gradient (its output's size) and its
    inputs, charged to the layer itself: its ``W`` holds them on its stage wherever they were
    made (a received tensor stays past its backward).

    >>> deferred_bytes(["x", DEFERRED_LAYERS[1], "relu", DEFERRED_LAYERS[1]], [8, 16, 16, 4],
    ...                [(0, 1), (1, 2), (2, 3)])
    [0.0, 24.0, 0.0, 20.0]
    """
    producers: list[set[int]] = [set() for _ in targets]
    for u, v in edges:
        producers[v].add(u)
    return [float(out_bytes[v]) + sum(float(out_bytes[u]) for u in producers[v]) if t in DEFERRED_LAYERS else 0.0
            for v, t in enumerate(targets)]
