"""Test helper (not a test module): a seeded Dataset whose process SIGKILLs itself at a chosen read.

``nowdl run --data helpers.dying_data:dying --data-args '{"kill_rank": 1, "kill_at": 23}' --workers 0``
reads its samples in the rank's own process; rank ``kill_rank`` dies (SIGKILL, as the OOM killer
does it) at its ``kill_at``-th read, in the first attempt of the job only
(``TORCHELASTIC_RESTART_COUNT`` and ``SLURM_RESTART_COUNT`` unset or 0), so a restarted job runs on.
"""

from __future__ import annotations

import os
import signal

import torch
from torch.utils.data import Dataset

__all__ = ["DyingData", "dying"]


class DyingData(Dataset[tuple[torch.Tensor, int]]):
    """``n`` samples ``(x, label)``: x of ``shape`` from N(0, 1), labels in ``0 .. classes - 1``, seeded by index."""

    def __init__(self, n: int, shape: tuple[int, ...], classes: int, kill_rank: int, kill_at: int) -> None:
        self.n, self.shape, self.classes = n, shape, classes
        first = all(os.environ.get(v, "0") in ("", "0") for v in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
        self.kill_at = kill_at if first and os.environ.get("RANK") == str(kill_rank) else 0
        self.reads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.reads += 1
        if self.reads == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(1000 + index)
        return torch.randn(self.shape, generator=g), int(torch.randint(self.classes, (1,), generator=g))


def dying(n: int = 64, shape: tuple[int, ...] = (3, 16, 16), classes: int = 3, kill_rank: int = -1,
          kill_at: int = 0) -> DyingData:
    """The dataset of ``--data helpers.dying_data:dying``."""
    return DyingData(n, tuple(shape), classes, kill_rank, kill_at)
