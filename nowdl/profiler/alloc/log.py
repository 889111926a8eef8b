"""The aten allocations a node makes while it is profiled: its forward's, its backward's, what stays.

[Note: allocation log] While the profiler runs a node's forward and backward (profiler/runner.py)
the allocation tracker (``AllocTracker(log=True)`` in profiler/memory.py) records, in order, every
storage an aten op newly allocates and when it dies (noticed before the next op or at the end of
the phase); on fake tensors a storage dies when the real one would. A node's :class:`AllocLog`:

* ``f``: the forward's events, the bytes of an allocation (the ``i``-th has id ``i``) or
  ``-(id + 1)`` for a free; ``o``: the ids of the forward's allocations that make the node's
  output. The forward's other allocations still live at its end are what the node saves for
  itself (BatchNorm's statistics, pooling indices); they die with its backward;
* ``b``: the backward's events (ids of its own); ``g``: ``(id, producer)`` for each of the
  backward's allocations live at its end that is the gradient of an input ``producer`` made, id
  -1 when that gradient is a view of the node's own output gradient (``cat``, ``split`` and views
  pass slices of it back); the other live ones are gradients of the node's parameters;
* ``a``: the producers whose storage the node's output shares (a view, an in-place op);
  ``s``: the producers whose output the node saves for its backward (itself included);
* ``p``: the bytes of each parameter that requires grad the node owns; ``u``: of each buffer and
  frozen parameter.

A library's workspace that the tracker adds (cuDNN's, [Note: convolution workspace] in
profiler/memory.py) is an allocation freed at once. A memoised node ([Note: node memo]) takes the
log of the node it repeats, its producers renamed. The profile of a CUDA device (measure mode)
has no log: the tracker does not run there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where a log is made: a profile is read without it
    import torch

    from nowdl.profiler.memory import AllocTracker

__all__ = ["AllocLog", "RawLog", "raw_log", "node_log"]


@dataclass(frozen=True)
class AllocLog:
    """One node's allocations ([Note: allocation log])."""

    f: tuple[int, ...] = ()
    o: tuple[int, ...] = ()
    b: tuple[int, ...] = ()
    g: tuple[tuple[int, str], ...] = ()
    a: tuple[str, ...] = ()
    s: tuple[str, ...] = ()
    p: tuple[int, ...] = ()
    u: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AllocLog:
        return cls(f=tuple(d.get("f", ())), o=tuple(d.get("o", ())), b=tuple(d.get("b", ())),
                   g=tuple((int(i), str(n)) for i, n in d.get("g", ())), a=tuple(d.get("a", ())),
                   s=tuple(d.get("s", ())), p=tuple(d.get("p", ())), u=tuple(d.get("u", ())))


@dataclass(frozen=True)
class RawLog:
    """What a run of a node logs, its inputs by position (so that a memoised node can reuse it)."""

    f: tuple[int, ...]
    o: tuple[int, ...]
    b: tuple[int, ...]
    g: tuple[tuple[int, int], ...]  # (id, input position); id -1: a view of the output's gradient


def _ids(tracker: AllocTracker, value: Any) -> list[int]:
    import torch
    from torch.utils._pytree import tree_flatten

    from nowdl.profiler.memory import storage_key

    out = []
    for t in tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor):
            i = tracker.ids.get(storage_key(t))
            if i is not None and i not in out:
                out.append(i)
    return out


def raw_log(fwd: AllocTracker | None, bwd: AllocTracker | None, out: Any, inputs: Sequence[torch.Tensor],
            params: Sequence[torch.Tensor], incoming: Sequence[torch.Tensor] = ()) -> RawLog | None:
    """The log of one run: ``fwd`` and ``bwd`` the phases' trackers (None: no log, or no backward),
    ``out`` the forward's output, ``inputs`` the tensors the run was given (their ``.grad`` set by
    the backward), ``params`` the node's parameters, ``incoming`` the gradients its backward was given."""
    if fwd is None:
        return None
    from nowdl.profiler.memory import storage_key

    g: list[tuple[int, int]] = []
    if bwd is not None:
        param_ids = set(_ids(bwd, [p.grad for p in params if p.grad is not None]))
        given = {storage_key(t) for t in incoming}
        for pos, t in enumerate(inputs):
            if t.is_leaf and t.grad is not None:  # a non-leaf holds no .grad (a clone's goes to its base)
                g.extend((i, pos) for i in _ids(bwd, t.grad) if i not in param_ids)
                if storage_key(t.grad) in given:
                    g.append((-1, pos))
        mapped = param_ids | {i for i, _ in g}
        # a live gradient of no input the run holds: an in-place op's, whose input is a clone's base
        g.extend((i, 0) for i in bwd.ids.values() if i not in mapped and inputs)
    return RawLog(tuple(fwd.events), tuple(_ids(fwd, out)), tuple(bwd.events) if bwd is not None else (), tuple(g))


def node_log(raw: RawLog | None, owners: Sequence[str], shares: Sequence[str], saves: Sequence[str],
             params: Sequence[int], fixed: Sequence[int]) -> AllocLog | None:
    """A node's :class:`AllocLog` from a run's ``raw`` log: ``owners`` names the producer of each input
    ("" for a parameter or constant: its gradient is a parameter's)."""
    if raw is None:
        return None
    g = tuple((i, owners[pos]) for i, pos in raw.g if pos < len(owners) and owners[pos])
    return AllocLog(f=raw.f, o=raw.o, b=raw.b, g=g, a=tuple(dict.fromkeys(shares)), s=tuple(dict.fromkeys(saves)),
                    p=tuple(params), u=tuple(fixed))

