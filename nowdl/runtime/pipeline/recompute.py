"""Recomputed stages: a micro-batch's saved activations are dropped in its forward and recomputed
at the start of its backward, with the same weights, buffers and random numbers.

[Note: recompute exactness] A stage in the plan's recompute set (``StagePlan.recompute``, or
forced by ``activation_checkpointing``) runs its forward under saved-tensor hooks
(:func:`torch.autograd.graph.saved_tensors_hooks`) whose pack hook keeps only a numbered
:class:`_Slot` per saved tensor, never the tensor. The autograd graph is otherwise the one an
ordinary forward builds (the outputs sent on, the loss, the gathered output of a spatial last
stage), so the backward, the gradient sync and the optimizer see no difference. At the start of
the micro-batch's ``B`` action the runner calls :meth:`Recompute.recompute`, which runs the same
forward again on the same input tensors, under the same autocast, and puts each tensor it saves
into the slot of the same number; autograd then unpacks the slots as it would the originals.
What makes the second forward equal the first:

* random numbers: the CPU generator's state, and the device generator's (CUDA), are stashed
  before the forward; the recompute runs on a fork of them set to the stashed states and puts
  the live states back afterwards, so dropout draws the same masks and the generators advance
  once, in the forward, as without recompute;
* buffers (BatchNorm and InstanceNorm running statistics, ``num_batches_tracked``, any
  momentum-updated buffer): the forward notes which buffers it changed (their version counter
  moved) and keeps their values from before it. The recompute first sets those buffers to the
  kept values (so a module whose output reads a buffer computes what the forward computed),
  then puts back the values they hold now. Running statistics therefore update once per
  micro-batch, in the forward, in micro-batch order; in training mode BatchNorm normalises with
  the batch's own statistics, so the recomputed activations are the forward's bit for bit.
  Saved tensors that are such buffers are cloned before the buffer is put back;
* everything else is the same code on the same inputs and weights (the optimizer steps after
  the last backward of the step), so each op gives the same bits on the same device.

The counts of saved tensors, their shapes and dtypes are checked against the forward's: a
mismatch (a forward that branches on state the recompute cannot restore) is an error, never a
silent wrong gradient.

[Note: recompute in spatial stages] A spatial stage's forward exchanges halos (p2p with tags
counted per tile group) and reduces norm statistics over its tile group. The recompute runs the
WHOLE tiled forward again, its exchanges and reductions included, and it runs eagerly at the
start of the ``B`` action, before the backward sends or receives anything. Every tile of the
group runs the same actions in the same order, so each tile starts the recompute at the same
point of the group's sequence of collectives and issues the same collectives in the same order:
the tags line up and nothing waits on a message sent later. Recomputing lazily, when autograd
first unpacks a saved tensor (``torch.utils.checkpoint``), could not promise that: a border tile
saves fewer tensors than an inner one (no halo to stitch), so the first unpack, and with it the
recompute's exchanges, can fall on either side of a backward exchange on different tiles, which
deadlocks or mismatches the tags. Checkpointing only the local compute between exchanges would
avoid collectives in the recompute but keep every exchanged window (most of the memory).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from nowdl.errors import NowdlError

__all__ = ["Recompute", "RngState"]

_Key = tuple[int, int, int]  # replica, stage, micro-batch
Hooks = Callable[[], AbstractContextManager[Any]]


class _Slot:
    """What the graph keeps of one saved tensor: its number, until the recompute fills ``value``."""

    __slots__ = ("frame", "index", "value", "__weakref__")

    def __init__(self, frame: _Frame, index: int) -> None:
        self.frame = frame
        self.index = index
        self.value: Tensor | None = None


@dataclass
class RngState:
    """The CPU generator's state and, on an accelerator, its device generator's."""

    device: torch.device
    cpu: Tensor
    dev: Tensor | None

    @classmethod
    def now(cls, device: torch.device) -> RngState:
        mod = _device_module(device)
        return cls(device, torch.get_rng_state(), None if mod is None else mod.get_rng_state(device))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        mod = _device_module(self.device)
        if mod is not None and self.dev is not None:
            mod.set_rng_state(self.dev, self.device)

    @contextmanager
    def replayed(self) -> Iterator[None]:
        """Run with the generators at this state; afterwards they are as they were before."""
        live = RngState.now(self.device)
        self.restore()
        try:
            yield
        finally:
            live.restore()


def _device_module(device: torch.device) -> Any:
    """``torch.cuda`` (or the device's module with RNG state), None for the CPU."""
    if device.type == "cpu":
        return None
    mod = getattr(torch, device.type, None)
    return mod if mod is not None and hasattr(mod, "get_rng_state") else None


@dataclass
class _Frame:
    """One micro-batch of one recomputed stage: how to rerun it and what it saved."""

    what: str  # "stage 2, micro-batch 1 (replica 0)": for errors
    run: Callable[[], Any]
    rng: RngState
    changed: list[tuple[Tensor, Tensor | None]]  # (buffer, its value before the forward)
    metas: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)
    slots: list[weakref.ref[_Slot]] = field(default_factory=list)
    done: bool = False


