"""Sequential tiles inside predict's statistics passes: every sub-tile hands its chunks to predict.

[Note: sequential tiles in statistics passes] When predict streams an image in windows
([Note: statistics passes] in runtime/predict/passes.py), a stage on sequential tiles
([Note: sequential tiles]) must not take its norms' statistics over the window (its own
statistics passes over the sub-tiles would): predict sets ``SequentialTiles.external`` to its
:class:`StreamHook`, and while a statistics pass or the writing pass runs, each window's forward
runs every sub-tile ONCE with :class:`StreamRun`: each norm module predict streams gets its input
on the sub-tile's window and the sub-tile's *chunk* of it ([Note: sequential norms]: the chunks
of a rank's sub-tiles tile its tile of the window once, and each chunk's values are the whole
window's), with the chunk's place in the window at the norm's resolution. Predict keeps the part
of the chunk inside the window's core (pass k's norms), or applies the whole image's statistics
(earlier passes' norms, and all of them in the writing pass). Values a statistics pass does not
need (predict's ``skips``) are not computed; a stage output nothing needs is zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch.fx as fx
from torch import Tensor, nn

__all__ = ["StreamHook", "StreamRun", "stream_forward"]

Slices = tuple[slice, ...]
Spans = tuple[tuple[int, int], ...]


class StreamHook(Protocol):
    """What predict's statistics passes offer a stage on sequential tiles."""

    current: int
    passes: int

    def hooks(self, name: str) -> bool:
        """Whether predict streams node ``name`` (a norm module of the stage)."""

    def skipped(self, name: str) -> bool:
        """Whether the statistics pass now running does not need node ``name``'s value."""

    def chunk(self, name: str, module: nn.Module, x: Tensor, chunk: Slices, spans: Spans, sizes: Sequence[int],
              original: Callable[[], Tensor]) -> Tensor:
        """Norm ``name`` on a sub-tile window ``x``: ``x[chunk]`` lies at ``spans`` of the window's
        ``sizes`` pixels at the norm's resolution."""


class StreamRun(fx.Interpreter):
    """A stage's fx module on one sub-tile window under predict's statistics passes."""

    def __init__(self, gm: fx.GraphModule, hook: StreamHook, chunks: dict[str, Slices], spans: dict[str, Spans],
                 sizes: dict[str, tuple[int, ...]]) -> None:
        super().__init__(gm)
        self.hook, self.chunks, self.spans, self.sizes = hook, chunks, spans, sizes

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in ("placeholder", "output") and self.hook.skipped(n.name):
            return None
        if n.name in self.chunks and self.hook.hooks(n.name):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            m = self.module.get_submodule(str(n.target))
            return self.hook.chunk(n.name, m, args[0], self.chunks[n.name], self.spans[n.name], self.sizes[n.name],
                                   lambda: m(*args, **kwargs))
        return super().run_node(n)


def stream_forward(gm: fx.GraphModule, hook: StreamHook, subs: Sequence[Any], wins: Sequence[Tensor],
                   heads: Sequence[tuple[int, ...]], extents: Sequence[tuple[int, ...]],
                   sizes: dict[str, tuple[int, ...]]) -> list[Tensor]:
    """This rank's output tiles of a stage on sequential tiles, each sub-tile run once with
    :class:`StreamRun` (``subs``: the layout's sub-tiles, with ``ins``, ``outs``, ``chunks`` and
    ``spans``; ``heads``: each output's channels; ``extents``: each output tile's spatial shape)."""
    outs: list[Tensor | None] = [None] * len(extents)
    for sub in subs:
        ys = StreamRun(gm, hook, sub.chunks, sub.spans, sizes).run(*[w[sl] for w, sl in zip(wins, sub.ins, strict=True)])
        for o, (y, (crop, place)) in enumerate(zip(ys, sub.outs, strict=True)):
            if y is None:
                continue
            if outs[o] is None:
                outs[o] = y.new_zeros((*y.shape[:2], *extents[o]))
            outs[o][place] = y[crop]  # type: ignore[index]
        del ys
    n = int(wins[0].shape[0])
    return [o if o is not None else wins[0].new_zeros((n, *heads[k][1:], *extents[k])) for k, o in enumerate(outs)]
