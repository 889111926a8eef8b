"""Point-to-point transfers of one rank: which messages it expects, receive buffers, tiles' boxes.

[Note: communication] Every rank knows from the plan which values it receives, from whom, with
which shape: each receive is posted LOOKAHEAD actions before the action that needs it, into a
fresh buffer (no handshakes; live buffers stay bounded by the micro-batches in flight, as 1F1B
intends; see [Note: no buffer pool]); sends are isend, waited as soon as the receiver is known
to have posted the receive (``_release_done``: their tensors are freed then), the rest at the end
of the step. Every float value sent forward gets exactly one gradient back (zeros when the
consumer did not need it), so both sides agree on the messages without asking. Tags are unique
per (value, direction, replica, micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from nowdl.codegen.stage import StageModule
from nowdl.plan.plan import Plan
from nowdl.runtime.launch.group import wait
from nowdl.runtime.pipeline.ranks import Placement
from nowdl.runtime.spatial.exchange import Window, intersect
from nowdl.runtime.spatial.stage import full_grid
from nowdl.runtime.spatial.tiles import TileGrid
from nowdl.schedule import Action, rank_actions
from nowdl.schedule.orders import RECV_LOOKAHEAD

__all__ = ["Transfers", "LOOKAHEAD"]

LOOKAHEAD = RECV_LOOKAHEAD  # receives are posted this many actions ahead ([Note: held buffers])


_Recv = tuple[tuple[Any, ...], int, int, str, tuple[int, ...]]  # key, peer, tag, value, shape


@dataclass
class _StepReceives:
    """The receives of one step: per action, what it needs; what is posted so far."""

    per_action: list[list[_Recv]]
    next_action: int = 0
    posted: dict[tuple[Any, ...], tuple[Any, int, torch.Tensor]] = field(default_factory=dict)


class Transfers:
    """The messages part of :class:`~nowdl.runtime.pipeline.engine.PipelineEngine` (a mixin: the engine
    sets the attributes below)."""

    plan: Plan
    place: Placement
    stages: dict[int, StageModule]
    actions: list[Action]
    m: int
    k: int
    dp_index: int
    part: dict[tuple[int, int], int]
    parts: list[int]
    device: torch.device
    timeout_s: float
    comm_dtype: torch.dtype | None
    _meta: dict[str, tuple[tuple[int, ...], torch.dtype]]
    _value_ids: dict[str, int]
    _programs: dict[int, dict[tuple[str, int, int, int], int]]
    _sent_at: dict[tuple[Any, ...], int]
    _boxes: dict[tuple[str, int, int], Window]
    _peer_done: dict[int, int]

    def _tag(self, value: str, backward: bool, rep: int, mb: int) -> int:
        return ((self._value_ids[value] * 2 + int(backward)) * self.place.replicas + rep) * self.m + mb

    def _peer(self, rep: int, stage: int, part: int = 0) -> int:
        return self.place.rank_of(self.dp_index, rep, stage, part)

    def _index(self, peer: int, kind: str, stage: int, mb: int, rep: int) -> int:
        """Where (kind, stage, micro-batch, replica) sits in ``peer``'s program for one step."""
        prog = self._programs.get(peer)
        if prog is None:
            prog = {(a.kind, a.stage, a.microbatch, a.replica): i for i, a in enumerate(rank_actions(self.plan, peer))}
            self._programs[peer] = prog
        return prog[(kind, stage, mb, rep)]

    def _expected_recvs(self, train: bool) -> list[list[_Recv]]:
        """For each action of this rank: every message it receives (one per sending part)."""
        out: list[list[_Recv]] = []
        for act in self.actions:
            st = self.stages[act.stage]
            me = (act.stage, self.part[(act.replica, act.stage)])
            mine: list[_Recv] = []
            if act.kind == "F":
                for name in st.inputs:
                    p = st.producers[name]
                    if p < 0:
                        continue
                    for i in range(self.parts[p]):
                        box = self._piece(name, (p, i), me)
                        if box is None:
                            continue
                        q = self._peer(act.replica, p, i)
                        key: tuple[Any, ...] = ("F", name, act.replica, act.microbatch, i)
                        mine.append((key, q, self._tag(name, False, act.replica, act.microbatch), name,
                                     self._piece_shape(name, box)))
                        self._sent_at[key] = self._index(q, "F", p, act.microbatch, act.replica)
            elif train and act.kind == "B":
                for name in st.outputs:
                    if not self._is_float(name):
                        continue
                    for c in st.consumers.get(name, []):
                        if c >= self.k:
                            continue
                        for j in range(self.parts[c]):
                            box = self._piece(name, me, (c, j))
                            if box is None:
                                continue
                            q = self._peer(act.replica, c, j)
                            key = ("B", name, c, act.replica, act.microbatch, j)
                            mine.append((key, q, self._tag(name, True, act.replica, act.microbatch), name,
                                         self._piece_shape(name, box)))
                            self._sent_at[key] = self._index(q, "B", c, act.microbatch, act.replica)
            out.append(mine)
        return out

    def _box(self, name: str, stage: int, part: int) -> Window:
        """The region (full-image coords per spatial dim) of ``name`` that ``part`` of ``stage`` holds."""
        key = (name, stage, part)
        box = self._boxes.get(key)
        if box is None:  # fixed by the plan: computed once, looked up on every message
            sp = self._meta[name][0][2:]
            if self.parts[stage] == 1:
                box = tuple((0, n) for n in sp)
            else:
                grid = full_grid(self.plan.stages[stage].grid, len(sp))
                box = TileGrid.for_rank(sp, grid, part, range(self.parts[stage])).tile_bounds()
            self._boxes[key] = box
        return box

    def _piece(self, name: str, src: tuple[int, int], dst: tuple[int, int]) -> Window | None:
        """What (stage, part) ``src`` sends of ``name`` to (stage, part) ``dst``: a box, or None."""
        if self.parts[src[0]] == 1 and self.parts[dst[0]] == 1:
            return ()  # the whole tensor
        return intersect(self._box(name, *src), self._box(name, *dst))

    def _piece_shape(self, name: str, box: Window) -> tuple[int, ...]:
        shape = self._meta[name][0]
        if not box:
            return shape
        return tuple(shape[:2]) + tuple(hi - lo for lo, hi in box)

    @staticmethod
    def _rel(box: Window, origin: Window) -> tuple[slice, ...]:
        if not box:
            return ()
        return (slice(None), slice(None)) + tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))

    def _is_float(self, name: str) -> bool:
        meta = self._meta.get(name)
        return meta is None or meta[1].is_floating_point

    def _alloc(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A fresh receive buffer. [Note: no buffer pool] Buffers are not recycled by hand: a
        received tensor's storage can outlive its micro-batch (autograd's AccumulateGrad steals
        an incoming gradient into ``.grad`` through a view, which is then sent on; a pass-through
        stage returns its input), and reusing it for the next receive corrupted those tensors
        (4-stage MASTER, GPipe). The allocator (CUDA's caching allocator, malloc on CPU) reuses
        memory once the last reference goes."""
        dtype = self._meta[name][1]
        if dtype.is_floating_point:
            dtype = self.comm_dtype or dtype
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _post_upto(self, rx: _StepReceives, idx: int) -> None:
        """Post the receives of actions up to ``idx + LOOKAHEAD`` (in program order)."""
        while rx.next_action < len(rx.per_action) and rx.next_action <= idx + LOOKAHEAD:
            for key, peer, tag, name, shape in rx.per_action[rx.next_action]:
                buf = self._alloc(name, shape)
                rx.posted[key] = (dist.irecv(buf, src=peer, tag=tag), peer, buf)
            rx.next_action += 1

    def _take(self, rx: _StepReceives, key: tuple[Any, ...], what: str) -> torch.Tensor:
        work, peer, buf = rx.posted.pop(key)
        wait(work, timeout_s=self.timeout_s, what=what, peer=peer)
        # the peer has run its program up to the action that sent this message
        self._peer_done[peer] = max(self._peer_done.get(peer, -1), self._sent_at[key])
        return buf

    def _send_input_grads(self, st: StageModule, ins: list[torch.Tensor], act: Action, me: tuple[int, int]
                          ) -> list[tuple[Any, str, torch.Tensor, int, int]]:
        """Send the gradients of a backward's inputs to their producers (a zero gradient where
        none flowed); returns the sends, which hold the pieces cut from them until completed."""
        sends: list[tuple[Any, str, torch.Tensor, int, int]] = []
        for name, t in zip(st.inputs, ins, strict=True):
            p = st.producers[name]
            if p < 0 or not t.is_floating_point():
                continue
            g = t.grad if t.grad is not None else torch.zeros_like(t)
            for i in range(self.parts[p]):
                box = self._piece(name, (p, i), me)
                if box is None:
                    continue
                piece = g[self._rel(box, self._box(name, *me))].contiguous() if box else g.contiguous()
                if piece.untyped_storage().nbytes() > piece.numel() * piece.element_size():
                    piece = piece.clone()  # a view (a cat's slice) would hold the whole gradient until sent
                q = self._peer(act.replica, p, i)
                w = dist.isend(piece, dst=q, tag=self._tag(name, True, act.replica, act.microbatch))
                sends.append((w, f"gradient of {name} to stage {p}", piece, q,
                              self._index(q, "B", p, act.microbatch, act.replica)))
            t.grad = None  # sent: the pieces cut from it live until their sends complete
        return sends

    def _release_done(self, sends: list[tuple[Any, str, torch.Tensor, int, int]]
                      ) -> list[tuple[Any, str, torch.Tensor, int, int]]:
        """Wait for and drop the sends whose receive is known to be posted, freeing their tensors.

        A gloo send keeps its tensor alive until its Work object goes, and gloo does not mark a
        send complete until someone waits on it. The receiver posts the receive of action ``a``
        when it starts action ``a - LOOKAHEAD``; once a message has arrived that it sent at
        action ``d`` or later, every receive up to ``d + LOOKAHEAD`` is posted, so waiting on a
        send it consumes at or before that only waits for the bytes to move (the receiver's
        transport thread takes them; it cannot deadlock). Sent tensors (the input gradients of a
        backward, tile pieces) are then freed once the receiver is known ready for them, not when
        it has consumed them. The engine calls this at the start of every action and again once
        a forward's inputs or a backward's gradients have arrived (they may show a peer ready):
        a plain last stage after a spatial one held the previous backward's input gradients
        through the next forward (1 MiB at 256², bench_spatial Table 6).
        """
        left = []
        for item in sends:
            w, what, _, q, consumed_at = item
            if consumed_at <= self._peer_done.get(q, -1) + LOOKAHEAD or (w is not None and w.is_completed()):
                wait(w, timeout_s=self.timeout_s, what=what, peer=q)
            else:
                left.append(item)
        return left
