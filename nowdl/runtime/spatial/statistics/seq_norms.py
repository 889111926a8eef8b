"""Norms on sequential tiles: the whole image's statistics, gathered in passes over the sub-tiles.

[Note: sequential norms] A stage on sequential tiles ([Note: sequential tiles]) runs every
sub-tile through the whole stage, but BatchNorm (training), InstanceNorm and GroupNorm normalise
with statistics over the whole image (over the batch too, for BatchNorm). Each norm gets a
*chunk* per sub-tile: its GPU's tile of the norm's input, cut like the stage's outputs into the
sub-tiles' regions, at the norm's resolution. The chunks tile the image once, and each lies in
its sub-tile's window at least the norm's reach ([Note: stage reach]) from a cut edge (the
window is widened to make it so), so its values are the whole image's.

Forward: the norms' *levels* (1 + the most norms on a path before it) order the statistics
passes. Pass k runs every sub-tile through only the nodes the level-k norms read, the norms of
lower levels applying the statistics already known, and hands each level-k chunk to
:class:`~nowdl.runtime.spatial.statistics.accumulate.Statistics` (float64 shifted sums, Chan's combination,
one all-reduce of rank slots over the tile group: [Note: statistics accumulation]); running
statistics are updated then, once per micro-batch, as one device does
(:func:`~nowdl.runtime.spatial.norms.update_running`). The pass that keeps the outputs applies
every norm's statistics: ``x * scale + shift``, computed in float64 and rounded once.

Backward: with ``xhat`` the normalised input and ``g = dL/dy * weight``, a norm's input gradient
is ``rstd * (g - mean(g) - xhat * mean(g * xhat))``, the means over the whole image. A sub-tile's
recomputation gives ``g`` from its own kept outputs; summed over the sub-tiles it is the whole
image's ``g`` (as for the window gradients), so the sums of ``g`` and ``g * xhat`` over each
window add up to the whole image's. The mean terms are not local: each sub-tile adds them on its
chunk only, so every pixel gets them once. The backward levels (1 + the most norms on a path
after it) order the backward passes: pass k recomputes every sub-tile and takes the gradient at
the outputs of the level-k norms only (lower levels use their means, known already), sums them,
and all-reduces the slots. The last pass is the backward without norms' passes. So a stage whose
norms sit K deep costs K prefix forwards more in the forward, and K recomputations and partial
backwards more in the backward (``partitioner.costs.sequential_tiles``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import Tensor, nn

from nowdl.errors import NowdlError
from nowdl.runtime.launch import comm
from nowdl.runtime.spatial.norms import update_running
from nowdl.runtime.spatial.precision import opmath
from nowdl.runtime.spatial.reach import SEQ_NORMS
from nowdl.runtime.spatial.statistics.accumulate import Statistics, StatOp, stat_op

__all__ = ["NormLevels", "norm_levels", "image_stats", "NormPasses", "NormRun", "ShapeRun", "seq_norm_nodes"]

_F64 = torch.float64
Slices = tuple[slice, ...]


def image_stats(m: nn.Module) -> bool:
    """Whether norm module ``m`` normalises with its input's statistics in its current mode."""
    if isinstance(m, nn.GroupNorm):
        return True
    if isinstance(m, nn.modules.instancenorm._InstanceNorm):
        return m.training or not m.track_running_stats
    return m.training or getattr(m, "running_mean", None) is None


def seq_norm_nodes(gm: fx.GraphModule) -> list[str]:
    """The nodes of ``gm`` that call a norm module sequential tiles combine ([Note: sequential norms])."""
    return [n.name for n in gm.graph.nodes if n.op == "call_module" and type(gm.get_submodule(str(n.target))) in SEQ_NORMS]


@dataclass(frozen=True)
class NormLevels:
    """The norms of a stage: forward and backward levels, and what each forward pass runs."""

    fwd: dict[str, int]
    bwd: dict[str, int]
    needed: dict[int, frozenset[str]]  # forward level -> the nodes its pass runs

    @property
    def passes(self) -> tuple[int, int]:
        """(forward, backward) statistics passes."""
        return max(self.fwd.values(), default=0), max(self.bwd.values(), default=0)


