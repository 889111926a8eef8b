"""The sizes of PyTorch's CUDA caching allocator and the options it reads ([Note: caching allocator]).

The constants are those of ``c10/cuda/CUDACachingAllocator.cpp`` (PyTorch 2.x):
``kMinBlockSize`` 512 B, ``kSmallSize`` 1 MiB, ``kSmallBuffer`` 2 MiB, ``kLargeBuffer`` 20 MiB,
``kMinLargeAlloc`` 10 MiB, ``kRoundLarge`` 2 MiB (later releases define most of them in
``c10/core/AllocatorConfig.h``, with the same values).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from nowdl.errors import NowdlError

__all__ = ["AllocatorConfig", "AllocatorOOM", "round_size", "allocation_size", "MiB",
           "K_MIN_BLOCK", "K_SMALL_SIZE", "K_SMALL_BUFFER", "K_LARGE_BUFFER", "K_MIN_LARGE_ALLOC", "K_ROUND_LARGE"]

MiB = 2**20
K_MIN_BLOCK = 512
K_SMALL_SIZE = MiB
K_SMALL_BUFFER = 2 * MiB
K_LARGE_BUFFER = 20 * MiB
K_MIN_LARGE_ALLOC = 10 * MiB
K_ROUND_LARGE = 2 * MiB


class AllocatorOOM(NowdlError):
    """The simulated allocator could not serve a request within its capacity."""


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` options the simulation follows (torch's defaults)."""

    expandable_segments: bool = False
    max_split_size: int | None = None  # bytes; None: any block may be split
    roundup_power2_divisions: int = 0  # 0: round to 512 B

    @classmethod
    def from_env(cls, text: str | None = None) -> AllocatorConfig:
        """The options of ``text`` (default: ``$PYTORCH_CUDA_ALLOC_CONF``, else ``$PYTORCH_ALLOC_CONF``),
        ``key:value`` pairs separated by commas; options the simulation does not model are ignored."""
        if text is None:
            text = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
        kw: dict[str, Any] = {}
        for item in text.replace(" ", "").split(","):
            key, _, value = item.partition(":")
            try:
                if key == "expandable_segments":
                    kw["expandable_segments"] = value.lower() == "true"
                elif key == "max_split_size_mb":
                    kw["max_split_size"] = int(float(value) * MiB)
                elif key == "roundup_power2_divisions" and not value.startswith("["):
                    kw["roundup_power2_divisions"] = int(value)
            except ValueError:
                raise NowdlError(f"PYTORCH_CUDA_ALLOC_CONF option {item!r} is not a number: "
                                 "write it as torch reads it, e.g. max_split_size_mb:512") from None
        return cls(**kw)

    def describe(self) -> str:
        parts = [f"expandable_segments {'on' if self.expandable_segments else 'off'}"]
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb {self.max_split_size // MiB}")
        if self.roundup_power2_divisions:
            parts.append(f"roundup_power2_divisions {self.roundup_power2_divisions}")
        return ", ".join(parts)


def round_size(size: int, divisions: int = 0) -> int:
    """The bytes a request of ``size`` is rounded to (``round_size`` in the allocator)."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    if divisions > 1 and size > K_MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return -(-size // K_MIN_BLOCK) * K_MIN_BLOCK


def allocation_size(size: int) -> int:
    """The segment cudaMalloc'd for a rounded request no cached block serves (``get_allocation_size``)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE
