"""The pipeline engine: runs one rank's schedule of forward/backward actions over torch.distributed.

[Note: exactness] One optimizer step equals one step of single-device training that runs the
same micro-batches with gradient accumulation: the global batch is cut into dp x replicas x m
micro-batches in the order (dp copy, replica, micro-batch); each micro-batch's loss is scaled by
1 / (dp x replicas x m) before backward, so the gradients summed over micro-batches, over the
two MASTER replicas and over data-parallel copies (all-reduce SUM, never an average of
averages) are exactly the gradient of the global mean loss. The reported loss is the mean of the
unscaled micro-batch losses. BatchNorm sees each micro-batch alone, as the single-device
reference does; running statistics update in micro-batch order.

[Note: gradient sync] After this rank's last backward of a stage, that stage's gradients are
flattened into one bucket and all-reduced (SUM) asynchronously over every rank holding a copy of
the stage (MASTER mirror and data-parallel copies), overlapping the rest of the backward; the
optimizer steps once every bucket has arrived.

[Note: communication] Every rank knows from the plan which values it receives, from whom, with
which shape: each receive is posted LOOKAHEAD actions before the action that needs it, into a
buffer from a pool reused across micro-batches and steps (no handshakes; live buffers stay
bounded by the micro-batches in flight, as 1F1B intends), sends are isend and waited at the end of the step. Every float value sent
forward gets exactly one gradient back (zeros when the consumer did not need it), so both sides
agree on the messages without asking. Tags are unique per (value, direction, replica, micro-batch).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nowdl.codegen.stage import StageModule
from nowdl.errors import NowdlError
from nowdl.partitioner.plan import Plan
from nowdl.profiler import PRECISIONS as AUTOCAST_DTYPES
from nowdl.profiler import check_precision
from nowdl.runtime.halo import Window, _intersect
from nowdl.runtime.launch import wait
from nowdl.runtime.schedule import Action, rank_actions
from nowdl.runtime.spatial_stage import TiledStage, full_grid
from nowdl.runtime.tiles import TiledInput, TileGrid

__all__ = ["PipelineEngine", "Placement", "PRECISIONS", "check_precision"]


def _detach(out: Any) -> Any:
    """``out`` (a tensor or a structure of tensors) detached."""
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(_detach(v) for v in out)
    if isinstance(out, dict):
        return {k: _detach(v) for k, v in out.items()}
    return out


PRECISIONS = tuple(AUTOCAST_DTYPES)


LOOKAHEAD = 1  # receives are posted this many actions ahead of the action that needs them


_Recv = tuple[tuple[Any, ...], int, int, str, tuple[int, ...]]  # key, peer, tag, value, shape


@dataclass
class _StepReceives:
    """The receives of one step: per action, what it needs; what is posted so far."""

    per_action: list[list[_Recv]]
    next_action: int = 0
    posted: dict[tuple[Any, ...], tuple[Any, int, torch.Tensor]] = field(default_factory=dict)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where every (dp copy, replica, stage) lives: the global rank of each of its parts (tiles)."""

    k: int
    replicas: int
    dp: int
    where: dict[tuple[int, int, int], list[int]]  # (dp, replica, stage) -> global rank of each part

    @classmethod
    def from_plan(cls, plan: Plan) -> Placement:
        parts = {s.index: max(1, int(s.parts)) for s in plan.stages}
        found: dict[tuple[int, int, int], dict[int, int]] = {}
        for r in plan.ranks:
            for h in r.stages:
                found.setdefault((r.dp, h["replica"], h["stage"]), {})[int(h.get("part", 0))] = r.rank
        where: dict[tuple[int, int, int], list[int]] = {}
        for key, by_part in found.items():
            want = parts.get(key[2], 1)
            if sorted(by_part) != list(range(want)):
                raise NowdlError(f"the plan gives stage {key[2]} (replica {key[1]}, dp copy {key[0]}) parts "
                                 f"{sorted(by_part)} but the stage has {want}: the plan is inconsistent; re-plan")
            where[key] = [by_part[q] for q in range(want)]
        return cls(k=len(plan.stages), replicas=int(plan.config["replicas"]), dp=int(plan.config["dp"]), where=where)

    def rank_of(self, d: int, rep: int, stage: int, part: int = 0) -> int:
        return self.where[(d, rep, stage)][part]

    def part_ranks(self, d: int, rep: int, stage: int) -> list[int]:
        """The ranks holding the tiles of one copy of ``stage``, in part order."""
        return self.where[(d, rep, stage)]

    def group_ranks(self, stage: int) -> list[int]:
        """Every rank holding any part of any copy of ``stage`` (replicas, dp copies), sorted."""
        return sorted({r for d in range(self.dp) for rep in range(self.replicas) for r in self.where[(d, rep, stage)]})