class Recompute:
    """This rank's recomputed stages ([Note: recompute exactness]).

    Args:
        stages: the stage indices recomputed.
        device: where the stages run (its generator is stashed and replayed).
    """

    def __init__(self, stages: set[int], device: torch.device) -> None:
        self.stages = set(stages)
        self.device = device
        self._frames: dict[_Key, _Frame] = {}
        self._mutated: dict[int, set[int]] = {}  # id(module) -> ids of the buffers its forwards changed

    def __contains__(self, stage: int) -> bool:
        return stage in self.stages

    def forward(self, key: _Key, module: nn.Module, run: Callable[[], Any],
                segment: Callable[[Hooks, bool], Any] | None = None) -> Any:
        """Run ``run()`` (the stage's forward, grad enabled) keeping no saved tensor; remember how
        to recompute them for micro-batch ``key``. Returns what ``run()`` returns. With
        ``segment`` (``segment(hooks, replay)``: the forward with ``hooks()`` around the
        segment's nodes; ``replay``: only up to the segment's end, [Note: recompute segment] in
        segment.py) only the segment's saved tensors are dropped."""
        buffers = _buffers(module)
        known = self._mutated.get(id(module))
        if known is None:  # first forward: watch every buffer
            known = self._mutated[id(module)] = _running_stats(module)
            watch = buffers
        else:
            watch = [b for b in buffers if id(b) in known]
        before = {id(b): b.detach().clone() for b in watch}
        versions = {id(b): b._version for b in buffers}
        rep, s, mb = key
        rerun = run if segment is None else lambda: segment(contextlib.nullcontext, True)
        frame = _Frame(f"stage {s}, micro-batch {mb} (replica {rep})", rerun, RngState.now(self.device), [])

        def pack(t: Tensor) -> _Slot:
            slot = _Slot(frame, len(frame.metas))
            frame.metas.append((tuple(t.shape), t.dtype))
            frame.slots.append(weakref.ref(slot))
            return slot

        if segment is None:
            with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                out = run()
        else:
            out = segment(lambda: torch.autograd.graph.saved_tensors_hooks(pack, _unpack), False)
        # the version counter, the values, and the norms' running statistics (their kernels update
        # them in place without moving the counter)
        changed = [b for b in buffers if b._version != versions[id(b)] or id(b) in known
                   or (id(b) in before and not torch.equal(b, before[id(b)]))]
        known.update(id(b) for b in changed)
        frame.changed = [(b, before.get(id(b))) for b in changed]
        self._frames[key] = frame
        return out

    def recompute(self, key: _Key) -> None:
        """Run micro-batch ``key``'s forward again and fill the slots its graph holds (the runner
        calls this at the start of the ``B`` action, before any backward communication)."""
        frame = self._frames.get(key)
        if frame is not None and frame.metas and not frame.done:
            _fill(frame)

    def drop(self, key: _Key) -> None:
        """Forget micro-batch ``key`` (after its backward, or after an eval forward)."""
        self._frames.pop(key, None)


def _buffers(module: nn.Module) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for b in module.buffers():
        seen.setdefault(id(b), b)
    return list(seen.values())


def _running_stats(module: nn.Module) -> set[int]:
    """The running-statistics buffers of the norm layers in ``module`` (ids)."""
    out: set[int] = set()
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            out.update(id(b) for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None)
    return out


def _unpack(slot: _Slot) -> Tensor:
    if slot.value is None:  # a backward not started by the runner: recompute now (not in spatial stages)
        _fill(slot.frame)
    if slot.value is None:
        raise NowdlError(f"recompute of {slot.frame.what} did not produce saved tensor {slot.index}: the "
                         "stage's forward saves different tensors each time it runs; take the stage out of "
                         "recompute (activation_checkpointing / plan recompute)")
    return slot.value  # freed with the slot, when autograd releases the node that saved it


def _fill(frame: _Frame) -> None:
    """Rerun ``frame``'s forward with its random state and buffers; each saved tensor goes to its slot."""
    count = 0
    kept = {b.data_ptr() for b, _ in frame.changed}

    def pack(t: Tensor) -> None:
        nonlocal count
        i = count
        count += 1
        if i >= len(frame.metas) or frame.metas[i] != (tuple(t.shape), t.dtype):
            want = frame.metas[i] if i < len(frame.metas) else "nothing"
            raise NowdlError(f"recompute of {frame.what} saved tensor {i} as {(tuple(t.shape), t.dtype)} where the "
                             f"forward saved {want}: the stage's forward is not repeatable; take the stage out of "
                             "recompute (activation_checkpointing / plan recompute)")
        slot = frame.slots[i]()
        if slot is not None:  # still held by the graph
            slot.value = t.detach().clone() if t.data_ptr() in kept else t.detach()

    now = [(b, b.detach().clone()) for b, _ in frame.changed]
    try:
        with torch.no_grad():
            for b, old in frame.changed:
                if old is not None:
                    b.copy_(old)
        with frame.rng.replayed(), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _never):
            frame.run()
    finally:
        with torch.no_grad():
            for b, value in now:
                b.copy_(value)
    if count != len(frame.metas):
        raise NowdlError(f"recompute of {frame.what} saved {count} tensors where the forward saved "
                         f"{len(frame.metas)}: the stage's forward is not repeatable; take the stage out of "
                         "recompute (activation_checkpointing / plan recompute)")
    frame.done = True


def _never(_: None) -> Tensor:  # pragma: no cover - the recompute's own graph is never run backward
    raise NowdlError("the recompute's graph was run backward")
