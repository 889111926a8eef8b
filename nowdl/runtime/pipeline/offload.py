"""Offloaded stages: a micro-batch's saved activations wait in host memory between its forward
and its backward.

[Note: offload] A stage in the plan's offload set (``StagePlan.offload``) runs its forward under
saved-tensor hooks (:func:`torch.autograd.graph.saved_tensors_hooks`). The pack hook copies each
saved activation to host memory and keeps only the host copy; the unpack hook gives autograd a
device copy back. Parameters, buffers and the stage's own inputs (which the runner holds until
the backward anyway) are not copied; a tensor saved by several ops is copied once.

On CUDA the copy out runs on a side stream that first waits for the compute stream, into a
pinned host buffer; an event marks its end, and the device tensor is kept alive until the event
has passed (checked at every later pack and every action), then released to the caching
allocator. The forward never runs more than a window ahead of its copies: when the device
tensors still waiting for their copy out hold more than ``WINDOW`` times the largest tensor
offloaded so far, the pack hook waits for the oldest copy to end. The copy back
(:meth:`Offload.prefetch`) also runs on the side stream, into memory allocated on the compute
stream, which waits for its event before autograd reads it. It brings tensors back in the
reverse of the order they were saved (the order the backward reads them) and keeps at most a
window of them on the device ahead of autograd: the runner prefetches the first window of a
micro-batch when the action before its ``B`` ends, so that copy overlaps the action, and each
unpack starts the next. This is the memory the cost model charges ([Note: host offload] in
partitioner/costs/levers.py): a node's saved bytes and the next ones, not the stage's whole
saved activations.

On the CPU the same hooks run and every tensor makes the same round trip through a host copy (a
clone out, a clone back, in the same windows), so the CPU tests exercise the path and its
exactness: the values come back bit for bit. The CUDA path ran in ``benchmarks/gpu_check.py``
on an H200 (docs/benchmarks.md); CI runs the CPU path only.

:attr:`Offload.bytes_out` counts the bytes copied to the host since the engine started,
:attr:`Offload.step_bytes` those of the current step and :attr:`Offload.peak_host_bytes` the most
held on the host at once in the current step (per rank, for the memory picture and metrics).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from nowdl.profiler.memory import host_memory

__all__ = ["Offload", "WINDOW"]

_Key = tuple[int, int, int]  # replica, stage, micro-batch
WINDOW = 2  # largest saved tensors' worth on the device ahead of the backward, or behind the forward


class _Held:
    """One saved tensor in host memory (``host``), and its device copy once fetched back (``dev``)."""

    __slots__ = ("owner", "host", "dev", "ready", "nbytes", "counted", "used", "key", "__weakref__")

    def __init__(self, owner: Offload, host: Tensor, nbytes: int) -> None:
        self.owner = owner
        self.host: Tensor | None = host  # CUDA: kept until autograd has the device copy (the copy reads it)
        self.dev: Tensor | None = None
        self.ready: Any = None  # CUDA: the event the copy back records
        self.nbytes = nbytes
        self.counted = True  # in the owner's host_bytes until it is copied back
        self.used = False  # autograd has unpacked it (its device copy no longer counts as ahead)
        self.key: _Key | None = None  # its micro-batch

    def uncount(self) -> None:
        if self.counted:
            self.counted = False
            self.owner.host_bytes -= self.nbytes

    def __del__(self) -> None:
        self.uncount()


class Offload:
    """This rank's offloaded stages ([Note: offload]).

    Args:
        stages: the stage indices whose saved activations go to host memory.
        device: where the stages run.
    """

    def __init__(self, stages: set[int], device: torch.device) -> None:
        self.stages = set(stages)
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream: Any = torch.cuda.Stream(device) if self.cuda else None
        self.bytes_out = 0
        self.step_bytes = 0
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self._held: dict[_Key, list[weakref.ref[_Held]]] = {}
        # per micro-batch, as its backward goes: how many of its saved tensors, from the last
        # saved, prefetch has passed, and the bytes fetched back that autograd has not read yet
        self._passed: dict[_Key, int] = {}
        self._ahead: dict[_Key, int] = {}
        self._inflight: list[tuple[Any, Tensor]] = []  # (event, device tensor) of copies out not yet done
        self._inflight_bytes = 0
        self._largest = 0  # bytes of the largest tensor offloaded this step: the windows' unit

    def __contains__(self, stage: int) -> bool:
        return stage in self.stages

    def begin_step(self) -> None:
        """Start a step's counters (``step_bytes``, ``peak_host_bytes``)."""
        self.step_bytes = 0
        self.peak_host_bytes = self.host_bytes
        self._largest = 0

    @contextmanager
    def saving(self, key: _Key, keep: Sequence[Tensor], modules: Sequence[nn.Module]) -> Iterator[None]:
        """Inside, saved tensors of micro-batch ``key`` go to host memory, except ``keep`` (the
        stage's inputs) and the parameters and buffers of ``modules``."""
        skip = {t.data_ptr() for t in keep}
        for m in modules:
            skip.update(p.data_ptr() for p in m.parameters())
            skip.update(b.data_ptr() for b in m.buffers())
        held = self._held.setdefault(key, [])
        # id(tensor) -> (tensor, version, copy), all weak: every saved variable of the forward holds
        # this hook (and so ``seen``) until it is freed, and a strong copy here would keep every
        # copy fetched back on the device until the whole backward ended
        seen: dict[int, tuple[weakref.ref[Tensor], int, weakref.ref[_Held]]] = {}

        def pack(t: Tensor) -> Any:
            self.reap()
            if t.data_ptr() in skip or t.numel() == 0 or t.layout != torch.strided:
                return t
            got = seen.get(id(t))  # the same live tensor, unchanged, saved again (not a dead one's address)
            if got is not None and got[0]() is t and got[1] == t._version and (again := got[2]()) is not None:
                return again
            h = self._copy_out(t)
            seen[id(t)] = (weakref.ref(t), t._version, weakref.ref(h))
            h.key = key
            held.append(weakref.ref(h))
            return h

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _copy_out(self, t: Tensor) -> _Held:
        nbytes = t.numel() * t.element_size()
        self._largest = max(self._largest, nbytes)
        if self.cuda:
            self._wait_out(WINDOW * self._largest - nbytes)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            self._inflight.append((done, t))  # the device tensor lives until its copy has ended
            self._inflight_bytes += nbytes
        else:
            with host_memory():  # [Note: host copies on CPU]: not the device's memory
                host = t.detach().clone()
        self.bytes_out += nbytes
        self.step_bytes += nbytes
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return _Held(self, host, nbytes)

    def _wait_out(self, budget: float) -> None:
        """Wait for the oldest copies out until the device tensors waiting for theirs hold at most ``budget``."""
        self.reap()
        while self._inflight and self._inflight_bytes > budget:
            ev, t = self._inflight.pop(0)
            ev.synchronize()
            self._inflight_bytes -= t.numel() * t.element_size()

    def reap(self) -> None:
        """Release the device tensors whose copy out has ended."""
        if self._inflight:
            left = [(ev, t) for ev, t in self._inflight if not ev.query()]
            self._inflight_bytes = sum(t.numel() * t.element_size() for _, t in left)
            self._inflight = left

    def prefetch(self, key: _Key) -> None:
        """Start copying micro-batch ``key``'s saved tensors back to the device, the last saved
        first, until a window of them is on the device ahead of autograd."""
        self.reap()
        refs = self._held.get(key, [])
        passed = self._passed.get(key, 0)
        while passed < len(refs) and self._ahead.get(key, 0) < WINDOW * self._largest:
            passed += 1
            h = refs[-passed]()
            if h is not None and h.dev is None and h.host is not None:
                self._copy_back(h)
        self._passed[key] = passed

    def _copy_back(self, h: _Held) -> None:
        host = h.host
        assert host is not None
        if self.cuda:
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)  # on the compute stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                dev.copy_(host, non_blocking=True)
                h.ready = torch.cuda.Event()
                h.ready.record(self.stream)
        else:
            dev = host.clone()
            h.host = None
        h.dev = dev
        h.uncount()
        if h.key is not None:
            self._ahead[h.key] = self._ahead.get(h.key, 0) + h.nbytes

    def _unpack(self, h: Any) -> Tensor:
        if isinstance(h, Tensor):  # kept on the device
            return h
        if h.dev is None:
            self._copy_back(h)
        if h.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(h.ready)
        h.host = None  # torch's pinned-memory allocator reuses the block only after the copy's event
        dev: Tensor = h.dev
        if not h.used:
            h.used = True
            if h.key is not None:
                self._ahead[h.key] -= h.nbytes
                self.prefetch(h.key)  # the next tensors the backward reads
        return dev

    def drop(self, key: _Key) -> None:
        """Forget micro-batch ``key`` (after its backward; its tensors die with the graph)."""
        self._held.pop(key, None)
        self._passed.pop(key, None)
        self._ahead.pop(key, None)
