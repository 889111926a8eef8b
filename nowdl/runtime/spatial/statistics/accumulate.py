"""Whole-image statistics of a streamed image: what each op gathers, how chunks combine, how they apply.

[Note: statistics accumulation] A statistics pass hands :class:`Statistics` one *chunk* of an
op's input per window and rank: the part of the rank's tile inside the window's core (cores tile
the image once, tiles tile the window once, so the chunks tile the image once). A norm's chunk
gives, per statistic (InstanceNorm: sample and channel; GroupNorm: sample and group; BatchNorm:
channel), its count, mean and centred sum of squares from *shifted sums*: shifted by the chunk's
own mean K in the input's precision, ``s1 = sum(x - K)`` and ``s2 = sum((x - K)^2)`` are summed
in float64, so ``mean = K + s1 / n`` and ``M2 = s2 - s1^2 / n`` lose nothing to cancellation.
Chunks combine by Chan et al.'s pairwise update (Welford's for blocks) in float64. At the end of
a pass every rank puts its (count, mean, M2) in its own slot of a zero buffer, one all-reduce
sums the slots (each has one non-zero term: exact), and every rank combines the slots in rank
order: the same bits everywhere. A pooling's chunk adds its per-bin sums (average, in float64)
or maxima to the bins ATen's adaptive pooling uses on the whole image (``[floor(j L / b),
ceil((j + 1) L / b))``); averages divide by the whole bins' sizes.

Applying them: a norm is then a per-channel affine map ``x * scale + shift`` (scale and shift
from the float64 statistics and the op's weight and bias, rounded once to the input's dtype), a
pooling returns the whole image's pooled tensor.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from nowdl.errors import NowdlError
from nowdl.geometry import ntuple
from nowdl.runtime.launch import comm
from nowdl.runtime.spatial.precision import opmath

__all__ = ["StatOp", "stat_op", "Statistics"]

_F64 = torch.float64
_aten = torch.ops.aten
#: functional norms: (how they reduce, index of num_groups or -1, of weight, of bias, of eps)
_NORM_ARGS: dict[Any, tuple[str, int, int, int, int]] = {
    F.instance_norm: ("instance", -1, 3, 4, 7), F.group_norm: ("group", 1, 2, 3, 4),
    F.batch_norm: ("batch", -1, 3, 4, 7), _aten.instance_norm.default: ("instance", -1, 1, 2, 7),
    _aten.group_norm.default: ("group", 1, 2, 3, 4), _aten.batch_norm.default: ("batch", -1, 1, 2, 7),
}


@dataclass(frozen=True)
class StatOp:
    """One op whose whole-image statistics a statistics pass gathers.

    Attributes:
        node: the fx node.
        stat_pass: the pass that gathers them ([Note: whole-image ops]).
        reduce: ``instance``, ``group`` or ``batch`` (norms), ``avg`` or ``max`` (poolings).
        shape: the statistics' shape: ``(N, C)``, ``(N, G)``, ``(C,)`` or ``(N, C, *bins)``.
        spatial: the spatial shape of its input on a window (the traced example's).
        keep: a pooling's output keeps its spatial dims (a mean without keepdim does not).
    """

    node: str
    stat_pass: int
    reduce: str
    shape: tuple[int, ...]
    spatial: tuple[int, ...]
    keep: bool = True

    @property
    def is_norm(self) -> bool:
        return self.reduce in ("instance", "group", "batch")


def _arg(node_args: Sequence[Any], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return node_args[index] if 0 <= index < len(node_args) else default


def stat_op(gm: fx.GraphModule, node: fx.Node, stat_pass: int, in_shape: Sequence[int]) -> StatOp:
    """The :class:`StatOp` of ``node`` (a norm or pooling :func:`~nowdl.partitioner.spatial.whole_image.stream_kind`
    accepts) whose input is shaped ``in_shape`` ``(N, C, *spatial)``."""
    n, c, nd = int(in_shape[0]), int(in_shape[1]), len(in_shape) - 2
    sp = tuple(int(s) for s in in_shape[2:])
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if isinstance(m, nn.GroupNorm):
            return StatOp(node.name, stat_pass, "group", (n, m.num_groups), sp)
        if isinstance(m, nn.modules.instancenorm._InstanceNorm):
            return StatOp(node.name, stat_pass, "instance", (n, c), sp)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return StatOp(node.name, stat_pass, "batch", (c,), sp)
        how = "max" if "Max" in type(m).__name__ else "avg"
        return StatOp(node.name, stat_pass, how, (n, c, *ntuple(m.output_size, nd)), sp)
    if node.op == "call_function" and node.target in _NORM_ARGS:
        how, g = _NORM_ARGS[node.target][:2]
        shape = (n, int(_arg(node.args, dict(node.kwargs), g, "num_groups", 1))) if how == "group" else (
            (c,) if how == "batch" else (n, c))
        return StatOp(node.name, stat_pass, how, shape, sp)
    name = getattr(node.target, "__name__", str(node.target))
    if "adaptive" in name:
        size = _arg(node.args, dict(node.kwargs), 1, "output_size", 1)
        return StatOp(node.name, stat_pass, "max" if "max" in name else "avg", (n, c, *ntuple(size, nd)), sp)
    keep = bool(_arg(node.args, dict(node.kwargs), 2, "keepdim", False))  # a mean over the spatial dims
    return StatOp(node.name, stat_pass, "avg", (n, c, *(1,) * nd), sp, keep)


def norm_affine(op: StatOp, module: nn.Module | None, target: Any, args: Sequence[Any], kwargs: dict[str, Any]
                ) -> tuple[Tensor | None, Tensor | None, float]:
    """(weight, bias, eps) of a norm call: from its module, or from the function's arguments."""
    if module is not None:
        affine = getattr(module, "affine", True)
        w: Any = module.weight if affine else None
        b: Any = module.bias if affine else None
        return w, b, float(module.eps)  # type: ignore[arg-type]
    _, _, wi, bi, ei = _NORM_ARGS[target]
    eps = _arg(args, kwargs, ei, "eps", 1e-5)
    return _arg(args, kwargs, wi, "weight", None), _arg(args, kwargs, bi, "bias", None), float(eps)


def _moments(x: Tensor, op: StatOp) -> tuple[Tensor, Tensor, Tensor]:
    """(count, mean, M2) per statistic of one chunk, float64, by shifted sums."""
    n_, c = x.shape[:2]
    if op.reduce == "batch":
        v = x.transpose(0, 1).reshape(c, -1)
    else:
        v = x.reshape(n_, op.shape[1], -1)
    count = v.shape[-1]
    shift = v.mean(-1, keepdim=True, dtype=opmath(x.dtype)).to(x.dtype)
    d = v - shift
    s1 = d.sum(-1, dtype=_F64)
    s2 = d.square().sum(-1, dtype=_F64)
    n = torch.full_like(s1, float(count))
    return n, shift.squeeze(-1).to(_F64) + s1 / count, s2 - s1 * s1 / count


def _chan(a: tuple[Tensor, Tensor, Tensor], b: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Chan et al.'s pairwise combination of two (count, mean, M2) blocks (either may be empty)."""
    na, ma, qa = a
    nb, mb, qb = b
    n = na + nb
    safe = torch.where(n > 0, n, torch.ones_like(n))
    delta = mb - ma
    return n, ma + delta * nb / safe, qa + qb + delta * delta * na * nb / safe


def _bins(length: int, bins: int) -> list[tuple[int, int]]:
    """ATen's adaptive pooling bins of a ``length`` axis: [floor(j L / b), ceil((j + 1) L / b))."""
    return [((j * length) // bins, -((-(j + 1) * length) // bins)) for j in range(bins)]


@dataclass
class Statistics:
    """The statistics of one pass's ops: chunks accumulated, combined over the ranks, then held.

    ``held[node]``: a norm's ``(mean, var)`` (biased, float64), a pooling's pooled tensor (float64).
    """

    held: dict[str, Any] = field(default_factory=dict)
    _acc: dict[str, Any] = field(default_factory=dict)
    _affine: dict[str, Any] = field(default_factory=dict)  # per norm: (key, statistics, scale, shift)

    def add(self, op: StatOp, chunk: Tensor, start: Sequence[int], length: Sequence[int]) -> None:
        """Add one chunk of ``op``'s input: ``chunk`` ``(N, C, *spatial)`` starts at ``start`` in the
        whole image's pixels at the op's resolution, of ``length`` pixels per dim."""
        if chunk.numel() == 0:
            return
        if op.is_norm:
            m = _moments(chunk, op)
            self._acc[op.node] = m if op.node not in self._acc else _chan(self._acc[op.node], m)
            return
        acc = self._acc.get(op.node)
        if acc is None:
            acc = self._acc[op.node] = torch.full(op.shape, -math.inf if op.reduce == "max" else 0.0, dtype=_F64,
                                                  device=chunk.device)
        per_dim = []
        for d, (b, lo, ln) in enumerate(zip(op.shape[2:], start, length, strict=True)):
            hi = lo + chunk.shape[2 + d]
            per_dim.append([(j, max(a, lo) - lo, min(e, hi) - lo) for j, (a, e) in enumerate(_bins(ln, b))
                            if max(a, lo) < min(e, hi)])
        for cells in itertools.product(*per_dim):
            part = chunk[(slice(None), slice(None), *(slice(a, e) for _, a, e in cells))]
            idx: Any = (slice(None), slice(None), *(j for j, _, _ in cells))
            if op.reduce == "max":
                acc[idx] = torch.maximum(acc[idx], part.amax(dim=tuple(range(2, part.dim()))).to(_F64))
            else:
                acc[idx] += part.sum(dim=tuple(range(2, part.dim())), dtype=_F64)

    def finish(self, ops: Sequence[StatOp], lengths: dict[str, tuple[int, ...]], device: torch.device,
               group: dist.ProcessGroup | None = None, alone: bool = False) -> None:
        """Combine every rank's chunks of ``ops`` (collective over ``group``, None: the world; every
        rank calls it with the same ops; ``alone``: this rank's chunks only, no collective) and hold
        the whole image's statistics; ``lengths[node]``: the image's size at the op's resolution."""
        sizes = [3 * math.prod(o.shape) if o.is_norm else math.prod(o.shape) for o in ops]
        mine = torch.zeros(sum(sizes), dtype=_F64, device=device)
        at = 0
        for o, size in zip(ops, sizes, strict=True):
            acc = self._acc.pop(o.node, None)
            if o.is_norm and acc is not None:
                mine[at:at + size] = torch.cat([t.reshape(-1).to(device) for t in acc])
            elif not o.is_norm:
                mine[at:at + size] = acc.reshape(-1).to(device) if acc is not None else (
                    -math.inf if o.reduce == "max" else 0.0)
            at += size
        world = 1 if alone or not (dist.is_available() and dist.is_initialized()) else (
            dist.get_world_size(group) if group is not None else dist.get_world_size())
        slots = mine[None]
        if world > 1:
            slots = torch.zeros(world, mine.numel(), dtype=_F64, device=device)
            slots[group.rank() if group is not None else dist.get_rank()] = mine
            comm.all_reduce(slots, op=dist.ReduceOp.SUM, group=group)
        at = 0
        for o, size in zip(ops, sizes, strict=True):
            part = slots[:, at:at + size]
            at += size
            if o.is_norm:
                k = size // 3
                total = (part[0, :k], part[0, k:2 * k], part[0, 2 * k:])
                for r in range(1, world):
                    total = _chan(total, (part[r, :k], part[r, k:2 * k], part[r, 2 * k:]))
                n, mean, m2 = total
                if bool((n == 0).any()):
                    raise NowdlError(f"node {o.node!r}: no pixel of the image reached it in the statistics pass "
                                     f"{o.stat_pass}: the windows' cores do not cover the image; report this")
                self.held[o.node] = (mean.reshape(o.shape), (m2 / n).reshape(o.shape))
            elif o.reduce == "max":
                self.held[o.node] = part.amax(0).reshape(o.shape)
            else:
                count = torch.ones((), dtype=_F64)
                for b, ln in zip(o.shape[2:], lengths[o.node], strict=True):
                    sz = torch.tensor([e - a for a, e in _bins(ln, b)], dtype=_F64)
                    count = count[..., None] * sz
                self.held[o.node] = (part.sum(0).reshape(o.shape) / count.to(device)).reshape(o.shape)

    def apply_norm(self, op: StatOp, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
        """``op`` on ``x`` (a window or a tile of it) with the whole image's statistics (its scale and
        shift kept while the statistics, weight and bias stay the same)."""
        held = self.held[op.node]
        key = (id(held), id(weight), weight._version if weight is not None else 0, id(bias),
               bias._version if bias is not None else 0, x.shape[1], x.dim(), x.dtype, x.device, eps)
        got = self._affine.get(op.node)
        if got is None or got[0] != key:
            got = self._affine[op.node] = (key, held, *self._scale_shift(op, x, weight, bias, eps))
        return torch.addcmul(got[3], x.to(got[2].dtype), got[2]).to(x.dtype)

    def _scale_shift(self, op: StatOp, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
                     ) -> tuple[Tensor, Tensor]:
        mean, var = self.held[op.node]
        c = x.shape[1]
        if op.reduce == "group":
            mean, var = mean.repeat_interleave(c // op.shape[1], 1), var.repeat_interleave(c // op.shape[1], 1)
        elif op.reduce == "batch":
            mean, var = mean[None], var[None]
        scale = torch.rsqrt(var.to(x.device) + eps)
        if weight is not None:
            scale = scale * weight.detach().to(_F64)
        shift = -mean.to(x.device) * scale
        if bias is not None:
            shift = shift + bias.detach().to(_F64)
        view = (*scale.shape, *(1,) * (x.dim() - 2))
        acc = opmath(x.dtype)
        return scale.to(acc).view(view), shift.to(acc).view(view)

    def pooled(self, op: StatOp, like: Tensor) -> Tensor:
        """``op``'s output: the whole image's pooled tensor, in ``like``'s dtype and device."""
        y = self.held[op.node].to(device=like.device, dtype=like.dtype)
        return y if op.keep else y.reshape(y.shape[:2])