class PipelineEngine:
    """Runs this rank's part of a plan: forward/backward actions, p2p, gradient sync, step.

    Args:
        plan: the Plan every rank uses.
        stages: ``build_stages(gm, plan)`` on this rank (only the stages this rank holds are run).
        rank: this process's global rank.
        optimizer: builds the optimizer from this rank's parameters.
        loss_fn: ``loss_fn(output, target) -> scalar`` (mean over the micro-batch).
        device: where this rank's stages run.
        timeout_s: how long any receive may wait before the peer is declared dead.
        precision: "fp32", or "bf16"/"fp16" autocast (activations travel in that dtype; fp16
            scales the loss and skips a step on every rank when any rank overflows).
        checkpointing: True (every stage) or the stage indices whose forward is recomputed in
            their backward (less memory; BatchNorm running statistics then update twice).
    """

    def __init__(self, plan: Plan, stages: Sequence[StageModule], rank: int, *,
                 optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 device: torch.device, timeout_s: float = 300.0, precision: str = "fp32",
                 checkpointing: bool | Sequence[int] = False) -> None:
        self.plan = plan
        self.rank = rank
        self.device = device
        self.timeout_s = timeout_s
        self.loss_fn = loss_fn
        self.precision = check_precision(precision)
        self.comm_dtype: torch.dtype | None = AUTOCAST_DTYPES[precision]
        self._scaling = precision == "fp16"
        self.loss_scale = 2.0**16 if self._scaling else 1.0
        self._good_steps = 0
        k = len(plan.stages)
        if isinstance(checkpointing, bool):
            self.checkpointed: set[int] = set(range(k)) if checkpointing else set()
        else:
            bad = [i for i in checkpointing if not isinstance(i, int) or not 0 <= i < k]
            if bad:
                raise NowdlError(f"activation_checkpointing names stages {bad}, but the plan has stages 0..{k - 1}")
            self.checkpointed = set(checkpointing)
        self._pool: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._sent_at: dict[tuple[Any, ...], int] = {}  # receive key -> sender's action index
        self._boxes: dict[tuple[str, int, int], Window] = {}
        self._recv_plans: dict[bool, list[list[_Recv]]] = {}
        self._peer_done: dict[int, int] = {}  # peer -> last action index known to have run (this step)
        self.place = Placement.from_plan(plan)
        self.m = int(plan.config["micro_batches"])
        self.k = self.place.k
        me = next((r for r in plan.ranks if r.rank == rank), None)
        if me is None:
            raise NowdlError(f"rank {rank} is not in the plan (ranks 0..{len(plan.ranks) - 1})")
        self.dp_index = me.dp
        self.held = sorted({(h["replica"], h["stage"]) for h in me.stages})
        self.part = {(h["replica"], h["stage"]): int(h.get("part", 0)) for h in me.stages}
        self.parts = [max(1, int(st.parts)) for st in plan.stages]
        self.stages = {s.index: s for s in stages}
        for _, s in self.held:
            self.stages[s].module.to(device)
        self.actions: list[Action] = rank_actions(plan, rank)
        self._programs: dict[int, dict[tuple[str, int, int, int], int]] = {}
        # one module per held stage; MASTER's two copies of the same stage on one rank share it
        params: dict[int, nn.Parameter] = {}
        for _, s in self.held:
            for p in self.stages[s].module.parameters():
                params[id(p)] = p
        self.params = list(params.values())
        self.optimizer = optimizer(self.params) if optimizer is not None and self.params else None
        self._groups: dict[int, Any] = {}
        if dist.is_initialized() and dist.get_world_size() > 1:
            for s in range(self.k):  # every rank creates every group, in the same order
                ranks = self.place.group_ranks(s)
                g = dist.new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    self._groups[s] = g
            tile_groups: dict[tuple[int, int], Any] = {}
            for (d, rep, s), prs in sorted(self.place.where.items()):  # same order on every rank
                if len(prs) > 1:
                    g = dist.new_group(prs)
                    if d == self.dp_index and rank in prs:
                        tile_groups[(rep, s)] = g
            self._sync_initial_weights()
        elif any(p > 1 for p in self.parts):
            raise NowdlError("this plan has spatial stages, which need several ranks: launch it with torchrun "
                             f"--nproc-per-node {len(plan.ranks)}")
        self.tiled: dict[tuple[int, int], TiledStage] = {}
        for rep, s in self.held:
            if self.parts[s] > 1:
                st = plan.stages[s]
                self.tiled[(rep, s)] = TiledStage(self.stages[s], st.grid, self.place.part_ranks(self.dp_index, rep, s),
                                                  rank, tile_groups[(rep, s)], fused=st.fused)
        self._value_ids = {name: i for i, name in enumerate(sorted(
            {n for s in stages for n in list(s.inputs) + list(s.outputs)}))}
        self._meta = {t.producer: (tuple(t.shape), getattr(torch, t.dtype.replace("torch.", ""))) for t in plan.tensors}
        data = {n for st in stages for n, p in st.producers.items() if p < 0}
        self._data_names = [n for n in plan.stages[0].nodes if n in data]
        self._check_spatial_values()

    def _check_spatial_values(self) -> None:
        for t in self.plan.tensors:
            ends = [t.from_stage] + [c for c in t.to_stages if c < self.k]
            if any(self.parts[s] > 1 for s in ends) and len(t.shape) < 3:
                raise NowdlError(
                    f"value {t.producer!r} of shape {t.shape} crosses between stages {ends}, one of them spatial, but it "
                    "is not an (N, C, *spatial) image tensor that can be cut into tiles: re-plan so the spatial "
                    "region ends elsewhere"
                )

    # ---- set-up --------------------------------------------------------------------------------
    def _sync_initial_weights(self) -> None:
        """Every copy of a stage starts from the lowest rank's weights (they must be equal)."""
        for s, g in self._groups.items():
            if g is None:
                continue
            src = self.place.group_ranks(s)[0]
            for t in list(self.stages[s].module.parameters()) + list(self.stages[s].module.buffers()):
                with torch.no_grad():
                    dist.broadcast(t.data, src=src, group=g)

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

    # ---- one step ------------------------------------------------------------------------------
    def _chunks(self, batch: Any, total: int) -> list[Any]:
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
                    f"(dp {self.place.dp} x replicas {self.place.replicas} x micro_batches {self.m}): "
                    f"give a multiple of {total}"
                )
            return list(batch.chunk(total))
        if isinstance(batch, (list, tuple)):
            parts = [self._chunks(b, total) for b in batch]
            return [type(batch)(p[i] for p in parts) for i in range(total)]
        raise NowdlError(f"cannot split a batch of type {type(batch).__name__} into micro-batches: pass tensors")

    def _local_chunks(self, batch: Any) -> dict[tuple[int, int], Any]:
        total = self.place.dp * self.place.replicas * self.m
        chunks = self._chunks(batch, total)
        out = {}
        for rep in range(self.place.replicas):
            for i in range(self.m):
                out[(rep, i)] = chunks[(self.dp_index * self.place.replicas + rep) * self.m + i]
        return out

    # ---- receives: posted a few actions ahead into pooled buffers -------------------------------
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
            elif train:
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

    # ---- tiles: which part of a value each part of a stage holds -----------------------------------
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
        return _intersect(self._box(name, *src), self._box(name, *dst))

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
        dtype = self._meta[name][1]
        if dtype.is_floating_point:
            dtype = self.comm_dtype or dtype
        free = self._pool.get((shape, dtype))
        if free:
            return free.pop()
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _release(self, buf: torch.Tensor) -> None:
        self._pool.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)

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

    # ---- one step ------------------------------------------------------------------------------
    def run(self, x: Any, y: Any, *, train: bool = True) -> tuple[float, list[Any]]:
        """Run one step (train: forward+backward+sync+step; else forward only).

        Returns the mean loss over the global batch (every rank gets the same float; NaN when no
        loss_fn) and the outputs of the micro-batches whose last stage runs here (eval).
        """
        xs = self._local_chunks(x)
        ys = self._local_chunks(y)
        scale = 1.0 / (self.place.dp * self.place.replicas * self.m)
        loss_scale = self.loss_scale if train else 1.0
        if train and self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        for _, s in self.held:
            self.stages[s].module.train(train)
        if train not in self._recv_plans:  # the messages of a step are fixed by the plan
            self._recv_plans[train] = self._expected_recvs(train)
        rx = _StepReceives(self._recv_plans[train])
        held_bufs: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        b_left: dict[int, int] = {}
        for a in self.actions:
            if a.kind == "B":
                b_left[a.stage] = b_left.get(a.stage, 0) + 1
        pending: list[tuple[int, Any, torch.Tensor]] = []
        inputs: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        outputs: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        losses: dict[tuple[int, int], torch.Tensor] = {}
        sends: list[tuple[Any, str, torch.Tensor, int, int]] = []  # work, what, tensor, peer, its action
        self._peer_done = {}
        final: list[Any] = []
        loss_sum = 0.0
        for idx, act in enumerate(self.actions):
            if act.kind == "B" and not train:
                continue
            self._post_upto(rx, idx)
            sends = self._release_done(sends)
            key = (act.replica, act.stage, act.microbatch)
            st = self.stages[act.stage]
            if act.kind == "F":
                bufs: list[torch.Tensor] = []
                part = self.part[(act.replica, act.stage)]
                tiled = self.tiled.get((act.replica, act.stage))
                ins: list[torch.Tensor] = []
                shapes: list[tuple[int, ...]] = []
                for name in st.inputs:
                    t_in, full = self._input(st, name, act, xs[(act.replica, act.microbatch)], train, rx, bufs, tiled)
                    ins.append(t_in)
                    shapes.append(full)
                held_bufs[key] = bufs
                outs, grids = self._forward(st, ins, shapes, train, tiled)
                inputs[key] = ins
                outputs[key] = outs
                model_out: dict[str, torch.Tensor] = {}
                for name, t, g_out in zip(st.outputs, outs, grids, strict=True):
                    for c in st.consumers.get(name, []):
                        if c == self.k:  # the model output: the loss (below)
                            whole = t if tiled is None or g_out is None else g_out.gather(t, tiled.group)
                            model_out[name] = whole.float() if self.comm_dtype and whole.is_floating_point() else whole
                            continue
                        msg = t.detach()
                        if self.comm_dtype is not None and msg.is_floating_point():
                            msg = msg.to(self.comm_dtype)
                        for j in range(self.parts[c]):
                            box = self._piece(name, (act.stage, part), (c, j))
                            if box is None:
                                continue
                            piece = msg[self._rel(box, self._box(name, act.stage, part))].contiguous()
                            q = self._peer(act.replica, c, j)
                            w = dist.isend(piece, dst=q, tag=self._tag(name, False, act.replica, act.microbatch))
                            sends.append((w, f"{name} to stage {c}", piece, q,
                                          self._index(q, "F", c, act.microbatch, act.replica)))
                if model_out:  # the model's output as the model returns it (tensor, tuple, list, dict)
                    result = self._model_output(st, model_out)
                    yi = ys[(act.replica, act.microbatch)]
                    if self.loss_fn is not None and yi is not None:
                        loss = self.loss_fn(result, yi.to(self.device) if isinstance(yi, torch.Tensor) else yi)
                        losses[(act.replica, act.microbatch)] = loss
                        if part == 0:  # every tile computes the same loss: count it once
                            loss_sum += float(loss.detach())
                    if not train and part == 0:
                        final.append(_detach(result))
                if not train:
                    inputs.pop(key)
                    outputs.pop(key)
                    for b in held_bufs.pop(key):
                        self._release(b)
            else:
                part = self.part[(act.replica, act.stage)]
                me = (act.stage, part)
                outs = outputs.pop(key)
                ins = inputs.pop(key)
                roots: list[torch.Tensor] = []
                grads: list[torch.Tensor | None] = []
                grad_bufs: list[torch.Tensor] = []
                for name, t in zip(st.outputs, outs, strict=True):
                    g: torch.Tensor | None = None
                    if self._is_float(name):
                        for c in st.consumers.get(name, []):
                            if c == self.k:
                                continue
                            for j in range(self.parts[c]):
                                box = self._piece(name, me, (c, j))
                                if box is None:
                                    continue
                                buf = self._take(rx, ("B", name, c, act.replica, act.microbatch, j),
                                                 f"gradient of {name} from stage {c}")
                                grad_bufs.append(buf)
                                mine = self._box(name, *me) if box else ()
                                if box == mine:
                                    g = buf.to(t.dtype) if g is None else g + buf.to(t.dtype)
                                else:
                                    if g is None:
                                        g = torch.zeros_like(t)
                                    g[self._rel(box, mine)] += buf.to(t.dtype)
                    if t.requires_grad and g is not None:
                        roots.append(t)
                        grads.append(g)
                loss_t = losses.pop((act.replica, act.microbatch)) if (act.replica, act.microbatch) in losses else None
                if loss_t is not None:
                    roots.append(loss_t * (scale * loss_scale))
                    grads.append(None)
                if roots:
                    torch.autograd.backward(roots, grads)
                del grads
                for b in grad_bufs + held_bufs.pop(key, []):  # consumed: back to the pool
                    self._release(b)
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
                        q = self._peer(act.replica, p, i)
                        w = dist.isend(piece, dst=q, tag=self._tag(name, True, act.replica, act.microbatch))
                        sends.append((w, f"gradient of {name} to stage {p}", piece, q,
                                      self._index(q, "B", p, act.microbatch, act.replica)))
                b_left[act.stage] -= 1
                if b_left[act.stage] == 0:  # this stage's gradients are final here: reduce them now
                    bucket = self._launch_sync(act.stage)
                    if bucket is not None:
                        pending.append(bucket)
        for w, what, _, q, _ in sends:
            wait(w, timeout_s=self.timeout_s, what=what, peer=q)
        if train:
            self._finish_sync(pending)
            self._step()
        return self._mean_loss(loss_sum), final

    @staticmethod
    def _model_output(st: StageModule, values: dict[str, torch.Tensor]) -> Any:
        """The last stage's outputs in the structure the model returns them (see ``output_tree``)."""
        from nowdl.codegen.stage import fill_outputs

        if st.output_tree is None:
            flat = list(values.values())
            return flat[0] if len(flat) == 1 else tuple(flat)
        return fill_outputs(st.output_tree, [values.get(n) for n in st.outputs])

    def _release_done(self, sends: list[tuple[Any, str, torch.Tensor, int, int]]
                      ) -> list[tuple[Any, str, torch.Tensor, int, int]]:
        """Drop sends known to be complete, so their tensors can be freed.

        A gloo send keeps its tensor alive until its Work object goes, and gloo does not mark a
        send complete until someone waits on it. A send is known complete once a message has
        arrived that its receiver sent at a later action of its program: the receiver had
        already passed the action that consumed this send. Waiting on it then returns at once
        (it cannot deadlock), and live messages stay bounded by the micro-batches in flight.
        """
        left = []
        for item in sends:
            w, what, _, q, consumed_at = item
            if consumed_at < self._peer_done.get(q, -1) or (w is not None and w.is_completed()):
                wait(w, timeout_s=self.timeout_s, what=what, peer=q)
            else:
                left.append(item)
        return left

    def _forward(self, st: StageModule, ins: list[torch.Tensor], shapes: list[tuple[int, ...]], train: bool,
                 tiled: TiledStage | None) -> tuple[list[torch.Tensor], list[TileGrid | None]]:
        grids: list[TileGrid | None] = [None] * len(st.outputs)

        def run(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if tiled is None:
                return tuple(st.module(*xs))
            outs, gs = tiled(xs, shapes)
            grids[:] = gs
            return tuple(outs)

        with torch.set_grad_enabled(train), self._autocast():
            if train and st.index in self.checkpointed and any(t.requires_grad for t in ins):
                from torch.utils.checkpoint import checkpoint

                return list(checkpoint(run, *ins, use_reentrant=False)), grids
            return list(run(*ins)), grids

    def _autocast(self) -> Any:
        if self.comm_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.comm_dtype)

    def _input(self, st: StageModule, name: str, act: Action, x: Any, train: bool, rx: _StepReceives,
               bufs: list[torch.Tensor], tiled: TiledStage | None) -> tuple[torch.Tensor, tuple[int, ...]]:
        """This stage's input ``name`` (its tile, for a spatial stage) and the value's full spatial shape."""
        p = st.producers[name]
        if p < 0:
            data = x if isinstance(x, (torch.Tensor, TiledInput)) else x[self._data_names.index(name)]
            full = tuple(int(n) for n in data.shape[2:])
            if isinstance(data, TiledInput):  # read only what this rank holds
                data = data.read(tiled.grid_of(full).tile_bounds() if tiled is not None else None)
            elif tiled is not None:
                if data.dim() < 3:
                    raise NowdlError(f"model input {name!r} of shape {tuple(data.shape)} feeds spatial stage {st.index} "
                                     "but is not an (N, C, *spatial) image: re-plan without that spatial stage")
                data = tiled.grid_of(full).split(data)
            return data.to(self.device), full
        part = self.part[(act.replica, act.stage)]
        mine = self._box(name, st.index, part) if self.parts[st.index] > 1 or self.parts[p] > 1 else ()
        pieces: list[tuple[Window, torch.Tensor]] = []
        for i in range(self.parts[p]):
            box = self._piece(name, (p, i), (st.index, part))
            if box is None:
                continue
            buf = self._take(rx, ("F", name, act.replica, act.microbatch, i), f"{name} from stage {p}")
            bufs.append(buf)  # back to the pool after this micro-batch's backward
            pieces.append((box, buf))
        if len(pieces) == 1 and pieces[0][0] == mine:
            t = pieces[0][1].detach()  # shares the pooled buffer
        else:  # tiles of another grid (or the whole image): assemble this part's region
            shape = self._piece_shape(name, mine)
            t = pieces[0][1].new_empty(shape)
            for box, buf in pieces:
                t[self._rel(box, mine)] = buf
        if train and t.is_floating_point():
            t.requires_grad_(True)
        return t, tuple(self._meta[name][0][2:])

    def _launch_sync(self, stage: int) -> tuple[int, Any, torch.Tensor] | None:
        """Start the all-reduce (SUM) of one stage's gradients as one flat bucket, asynchronously.

        Called right after this rank's last backward of the stage, so it overlaps the backward
        of any other stage this rank holds (MASTER) and the remaining sends.
        """
        g = self._groups.get(stage)
        if g is None:
            return None
        grads: list[torch.Tensor] = []
        for p in self.stages[stage].module.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.reshape(-1))
        flat = torch.cat(grads) if grads else torch.zeros(0, device=self.device)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=g, async_op=True)
        return stage, work, flat

    def _finish_sync(self, pending: list[tuple[int, Any, torch.Tensor]]) -> None:
        for stage, work, flat in pending:
            wait(work, timeout_s=self.timeout_s, what=f"gradient all-reduce of stage {stage}", peer=None)
            offset = 0
            for p in self.stages[stage].module.parameters():
                n = p.numel()
                if p.grad is not None:  # set by _launch_sync
                    p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n

    def _step(self) -> None:
        """Optimizer step; with fp16 loss scaling, every rank agrees to skip on an overflow."""
        if self.optimizer is None and not self._scaling:
            return
        if self._scaling:
            bad = torch.tensor([0.0], device=self.device)
            for p in self.params:
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    bad.fill_(1.0)
                    break
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item() > 0:
                self.loss_scale /= 2.0
                self._good_steps = 0
                log.warning("fp16 overflow: step skipped on every rank, loss scale now %g", self.loss_scale)
                return
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(self.loss_scale)
            self._good_steps += 1
            if self._good_steps % 2000 == 0:
                self.loss_scale *= 2.0
        if self.optimizer is not None:
            self.optimizer.step()

    def _mean_loss(self, local_sum: float) -> float:
        if self.loss_fn is None:
            return float("nan")
        total = self.place.dp * self.place.replicas * self.m
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return local_sum / total
        t = torch.tensor([local_sum], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item()) / total
