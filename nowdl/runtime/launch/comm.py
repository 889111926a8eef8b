"""Every tensor that crosses ranks goes through here: torch.distributed, or host staging where gloo cannot.

[Note: host staging] gloo moves CPU memory only: its send/recv refuse CUDA tensors, and NCCL
refuses two ranks on one GPU. So where a group's backend for the tensor's device is gloo and the
tensor is not on the CPU, :func:`isend`, :func:`irecv`, :func:`all_reduce`, :func:`all_gather`
and :func:`broadcast` stage it: the tensor is copied into a host buffer (pinned for CUDA) when the
call is made, gloo moves the host buffer, and the result is copied back into the caller's tensor
when the returned work is waited on (or found complete by ``is_completed()``), or before the call
returns when it is synchronous. Both copies are synchronous on the caller's current stream
(``copy_`` without ``non_blocking``): the device-to-host copy sees everything queued before the
call, as an NCCL op would, and the caller may reuse its tensor as soon as the call returns; the
receiving copy is in the caller's tensor before ``wait()`` returns. Correct first; it stalls the
CPU until the GPU has caught up at each staged call.

``NOWDL_STAGE_HOST=1`` stages every tensor, CPU ones included (into a separate host buffer and
back), so that the CPU tests run the staging path; ``0`` never stages (gloo then fails on a CUDA
tensor as it would without nowdl). NCCL groups are never staged. :func:`staged_bytes` counts the
bytes copied between callers' tensors and staging buffers in this process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["isend", "irecv", "all_reduce", "all_gather", "broadcast", "Waitable", "StagedWork",
           "staged", "staged_bytes", "STAGE_VAR"]

log = logging.getLogger(__name__)

STAGE_VAR = "NOWDL_STAGE_HOST"
"""``1``: stage every tensor (CPU ones too); ``0``: never; unset: CUDA tensors on gloo groups."""

_count = {"bytes": 0, "told": 0}


class Waitable(Protocol):
    """What an asynchronous exchange returns: torch's ``Work``, or a :class:`StagedWork`."""

    def wait(self, timeout: timedelta = ...) -> bool: ...

    def is_completed(self) -> bool: ...


def staged_bytes() -> int:
    """Bytes copied between callers' tensors and host staging buffers in this process so far."""
    return _count["bytes"]


def _mode() -> str:
    value = os.environ.get(STAGE_VAR, "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("1", "true", "yes", "on", "always"):
        return "always"
    if value in ("0", "false", "no", "off", "never"):
        return "never"
    from nowdl.errors import NowdlError

    raise NowdlError(f"{STAGE_VAR}={value!r} is not 1, 0 or auto: unset it (stage CUDA tensors on gloo groups), "
                     "or set 1 (stage every tensor) or 0 (never)")


def _device_backend(group: dist.ProcessGroup | None, device_type: str) -> str:
    """The backend ``group`` runs ``device_type`` tensors on ("" when none or not in the group)."""
    try:
        config = dist.get_backend_config(group)
    except (RuntimeError, ValueError):
        return ""
    for entry in config.split(","):
        dev, _, name = entry.partition(":")
        if name and dev.strip() == device_type:
            return name.strip()
        if not name and dev.strip():  # a config without device types: one backend for all
            return dev.strip()
    return ""


def staged(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> bool:
    """Whether an exchange of ``tensor`` on ``group`` goes through host staging ([Note: host staging])."""
    mode = _mode()
    if mode == "never" or (mode == "auto" and tensor.device.type == "cpu"):
        return False
    if _device_backend(group, tensor.device.type) != "gloo":  # NCCL (or MPI) moves it itself
        return False
    if tensor.device.type == "cpu":
        return True  # NOWDL_STAGE_HOST=1
    if not _count["told"]:
        _count["told"] = 1
        log.info("gloo moves %s tensors through host memory (nowdl's host staging: [Note: host staging] in "
                 "runtime/launch/comm.py); use nccl, one rank per GPU, for speed", tensor.device.type)
    return True


def _host(like: torch.Tensor) -> torch.Tensor:
    """A contiguous host buffer of ``like``'s shape and dtype (pinned when ``like`` is on CUDA)."""
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.device.type == "cuda")


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``, complete when this returns (a separate buffer even for a CPU ``t``)."""
    host = _host(t)
    host.copy_(t)
    _count["bytes"] += t.numel() * t.element_size()
    return host


def _from_host(t: torch.Tensor, host: torch.Tensor) -> None:
    """Copy ``host`` into ``t``, complete when this returns."""
    t.copy_(host)
    _count["bytes"] += t.numel() * t.element_size()


class StagedWork:
    """An exchange of host buffers, finished by copying them back into the caller's tensors.

    Behaves as torch's ``Work`` for what nowdl asks of it: :meth:`wait` (with or without a
    timeout) waits for gloo, then copies; :meth:`is_completed` is True once gloo is done and the
    copy made (it makes the copy). ``keep`` holds the host buffers until then.
    """

    def __init__(self, work: Any, finish: Callable[[], None] | None, keep: Sequence[torch.Tensor]) -> None:
        self.work, self._finish, self.keep = work, finish, list(keep)
        self._done = False

    def _complete(self) -> None:
        if not self._done:
            self._done = True
            if self._finish is not None:
                self._finish()
            self.keep = []

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the exchange (at most ``timeout``), then finish it; False if not done in time."""
        if self._done:
            return True
        ok = self.work.wait() if timeout is None else self.work.wait(timeout=timeout)
        if ok is False:
            return False
        self._complete()
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self.work.is_completed():
            self._complete()
            return True
        return False


