"""Read-ahead of lazy tile batches: while step ``s`` runs, a thread reads this rank's windows of step ``s + 1``.

The engine reads a lazy batch (``CropDataset.lazy_batch``) window by window: this rank's tile
of each micro-batch's crops, and the mask rows where it computes the loss. The windows are the
same every step (they follow from the plan), so the first step learns them and each later
batch's windows are read one step ahead. Every read runs on one background thread (a TIFF
file handle is not shared between threads), so the loop blocks only on what is not read yet.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from nowdl.runtime.data.datasets import CropDataset
from nowdl.runtime.data.loader import StepSampler
from nowdl.runtime.spatial.tiles import TiledInput

__all__ = ["TileReadAhead"]

_Key = tuple[str, tuple[tuple[Any, Any], ...]]


def _key(kind: str, sl: tuple[slice, ...]) -> _Key:
    return kind, tuple((s.start, s.stop) for s in sl)


def _slices(key: _Key) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in key[1])


class TileReadAhead:
    """Lazy batches of ``dataset`` for steps in order, each read one step ahead once the windows are known.

    Args:
        dataset: the crops.
        sampler: which crops each step takes.
        stop: the step after the last one (nothing is read ahead past it); None: endless.
    """

    def __init__(self, dataset: CropDataset, sampler: StepSampler, stop: int | None = None) -> None:
        self.dataset, self.sampler, self.stop = dataset, sampler, stop
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="nowdl-read-ahead")
        self.windows: set[_Key] = set()
        self.ahead: dict[int, dict[_Key, Future[torch.Tensor]]] = {}
        self.blocked = 0.0  # seconds the caller waited for reads

    def batch(self, step: int) -> tuple[TiledInput, TiledInput]:
        """Step ``step``'s ``(x, y)``; starts reading step ``step + 1``'s known windows."""
        x, y = self.dataset.lazy_batch(self.sampler.indices(step))
        pending = self.ahead.pop(step, None) or self._submit(x, y)
        for kind, t in (("x", x), ("y", y)):
            t._read = self._reader(kind, t._read, pending)
        if self.stop is None or step + 1 < self.stop:
            self.ahead[step + 1] = self._submit(*self.dataset.lazy_batch(self.sampler.indices(step + 1)))
        return x, y

    def _submit(self, x: TiledInput, y: TiledInput) -> dict[_Key, Future[torch.Tensor]]:
        reads = {"x": x._read, "y": y._read}
        return {k: self.pool.submit(reads[k[0]], _slices(k)) for k in sorted(self.windows, key=repr)}

    def _reader(self, kind: str, raw: Any, pending: dict[_Key, Future[torch.Tensor]]) -> Any:
        def read(sl: tuple[slice, ...]) -> torch.Tensor:
            key = _key(kind, sl)
            self.windows.add(key)
            t0 = time.perf_counter()
            fut = pending.pop(key, None)
            out = (fut if fut is not None else self.pool.submit(raw, sl)).result()
            self.blocked += time.perf_counter() - t0
            return out

        return read

    def close(self) -> None:
        """Drop what was read ahead and stop the thread."""
        self.ahead.clear()
        self.pool.shutdown(wait=True, cancel_futures=True)