def norm_levels(gm: fx.GraphModule, norms: Sequence[str]) -> NormLevels:
    """The :class:`NormLevels` of the nodes ``norms`` of ``gm``."""
    nodes = list(gm.graph.nodes)
    names = set(norms)
    depth: dict[str, int] = {}
    for n in nodes:
        d = max((depth[a.name] for a in n.all_input_nodes), default=0)
        depth[n.name] = d + (n.name in names)
    back: dict[str, int] = {}
    for n in reversed(nodes):
        d = max((back[u.name] for u in n.users), default=0)
        back[n.name] = d + (n.name in names)
    fwd = {n: depth[n] for n in norms}
    needed: dict[int, frozenset[str]] = {}
    for k in set(fwd.values()):
        seen: set[str] = set()
        todo = [n for n in nodes if fwd.get(n.name) == k]
        while todo:
            n = todo.pop()
            if n.name not in seen:
                seen.add(n.name)
                todo.extend(n.all_input_nodes)
        needed[k] = frozenset(seen)
    return NormLevels(fwd, {n: back[n] for n in norms}, needed)


def _expand(t: Tensor, op: StatOp, c: int, nd: int) -> Tensor:
    """Per-statistic values ``op.shape`` as a tensor broadcasting against ``(N, C, *spatial)``."""
    if op.reduce == "group":
        t = t.repeat_interleave(c // op.shape[1], 1)
    elif op.reduce == "batch":
        t = t[None]
    return t.reshape(*t.shape, *(1,) * nd)


def _per_stat(t: Tensor, op: StatOp) -> Tensor:
    """Sums of ``t`` ``(N, C, *spatial)`` per statistic, float64."""
    if op.reduce == "batch":
        return t.sum(dim=[0, *range(2, t.dim())], dtype=_F64)
    if op.reduce == "group":
        return t.reshape(t.shape[0], op.shape[1], -1).sum(-1, dtype=_F64)
    return t.sum(dim=list(range(2, t.dim())), dtype=_F64)


def _slot_sum(parts: list[Tensor], group: dist.ProcessGroup | None, alone: bool) -> list[Tensor]:
    """Every rank's ``parts`` summed over the tile group, in rank order (the same bits everywhere)."""
    mine = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.zeros(0, dtype=_F64)
    if not alone:
        size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        me = group.rank() if group is not None else dist.get_rank()
        slots = torch.zeros(size, mine.numel(), dtype=_F64, device=mine.device)
        slots[me] = mine
        comm.all_reduce(slots, op=dist.ReduceOp.SUM, group=group)
        mine = slots[0]
        for r in range(1, size):
            mine = mine + slots[r]
    out, at = [], 0
    for p in parts:
        out.append(mine[at:at + p.numel()].reshape(p.shape))
        at += p.numel()
    return out


@dataclass
class NormPasses:
    """One micro-batch's norms on sequential tiles: the statistics passes' state ([Note: sequential norms]).

    ``chunks[i][node]``: sub-tile ``i``'s chunk of the norm's input, in its window's pixels;
    ``sizes[node]``: the norm input's spatial size on the whole image.
    """

    gm: fx.GraphModule
    levels: NormLevels
    chunks: Sequence[dict[str, Slices]]
    sizes: dict[str, tuple[int, ...]]
    group: dist.ProcessGroup | None
    alone: bool
    mode: str = "apply"  # "fwd": forward pass ``level``; "bwd": backward pass ``level``; "apply"
    level: int = 0
    ops: dict[str, StatOp] = field(default_factory=dict)
    stats: Statistics = field(default_factory=Statistics)
    grad_means: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    taken: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)  # bwd pass: (x, y) of its norms
    _sums: dict[str, list[Tensor]] = field(default_factory=dict)
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)  # (samples, channels) of each norm's input
    _by_name: dict[str, fx.Node] = field(default_factory=dict)

    def module(self, node: str) -> nn.Module:
        return self.gm.get_submodule(str(self._node(node).target))

    def _node(self, name: str) -> fx.Node:
        if not self._by_name:
            self._by_name.update((n.name, n) for n in self.gm.graph.nodes)
        return self._by_name[name]

    def active(self) -> list[str]:
        """The norms that take their input's statistics now (eval BatchNorm is a pointwise map)."""
        return [n for n in self.levels.fwd if image_stats(self.module(n))]

    def count(self, node: str) -> int:
        """The values behind each statistic of ``node`` on the whole image."""
        op, per = self.ops[node], math.prod(self.sizes[node])
        n, c = self.counts[node]
        return per * (n if op.reduce == "batch" else c // op.shape[1] if op.reduce == "group" else 1)

    # ---- one norm call --------------------------------------------------------------------------
    def norm(self, node: str, x: Tensor, sub: int) -> Tensor:
        m = self.module(node)
        if not image_stats(m):
            return m(x)  # type: ignore[no-any-return]
        if node not in self.ops:
            self.ops[node] = stat_op(self.gm, self._node(node), self.levels.fwd[node], x.shape)
            self.counts[node] = (int(x.shape[0]), int(x.shape[1]))
        op = self.ops[node]
        if self.mode == "fwd" and self.levels.fwd[node] == self.level:
            self.stats.add(op, x[self.chunks[sub][node]], (), ())
            return x
        affine = getattr(m, "affine", True)
        w, b = (m.weight, m.bias) if affine else (None, None)
        y: Tensor = _HeldNorm.apply(x, w, b, self, node, sub)
        if self.mode == "bwd" and self.levels.bwd[node] == self.level:
            self.taken[node] = (x, y)
        return y

    def held(self, node: str, x: Tensor) -> tuple[Tensor, Tensor]:
        """(mean, 1 / std) of ``node`` on the whole image, broadcasting against ``x``, float64."""
        m, op = self.module(node), self.ops[node]
        mean, var = self.stats.held[node]
        c, nd = x.shape[1], x.dim() - 2
        rstd = torch.rsqrt(var + float(m.eps))  # type: ignore[arg-type]
        return _expand(mean, op, c, nd), _expand(rstd, op, c, nd)

    # ---- the passes -------------------------------------------------------------------------------
    def finish_fwd(self, device: torch.device) -> None:
        ops = [o for n, o in self.ops.items() if self.levels.fwd[n] == self.level]
        self.stats.finish(ops, {o.node: self.sizes[o.node] for o in ops}, device, self.group, self.alone)
        for o in ops:
            m = self.module(o.node)
            mean, var = self.stats.held[o.node]
            if not isinstance(m, nn.GroupNorm):
                update_running(m, mean, var, self.count(o.node))

    def add_grads(self, roots: Sequence[Tensor], seeds: Sequence[Tensor]) -> None:
        """Add one sub-tile's sums of ``g`` and ``g * xhat`` at the outputs of this backward pass's
        norms (``taken``), from its kept outputs ``roots`` seeded with ``seeds``."""
        want = [(node, x, y) for node, (x, y) in self.taken.items() if y.requires_grad]
        self.taken = {}
        if not roots or not want:
            return
        grads = torch.autograd.grad(roots, [y for _, _, y in want], seeds, allow_unused=True)
        for (node, x, _), gy in zip(want, grads, strict=True):
            if gy is not None:
                self.add_grad(node, x, gy)

    def add_grad(self, node: str, x: Tensor, gy: Tensor) -> None:
        """Add one sub-tile's sums of ``g`` and ``g * xhat`` of norm ``node`` from its input ``x`` and
        the gradient ``gy`` at its output."""
        m, op = self.module(node), self.ops[node]
        acc = opmath(x.dtype)  # the input's precision (float32 for bf16/fp16); the sums in float64
        w = m.weight if getattr(m, "affine", True) else None
        g = gy.to(acc)
        if isinstance(w, Tensor):
            g = g * w.detach().to(acc).reshape(1, -1, *(1,) * (x.dim() - 2))
        del gy
        a = _per_stat(g, op)
        xhat = _xhat(x.detach(), *self.held(node, x), acc)
        b = _per_stat(xhat.mul_(g), op)  # g * xhat, in place: two window-sized temporaries at most
        del g, xhat
        old = self._sums.get(node)
        self._sums[node] = [a, b] if old is None else [old[0] + a, old[1] + b]

    def finish_bwd(self) -> None:
        nodes = [n for n in self.ops if self.levels.bwd[n] == self.level]
        parts: list[Tensor] = []
        for n in nodes:
            parts.extend(self._sums.pop(n, [torch.zeros(self.ops[n].shape, dtype=_F64)] * 2))
        done = _slot_sum(parts, self.group, self.alone)
        for i, n in enumerate(nodes):
            count = float(self.count(n))
            self.grad_means[n] = (done[2 * i] / count, done[2 * i + 1] / count)


def _xhat(x: Tensor, mean: Tensor, rstd: Tensor, acc: torch.dtype) -> Tensor:
    """``(x - mean) * rstd`` in ``acc``, one new window-sized tensor."""
    return torch.sub(x.to(acc), mean.to(acc)).mul_(rstd.to(acc))


class _HeldNorm(torch.autograd.Function):
    """A norm with the whole image's statistics on one sub-tile window ([Note: sequential norms])."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None,  # type: ignore[override]
                passes: NormPasses, node: str, sub: int) -> Tensor:
        mean, rstd = passes.held(node, x)
        view = (1, -1, *(1,) * (x.dim() - 2))
        scale = rstd if weight is None else rstd * weight.detach().to(_F64).view(view)
        shift = -mean * scale if bias is None else bias.detach().to(_F64).view(view) - mean * scale
        acc = opmath(x.dtype)
        ctx.passes, ctx.node, ctx.sub = passes, node, sub
        ctx.save_for_backward(x, weight)
        return torch.addcmul(shift.to(acc), x.to(acc), scale.to(acc)).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        passes: NormPasses = ctx.passes
        mean, rstd = passes.held(ctx.node, x)
        acc = opmath(x.dtype)
        view = (1, -1, *(1,) * (x.dim() - 2))
        dims = [0, *range(2, x.dim())]
        xhat = _xhat(x, mean, rstd, acc)
        gya = gy.to(acc)
        gw = (gya * xhat).sum(dims).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        gb = gya.sum(dims).to(weight.dtype) if weight is not None and ctx.needs_input_grad[2] else None
        gx = None
        if ctx.needs_input_grad[0]:
            if ctx.node not in passes.grad_means:
                raise NowdlError(f"node {ctx.node!r}: its backward ran before its gradient means were gathered; "
                                 "report this")
            scale = rstd if weight is None else rstd * weight.detach().to(_F64).view(view)
            gx = gya * scale.to(acc)  # g * rstd
            del gya
            a, b = passes.grad_means[ctx.node]
            op = passes.ops[ctx.node]
            c, nd = x.shape[1], x.dim() - 2
            sl = passes.chunks[ctx.sub][ctx.node]
            part = xhat[sl].mul_(_expand(b, op, c, nd).to(acc)).add_(_expand(a, op, c, nd).to(acc))
            gx[sl] -= part.mul_(rstd.to(acc))  # the mean terms on the chunk only, in place
            del part, xhat
            gx = gx.to(x.dtype)
        return gx, gw, gb, None, None, None


class NormRun(fx.Interpreter):
    """Runs a stage's fx module on one sub-tile window, its norms as ``passes`` says; in a forward
    statistics pass only the nodes its level's norms read."""

    def __init__(self, gm: fx.GraphModule, passes: NormPasses, sub: int) -> None:
        super().__init__(gm)
        self.passes, self.sub = passes, sub
        self.norms = set(passes.active())
        self.needed = passes.levels.needed.get(passes.level) if passes.mode == "fwd" else None

    def run_node(self, n: fx.Node) -> Any:
        if self.needed is not None and n.name not in self.needed:
            return None
        if n.name in self.norms:
            args, _ = self.fetch_args_kwargs_from_env(n)
            return self.passes.norm(n.name, args[0], self.sub)
        return super().run_node(n)


class ShapeRun(fx.Interpreter):
    """Runs a stage's fx module (on fake tensors, for shapes) with its norms as the identity
    (no running statistics touched), recording each norm input's spatial shape in ``sizes``."""

    def __init__(self, gm: fx.GraphModule, norms: Sequence[str]) -> None:
        super().__init__(gm)
        self.norms = set(norms)
        self.sizes: dict[str, tuple[int, ...]] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.name in self.norms:
            args, _ = self.fetch_args_kwargs_from_env(n)
            self.sizes[n.name] = tuple(int(v) for v in args[0].shape[2:])
            return args[0]
        return super().run_node(n)