def _done(work: Any, finish: Callable[[], None] | None, keep: Sequence[torch.Tensor], async_op: bool
          ) -> StagedWork | None:
    """The staged work (``async_op``), or wait for it now and finish (a synchronous call)."""
    if work is None:  # this rank is not in the group
        return None
    sw = StagedWork(work, finish, keep)
    if async_op:
        return sw
    sw.wait()
    return None


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> Any:
    """``dist.isend``; staged: the host copy is made before this returns (``tensor`` is free then)."""
    if not staged(tensor, group):
        return dist.isend(tensor, dst=dst, group=group, tag=tag)
    host = _to_host(tensor)
    return _done(dist.isend(host, dst=dst, group=group, tag=tag), None, [host], True)


def irecv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = 0) -> Any:
    """``dist.irecv`` into ``tensor``; staged: it holds the message once the work is waited on."""
    if not staged(tensor, group):
        return dist.irecv(tensor, src=src, group=group, tag=tag)
    host = _host(tensor)
    return _done(dist.irecv(host, src=src, group=group, tag=tag), lambda: _from_host(tensor, host), [host], True)


def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> Any:
    """``dist.all_reduce`` in place; staged and ``async_op``: ``tensor`` holds the result once waited on."""
    if not staged(tensor, group):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    host = _to_host(tensor)
    work = dist.all_reduce(host, op=op, group=group, async_op=async_op)
    return _done(work if async_op else _Finished(), lambda: _from_host(tensor, host), [host], async_op)


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> Any:
    """``dist.all_gather`` of ``tensor`` into ``outputs`` (one per rank of ``group``)."""
    if not staged(tensor, group):
        return dist.all_gather(outputs, tensor, group=group, async_op=async_op)
    host = _to_host(tensor)
    outs = [_host(o) for o in outputs]
    work = dist.all_gather(outs, host, group=group, async_op=async_op)

    def finish() -> None:
        for o, h in zip(outputs, outs, strict=True):
            _from_host(o, h)

    return _done(work if async_op else _Finished(), finish, [host, *outs], async_op)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    """``dist.broadcast`` in place from global rank ``src``; staged: the source's tensor is left as it is."""
    if not staged(tensor, group):
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op)
    mine = dist.get_rank() == src
    host = _to_host(tensor) if mine else _host(tensor)
    work = dist.broadcast(host, src=src, group=group, async_op=async_op)
    finish = None if mine else (lambda: _from_host(tensor, host))
    return _done(work if async_op else _Finished(), finish, [host], async_op)


class _Finished:
    """The work of a synchronous collective: already done when the call returned."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True
