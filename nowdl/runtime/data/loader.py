"""A DataLoader whose step ``s`` batch is the same on every rank: a seeded sampler, parallel workers.

Draw ``k = s * batch_size + j`` of the stream is sample ``perm(seed, epoch)[k % len]`` with
``epoch = k // len``, so every rank (and a resumed run starting at step ``s``) sees the same
global batch at the same step, however many workers load it.
"""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from nowdl.errors import NowdlError
from nowdl.runtime.data.datasets import check_sample

__all__ = ["StepSampler", "loader", "default_workers", "epoch_order"]


def default_workers() -> int:
    """min(4, CPU cores this process may use)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return min(4, cores)


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The seeded shuffle of ``range(n)`` for ``epoch`` (``ImageFolderData``'s order too)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 - 1 - epoch) % (2**63))
    return torch.randperm(n, generator=g).tolist()


class StepSampler(Sampler[list[int]]):
    """Batches of indices for steps ``start, start + 1, ...`` (``steps`` of them; None: endless).

    Args:
        n: the dataset's length.
        batch_size: samples per step (the global batch).
        seed: the shuffle's seed.
        start: the first step (a resumed run starts where it stopped).
        steps: how many batches (None: endless).
    """

    def __init__(self, n: int, batch_size: int, *, seed: int = 0, start: int = 0, steps: int | None = None) -> None:
        if n < 1 or batch_size < 1:
            raise NowdlError(f"StepSampler needs a non-empty dataset and batch_size >= 1 (got {n}, {batch_size})")
        self.n, self.batch_size, self.seed, self.start, self.steps = n, batch_size, seed, start, steps
        self._orders: dict[int, list[int]] = {}

    def indices(self, step: int) -> list[int]:
        """The dataset indices of step ``step``'s batch."""
        out = []
        for k in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, pos = divmod(k, self.n)
            if epoch not in self._orders:
                self._orders = {epoch: epoch_order(self.n, self.seed, epoch), **{e: o for e, o in self._orders.items()
                                                                                 if e == epoch - 1}}
            out.append(self._orders[epoch][pos])
        return out

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start
        while self.steps is None or step < self.start + self.steps:
            yield self.indices(step)
            step += 1

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("an endless StepSampler has no length")
        return self.steps


class _Indexed(Dataset[Any]):
    """Items as ``(index, item)``, so that a bad sample is named by its index."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[int | str, Any]:
        describe = getattr(self.dataset, "describe", None)  # a crop: its file and region
        return (f"{index} ({describe(index)})" if callable(describe) else index), self.dataset[index]


def _ignore_stop_signals(worker_id: int) -> None:
    """A loader worker ignores SIGTERM and SIGINT: Slurm (``--signal``, ``scancel``) and torchrun
    signal every process of the job, and Ctrl-C on a terminal signals its whole process group; a
    worker that died of it made its rank fail ("DataLoader worker ... is killed by signal",
    or a KeyboardInterrupt traceback) instead of finishing the step and saving. The workers end
    with the iterator, or when their parent is gone."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _collate(batch: list[Any], *, where: str, sample_shape: Sequence[int] | None,
             label_shape: Sequence[int] | None, classes: int | None = None) -> Any:
    if sample_shape is not None:
        for i, item in batch:
            check_sample(item, i, where, sample_shape, label_shape, classes)
        batch = [item for _, item in batch]
    x, y = default_collate(batch) if isinstance(batch[0], (tuple, list)) else (default_collate(batch), None)
    if isinstance(y, torch.Tensor) and not y.is_floating_point():
        y = y.long()
    return x, y


def loader(dataset: Dataset[Any], batch_size: int, *, seed: int = 0, workers: int | None = None,
           start_step: int = 0, steps: int | None = None, pin_memory: bool | None = None,
           sample_shape: Sequence[int] | None = None, label_shape: Sequence[int] | None = None,
           name: str = "the dataset", classes: int | None = None) -> DataLoader[Any]:
    """A DataLoader of global batches ``(x, y)`` that ``CompiledModel.train_step(x, y)`` takes.

    Every rank builds the same loader and gets the same batch at the same step; pass
    ``start_step`` to resume a stream. The dataset's items are ``(x, y)`` (``y`` an int class
    or an integer label map).

    Args:
        dataset: a map-style dataset.
        batch_size: the global batch per step.
        seed: the shuffle's seed.
        workers: loader processes (default ``min(4, cores)``; 0 loads in this process).
        start_step: the first step's number.
        steps: how many batches (None: endless).
        pin_memory: default: when CUDA is available.
        sample_shape, label_shape: check every sample against them (a NowdlError names a bad one).
        classes: also check that every label is in ``0 .. classes - 1`` (with ``sample_shape``).
        name: what the errors call the dataset.

    Example:
        >>> for x, y in nowdl.data.loader(dataset, 8, seed=0, steps=100):
        ...     cm.train_step(x, y)
    """
    workers = default_workers() if workers is None else workers
    if workers < 0:
        raise NowdlError(f"workers must be >= 0, got {workers}")
    sampler = StepSampler(len(dataset), batch_size, seed=seed, start=start_step, steps=steps)  # type: ignore[arg-type]
    collate = functools.partial(_collate, where=name, sample_shape=sample_shape, label_shape=label_shape,
                                classes=classes)
    return DataLoader(dataset if sample_shape is None else _Indexed(dataset), batch_sampler=sampler, num_workers=workers, collate_fn=collate,
                      pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
                      prefetch_factor=2 if workers else None, persistent_workers=False,
                      worker_init_fn=_ignore_stop_signals if workers else None)
