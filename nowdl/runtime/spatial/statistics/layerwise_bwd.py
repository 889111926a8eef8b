"""The layer-wise backward of norms on sequential tiles: one segment of the stage at a time, from the outputs.

[Note: layer-wise backward] The statistics passes' backward ([Note: sequential norms])
recomputes the whole stage on every sub-tile once per backward level to take the gradient at
that level's norms. Layer-wise, a node's *backward level* is the most norms on a path from it to
the stage's outputs, and the nodes of level j make *segment* j (segment 0 ends at the outputs;
the level-j norms lie in segment j). The forward (layer-wise, [Note: layer-wise norms]) keeps in
host memory, per sub-tile, every value that a node of a lower level reads (the *boundary*).
Pass j = 0, 1, ..., K then, per sub-tile:

1. (j >= 1) runs, without autograd, the part of segment j that the level-j norms read, from the
   boundary values, and adds the sums of ``g`` and ``g * xhat`` at those norms (their output
   gradients are whole: every user lies in a lower segment, done already); the sums are
   all-reduced as in the passes;
2. recomputes segment j with autograd from the boundary values (leaves) and the sub-tile's
   input window, seeds it with the gradients that the lower segments left at its boundary nodes
   (and, in segment 0, with the sub-tile's output gradient), and adds the gradients it gives to
   the boundary values it read (in host memory), the input window and the parameters.

Per sub-tile this is the chain rule of its own backward cut into segments, so the window and
weight gradients are the statistics passes' (float64: to rounding; the additions come in
another order). Each node runs its forward about twice (once in 2., once more in 1. where a norm
of its segment reads it) and its backward once, against ``K`` recomputations and partial
backwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from nowdl.runtime.spatial.statistics.layerwise import HostCache
from nowdl.runtime.spatial.statistics.seq_norms import NormPasses, NormRun

__all__ = ["SegmentRun", "layerwise_backward"]


class SegmentRun(NormRun):
    """Runs ``nodes`` (a segment, or its part the norms read) of a sub-tile, taking the values of
    the other nodes they read from ``fwd`` (as leaves that take a gradient when ``grad``)."""

    def __init__(self, gm: fx.GraphModule, passes: NormPasses, sub: int, nodes: frozenset[str], fwd: HostCache,
                 grad: bool) -> None:
        super().__init__(gm, passes, sub)
        self.needed = None
        self.nodes, self.fwd, self.grad = nodes, fwd, grad
        self.leaves: dict[str, Tensor] = {}
        self.made: dict[str, Tensor] = {}  # boundary nodes of the segment: their recomputed values

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "get_attr") or n.name in self.nodes:  # placeholders: the arguments, in order
            out = super().run_node(n)
            if n.name in self.fwd.plan.boundary and isinstance(out, Tensor):
                self.made[n.name] = out
            return out
        if n.name in self.fwd.plan.boundary and any(u.name in self.nodes for u in n.users):
            t = self.fwd.get(self.sub, n.name).detach().requires_grad_(self.grad)
            self.leaves[n.name] = t
            return t.clone() if self.grad else t  # an in-place user (ReLU(inplace=True)) must not touch the leaf
        return None


def layerwise_backward(gm: fx.GraphModule, passes: NormPasses, subs: Sequence[Any], wins: Sequence[Tensor],
                       gys: Sequence[Tensor | None], need_w: Sequence[bool], params: Sequence[Tensor],
                       fwd: HostCache, roots_of: Any, keyed: Any = None) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """The input-window and parameter gradients of one micro-batch ([Note: layer-wise backward]).

    ``subs``: the sub-tiles' layouts (``ins``: their windows' slices); ``params``: those that take
    a gradient; ``roots_of(ys, gys, sub)``: a sub-tile's kept outputs and their gradients;
    ``keyed(i)``: the context sub-tile ``i`` runs in (its dropout's keys, [Note: keyed dropout])."""
    keyed = keyed or (lambda i: contextlib.nullcontext())
    plan = fwd.plan
    grads = HostCache(fwd.device, len(subs), plan, meter=fwd.meter)
    gw: list[Tensor | None] = [torch.zeros_like(w) if nd else None for w, nd in zip(wins, need_w, strict=True)]
    gp: list[Tensor | None] = [None] * len(params)
    for j in range(max(plan.segment) + 1):
        if j >= 1:  # the level-j norms' gradient means
            passes.mode, passes.level = "bwd", j
            with torch.no_grad():
                for i, sub in enumerate(subs):
                    run = SegmentRun(gm, passes, i, plan.sums[j], fwd, grad=False)
                    with keyed(i):
                        run.run(*[w[sl] for w, sl in zip(wins, sub.ins, strict=True)])
                    for node, (x, _) in passes.taken.items():
                        if node in grads.values[i]:
                            passes.add_grad(node, x, grads.get(i, node))
                    passes.taken = {}
            passes.finish_bwd()
        passes.mode = "apply"
        for i, sub in enumerate(subs):
            xs = [w[sl].detach().requires_grad_(nd) for w, sl, nd in zip(wins, sub.ins, need_w, strict=True)]
            run = SegmentRun(gm, passes, i, plan.segment[j], fwd, grad=True)
            with keyed(i):
                ys = run.run(*xs)
            roots, seeds = roots_of(ys, gys, sub) if j == 0 else ([], [])
            for node, t in run.made.items():
                if node in grads.values[i] and t.requires_grad:
                    roots.append(t)
                    seeds.append(grads.get(i, node))
            if not roots:
                continue
            leaves = list(run.leaves.items())
            want = [t for _, t in leaves] + [x for x in xs if x.requires_grad] + list(params)
            got = torch.autograd.grad(roots, want, seeds, allow_unused=True)
            del roots, seeds, ys, run
            it = iter(got)
            for node, _ in leaves:
                g = next(it)
                if g is not None:
                    grads.add(i, node, g)
            for k, (x, sl) in enumerate(zip(xs, sub.ins, strict=True)):
                if x.requires_grad:
                    g = next(it)
                    if g is not None:
                        gw[k][sl] += g  # type: ignore[index]
            for k, g in enumerate(it):
                if g is not None:
                    gp[k] = g if gp[k] is None else gp[k] + g  # type: ignore[operator]
        grads.keep_only(frozenset(v for v in plan.boundary if plan.back[v] > j))  # the next segments' seeds
    grads.release()
    fwd.release()  # the micro-batch's host memory, given back
    return gw, gp
