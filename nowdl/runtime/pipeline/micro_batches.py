"""Cutting a global batch into the micro-batches of a step, in (dp copy, replica, micro-batch) order."""

from __future__ import annotations

from typing import Any

import torch

from nowdl.errors import NowdlError
from nowdl.runtime.spatial.tiles import TiledInput

__all__ = ["split_batch", "detach"]


def split_batch(batch: Any, total: int, how: str = "") -> list[Any]:
    """Cut a global batch (tensor, TiledInput, or a tuple/list of them) into ``total`` micro-batches."""
    if batch is None:
        return [None] * total
    if isinstance(batch, TiledInput):
        n = batch.shape[0]
        if n % total:
            raise NowdlError(f"the global batch of {n} samples does not split into {total} micro-batches: "
                             f"give a multiple of {total}")
        return [batch.rows(i * (n // total), (i + 1) * (n // total)) for i in range(total)]
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % total:
            raise NowdlError(
                f"the global batch of {batch.shape[0]} samples does not split into {total} micro-batches "
                f"({how}): give a multiple of {total}"
            )
        return list(batch.chunk(total))
    if isinstance(batch, (list, tuple)):
        parts = [split_batch(b, total, how) for b in batch]
        return [type(batch)(p[i] for p in parts) for i in range(total)]
    raise NowdlError(f"cannot split a batch of type {type(batch).__name__} into micro-batches: pass tensors")


def detach(out: Any) -> Any:
    """``out`` (a tensor or a structure of tensors) detached."""
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(detach(v) for v in out)
    if isinstance(out, dict):
        return {k: detach(v) for k, v in out.items()}
    return out
