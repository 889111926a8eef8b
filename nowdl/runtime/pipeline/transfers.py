"""Point-to-point transfers of one rank: which messages it expects, receive buffers, tiles' boxes.

[Note: communication] Every rank knows from the plan which values it receives, from whom, with
which shape: each receive is posted LOOKAHEAD actions before the action that needs it, into a
fresh buffer (no handshakes; live buffers stay bounded by the micro-batches in flight, as 1F1B
intends; see [Note: no buffer pool]); sends are isend, waited as soon as the receiver is known
to have posted the receive (``release_done``: their tensors are freed then), the rest at the end
of the step. Every float value sent forward gets exactly one gradient back (zeros when the
consumer did not need it), so both sides agree on the messages without asking. Tags are unique
per (value, direction, replica, micro-batch).

[Note: p2p lanes] Messages between two ranks go over a process group of their own per direction
and replica (a "lane": sender -> receiver, of one MASTER replica). Gloo matches messages by tag
and needs none. NCCL ignores tags, matches the messages between two ranks of a group in the order
they are posted, and runs them on one CUDA stream in that order. Over one group, a receive posted
ahead (``post_upto``) would hold up this rank's later sends to that peer while the peer's send it
waits for sits behind the peer's own receive: a deadlock at the first step of GPipe on two GPUs.
On a lane only one direction of one replica's pipeline flows, and the sender posts its sends in
the order the receiver posts its receives (the plan fixes both programs;
tests/runtime/test_p2p_order.py checks every lane); a MASTER rank holding stages of both replicas
posts their messages in its own program order, hence a lane per replica.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from nowdl.codegen.stage import StageModule
from nowdl.runtime.launch import comm
from nowdl.runtime.launch.group import wait
from nowdl.runtime.pipeline.rank_view import RankView
from nowdl.runtime.spatial.exchange import Window, intersect
from nowdl.runtime.spatial.stage import full_grid
from nowdl.runtime.spatial.tiles import TileGrid
from nowdl.schedule import Action, rank_actions
from nowdl.schedule.orders import RECV_LOOKAHEAD

__all__ = ["Transfers", "StepReceives", "Recv", "Send", "LOOKAHEAD"]

LOOKAHEAD = RECV_LOOKAHEAD  # receives are posted this many actions ahead ([Note: held buffers])


Recv = tuple[tuple[Any, ...], int, int, str, tuple[int, ...]]  # key, peer, tag, value, shape
Send = tuple[Any, str, torch.Tensor, int, int]  # work, what, tensor, peer, the peer's action receiving it


@dataclass
class StepReceives:
    """The receives of one step: per action, what it needs; what is posted so far."""

    per_action: list[list[Recv]]
    next_action: int = 0
    posted: dict[tuple[Any, ...], tuple[Any, int, torch.Tensor]] = field(default_factory=dict)


class Transfers:
    """The messages of one rank: what it expects, its receive buffers, its sends, the tiles' boxes."""

    def __init__(self, view: RankView, timeout_s: float, lanes: dict[tuple[int, int, int], Any] | None = None) -> None:
        self.view = view
        self.timeout_s = timeout_s
        self.lanes = lanes or {}  # (sender, receiver, replica) -> its group ([Note: p2p lanes]); absent: the world
        self._programs: dict[int, dict[tuple[str, int, int, int], int]] = {}
        self._sent_at: dict[tuple[Any, ...], int] = {}  # receive key -> sender's action index
        self._boxes: dict[tuple[str, int, int], Window] = {}
        self._recv_plans: dict[bool, list[list[Recv]]] = {}
        self._peer_done: dict[int, int] = {}  # peer -> last action index known to have run (this step)

    def start_step(self, train: bool) -> StepReceives:
        """The receives of a new step (fixed by the plan: computed once per mode)."""
        if train not in self._recv_plans:
            self._recv_plans[train] = self.expected_recvs(train)
        self._peer_done = {}
        return StepReceives(self._recv_plans[train])

    def tag(self, value: str, backward: bool, rep: int, mb: int) -> int:
        v = self.view
        return ((v.value_ids[value] * 2 + int(backward)) * v.place.replicas + rep) * v.m + mb

    def peer(self, rep: int, stage: int, part: int = 0) -> int:
        return self.view.place.rank_of(self.view.dp_index, rep, stage, part)

    def index(self, peer: int, kind: str, stage: int, mb: int, rep: int) -> int:
        """Where (kind, stage, micro-batch, replica) sits in ``peer``'s program for one step."""
        prog = self._programs.get(peer)
        if prog is None:
            acts = rank_actions(self.view.plan, peer)
            prog = {(a.kind, a.stage, a.microbatch, a.replica): i for i, a in enumerate(acts)}
            self._programs[peer] = prog
        return prog[(kind, stage, mb, rep)]

    def producer_pieces(self, name: str, p: int, me: tuple[int, int]) -> Iterator[tuple[int, Window]]:
        """(part, box) of every part of stage ``p`` that sends some of ``name`` to ``me``."""
        for i in range(self.view.parts[p]):
            box = self.piece(name, (p, i), me)
            if box is not None:
                yield i, box

    def consumer_pieces(self, name: str, me: tuple[int, int], consumers: list[int]
                        ) -> Iterator[tuple[int, int, Window]]:
        """(stage, part, box) of every part of a consuming stage that ``me`` sends some of ``name``
        (the model output, stage K, left out)."""
        for c in consumers:
            if c >= self.view.k:
                continue
            for j in range(self.view.parts[c]):
                box = self.piece(name, me, (c, j))
                if box is not None:
                    yield c, j, box

    def expected_recvs(self, train: bool) -> list[list[Recv]]:
        """For each action of this rank: every message it receives (one per sending part)."""
        out: list[list[Recv]] = []
        for act in self.view.actions:
            me = (act.stage, self.view.part[(act.replica, act.stage)])
            if act.kind == "F":
                out.append(self._forward_recvs(act, me))
            elif train and act.kind == "B":
                out.append(self._backward_recvs(act, me))
            else:
                out.append([])
        return out

    def _forward_recvs(self, act: Action, me: tuple[int, int]) -> list[Recv]:
        st = self.view.stages[act.stage]
        mine: list[Recv] = []
        for name in st.inputs:
            p = st.producers[name]
            if p < 0:
                continue
            for i, box in self.producer_pieces(name, p, me):
                q = self.peer(act.replica, p, i)
                key: tuple[Any, ...] = ("F", name, act.replica, act.microbatch, i)
                mine.append((key, q, self.tag(name, False, act.replica, act.microbatch), name,
                             self.piece_shape(name, box)))
                self._sent_at[key] = self.index(q, "F", p, act.microbatch, act.replica)
        return mine

    def _backward_recvs(self, act: Action, me: tuple[int, int]) -> list[Recv]:
        st = self.view.stages[act.stage]
        mine: list[Recv] = []
        for name in st.outputs:
            if not self.is_float(name):
                continue
            for c, j, box in self.consumer_pieces(name, me, st.consumers.get(name, [])):
                q = self.peer(act.replica, c, j)
                key = ("B", name, c, act.replica, act.microbatch, j)
                mine.append((key, q, self.tag(name, True, act.replica, act.microbatch), name,
                             self.piece_shape(name, box)))
                self._sent_at[key] = self.index(q, "B", c, act.microbatch, act.replica)
        return mine

    def box(self, name: str, stage: int, part: int) -> Window:
        """The region (full-image coords per spatial dim) of ``name`` that ``part`` of ``stage`` holds."""
        key = (name, stage, part)
        box = self._boxes.get(key)
        if box is None:  # fixed by the plan: computed once, looked up on every message
            sp = self.view.meta[name][0][2:]
            parts = self.view.parts[stage]
            if parts == 1:
                box = tuple((0, n) for n in sp)
            else:
                grid = full_grid(self.view.plan.stages[stage].grid, len(sp))
                box = TileGrid.for_rank(sp, grid, part, range(parts)).tile_bounds()
            self._boxes[key] = box
        return box

    def piece(self, name: str, src: tuple[int, int], dst: tuple[int, int]) -> Window | None:
        """What (stage, part) ``src`` sends of ``name`` to (stage, part) ``dst``: a box, or None."""
        if self.view.parts[src[0]] == 1 and self.view.parts[dst[0]] == 1:
            return ()  # the whole tensor
        return intersect(self.box(name, *src), self.box(name, *dst))

    def piece_shape(self, name: str, box: Window) -> tuple[int, ...]:
        shape = self.view.meta[name][0]
        if not box:
            return shape
        return tuple(shape[:2]) + tuple(hi - lo for lo, hi in box)

    @staticmethod
    def rel(box: Window, origin: Window) -> tuple[slice, ...]:
        """The index of ``box`` inside a tensor holding the region ``origin``."""
        if not box:
            return ()
        return (slice(None), slice(None)) + tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))

    def is_float(self, name: str) -> bool:
        meta = self.view.meta.get(name)
        return meta is None or meta[1].is_floating_point

    def _alloc(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A fresh receive buffer. [Note: no buffer pool] Buffers are not recycled by hand: a
        received tensor's storage can outlive its micro-batch (autograd's AccumulateGrad steals
        an incoming gradient into ``.grad`` through a view, which is then sent on; a pass-through
        stage returns its input), and reusing it for the next receive corrupted those tensors
        (4-stage MASTER, GPipe). The allocator (CUDA's caching allocator, malloc on CPU) reuses
        memory once the last reference goes."""
        dtype = self.view.meta[name][1]
        if dtype.is_floating_point:
            dtype = self.view.comm_dtype or dtype
        return torch.empty(shape, dtype=dtype, device=self.view.device)

    def post_upto(self, rx: StepReceives, idx: int) -> None:
        """Post the receives of actions up to ``idx + LOOKAHEAD`` (in program order)."""
        while rx.next_action < len(rx.per_action) and rx.next_action <= idx + LOOKAHEAD:
            for key, peer, tag, name, shape in rx.per_action[rx.next_action]:
                buf = self._alloc(name, shape)
                lane = self.lanes.get((peer, self.view.rank, key[2] if key[0] == "F" else key[3]))  # the key's replica
                rx.posted[key] = (comm.irecv(buf, src=peer, group=lane, tag=tag), peer, buf)
            rx.next_action += 1

    def take(self, rx: StepReceives, key: tuple[Any, ...], what: str) -> torch.Tensor:
        """Wait for the posted receive ``key`` and return its buffer."""
        work, peer, buf = rx.posted.pop(key)
        wait(work, timeout_s=self.timeout_s, what=what, peer=peer)
        # the peer has run its program up to the action that sent this message
        self._peer_done[peer] = max(self._peer_done.get(peer, -1), self._sent_at[key])
        return buf

    def send_forward(self, name: str, t: torch.Tensor, act: Action, c: int) -> list[Send]:
        """Send output ``name`` of a forward to every part of consuming stage ``c`` that reads some of it."""
        msg = t.detach()
        if self.view.comm_dtype is not None and msg.is_floating_point():
            msg = msg.to(self.view.comm_dtype)
        part = self.view.part[(act.replica, act.stage)]
        sends: list[Send] = []
        for j in range(self.view.parts[c]):
            box = self.piece(name, (act.stage, part), (c, j))
            if box is None:
                continue
            piece = msg[self.rel(box, self.box(name, act.stage, part))].contiguous()
            q = self.peer(act.replica, c, j)
            w = comm.isend(piece, dst=q, group=self.lanes.get((self.view.rank, q, act.replica)),
                           tag=self.tag(name, False, act.replica, act.microbatch))
            sends.append((w, f"{name} to stage {c}", piece, q, self.index(q, "F", c, act.microbatch, act.replica)))
        return sends

    def send_input_grads(self, st: StageModule, ins: list[torch.Tensor], act: Action, me: tuple[int, int]
                         ) -> list[Send]:
        """Send the gradients of a backward's inputs to their producers (a zero gradient where
        none flowed); returns the sends, which hold the pieces cut from them until completed."""
        sends: list[Send] = []
        for name, t in zip(st.inputs, ins, strict=True):
            p = st.producers[name]
            if p < 0 or not t.is_floating_point():
                continue
            g = t.grad if t.grad is not None else torch.zeros_like(t)
            for i, box in self.producer_pieces(name, p, me):
                piece = g[self.rel(box, self.box(name, *me))].contiguous() if box else g.contiguous()
                if piece.untyped_storage().nbytes() > piece.numel() * piece.element_size():
                    piece = piece.clone()  # a view (a cat's slice) would hold the whole gradient until sent
                q = self.peer(act.replica, p, i)
                w = comm.isend(piece, dst=q, group=self.lanes.get((self.view.rank, q, act.replica)),
                               tag=self.tag(name, True, act.replica, act.microbatch))
                sends.append((w, f"gradient of {name} to stage {p}", piece, q,
                              self.index(q, "B", p, act.microbatch, act.replica)))
            t.grad = None  # sent: the pieces cut from it live until their sends complete
        return sends

    def release_done(self, sends: list[Send]) -> list[Send]:
        """Wait for and drop the sends whose receive is known to be posted, freeing their tensors.

        A gloo send keeps its tensor alive until its Work object goes, and gloo does not mark a
        send complete until someone waits on it. The receiver posts the receive of action ``a``
        when it starts action ``a - LOOKAHEAD``; once a message has arrived that it sent at
        action ``d`` or later, every receive up to ``d + LOOKAHEAD`` is posted, so waiting on a
        send it consumes at or before that only waits for the bytes to move (the receiver's
        transport thread takes them; it cannot deadlock). Sent tensors (the input gradients of a
        backward, tile pieces) are then freed once the receiver is known ready for them, not when
        it has consumed them. The runner calls this at the start of every action and again once
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
