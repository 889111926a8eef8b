"""Run any supported module on a tile (:func:`tile_forward`) and sum its weight gradients.

:func:`tile_forward` picks the tiled op for a module (conv, transposed conv, pool, upsample
from :mod:`nowdl.runtime.spatial.tiled_ops`, norms from :mod:`nowdl.runtime.spatial.norms`,
pointwise modules as they are). Weight gradients: every rank computes its tile's contribution; :func:`sum_weight_grads`
all-reduces them with SUM over the tile group (never an average).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from nowdl.geometry import POINTWISE
from nowdl.runtime.launch import comm
from nowdl.runtime.spatial.norms import batchnorm_tile, groupnorm_tile, instancenorm_tile
from nowdl.runtime.spatial.tiled_ops import conv_tile, conv_transpose_tile, pool_tile, upsample_tile
from nowdl.runtime.spatial.tiles import TileGrid

__all__ = ["tile_forward", "sum_weight_grads"]


def tile_forward(
    module: nn.Module, x_tile: Tensor, grid: TileGrid, group: dist.ProcessGroup | None = None
) -> tuple[Tensor, TileGrid]:
    """Run a supported module (or an nn.Sequential of them) on a tile; return the output
    tile and its grid. Raises NotImplementedError naming the module otherwise."""
    if isinstance(module, nn.Sequential):
        for m in module:
            x_tile, grid = tile_forward(m, x_tile, grid, group)
        return x_tile, grid
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return conv_tile(x_tile, module, grid, group)
    if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return conv_transpose_tile(x_tile, module, grid, group)
    if isinstance(module, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        return pool_tile(x_tile, module, grid, group)
    if isinstance(module, nn.Upsample):
        return upsample_tile(x_tile, module, grid, group)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return batchnorm_tile(x_tile, module, group), grid
    if isinstance(module, nn.GroupNorm):
        return groupnorm_tile(x_tile, module, group), grid
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return instancenorm_tile(x_tile, module, group), grid
    if isinstance(module, POINTWISE):
        return module(x_tile), grid
    raise NotImplementedError(
        f"tile_forward: {type(module).__name__} is not tiled; end the spatial region before it "
        f"(gather the tiles with TileGrid.gather)"
    )


def sum_weight_grads(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """All-reduce (SUM, never average) every parameter gradient of ``module`` over the tiles.

    Each rank's ``.grad`` holds its tile's contribution; afterwards every rank holds the
    gradient of the unsplit op. Parameters that require grad but have none get a zero
    gradient first, so that every rank takes part in the same collective.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for ps in by_dtype.values():
        grads = [p.grad for p in ps if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
