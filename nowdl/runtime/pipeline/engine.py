"""The pipeline engine: runs one rank's schedule of forward/backward actions over torch.distributed.

[Note: exactness] One optimizer step equals one step of single-device training that runs the
same micro-batches with gradient accumulation: the global batch is cut into dp x replicas x m
micro-batches in the order (dp copy, replica, micro-batch); each micro-batch's loss is scaled by
1 / (dp x replicas x m) before backward, so the gradients summed over micro-batches, over the
two MASTER replicas and over data-parallel copies (all-reduce SUM, never an average of
averages) are exactly the gradient of the global mean loss. The reported loss is the mean of the
unscaled micro-batch losses. BatchNorm sees each micro-batch alone, as the single-device
reference does; running statistics update in micro-batch order.

See [Note: gradient sync] in runtime/pipeline/grad_sync.py and [Note: communication] in
runtime/pipeline/transfers.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nowdl.codegen.stage import StageModule
from nowdl.cpumem import keep_freed_memory
from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan
from nowdl.profiler import PRECISIONS as AUTOCAST_DTYPES
from nowdl.profiler import check_precision
from nowdl.runtime.launch.group import wait
from nowdl.runtime.pipeline.deferred_wgrad import (
    WeightGrad,
    capturing,
    deferring,
    enable,
    run_weight_grads,
)
from nowdl.runtime.pipeline.grad_sync import GradSync
from nowdl.runtime.pipeline.micro_batches import detach as _detach
from nowdl.runtime.pipeline.micro_batches import split_batch
from nowdl.runtime.pipeline.output_roots import Root
from nowdl.runtime.pipeline.ranks import Placement
from nowdl.runtime.pipeline.transfers import Transfers, _Recv, _StepReceives
from nowdl.runtime.spatial.exchange import Window
from nowdl.runtime.spatial.stage import TiledStage
from nowdl.runtime.spatial.tiles import TiledInput, TileGrid
from nowdl.schedule import Action, rank_actions

__all__ = ["PipelineEngine", "Placement", "PRECISIONS", "check_precision"]


PRECISIONS = tuple(AUTOCAST_DTYPES)


log = logging.getLogger(__name__)


class PipelineEngine(Transfers, GradSync):
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
        if device.type == "cpu":
            keep_freed_memory()  # [Note: CPU freed memory]
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
        # zero bubble: B computes input gradients, W the deferred weight gradients
        self._final_kind = "W" if any(a.kind == "W" for a in self.actions) else "B"  # gradients are final after it
        self._final_left = Counter(a.stage for a in self.actions if a.kind == self._final_kind)
        self.deferred = {s for rep, s in self.held if self._final_kind == "W"
                         and (rep, s) not in self.tiled and s not in self.checkpointed and enable(self.stages[s].module)}

    def _check_spatial_values(self) -> None:
        for t in self.plan.tensors:
            ends = [t.from_stage] + [c for c in t.to_stages if c < self.k]
            if any(self.parts[s] > 1 for s in ends) and len(t.shape) < 3:
                raise NowdlError(
                    f"value {t.producer!r} of shape {t.shape} crosses between stages {ends}, one of them spatial, but it "
                    "is not an (N, C, *spatial) image tensor that can be cut into tiles: re-plan so the spatial "
                    "region ends elsewhere"
                )

    def _local_chunks(self, batch: Any) -> dict[tuple[int, int], Any]:
        total = self.place.dp * self.place.replicas * self.m
        chunks = split_batch(batch, total, f"dp {self.place.dp} x replicas {self.place.replicas} x micro_batches {self.m}")
        out = {}
        for rep in range(self.place.replicas):
            for i in range(self.m):
                out[(rep, i)] = chunks[(self.dp_index * self.place.replicas + rep) * self.m + i]
        return out

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
        last, b_left = self._final_kind, dict(self._final_left)  # [Note: gradient sync]
        wq: dict[tuple[int, int, int], list[WeightGrad]] = {}
        pending: list[Any] = []  # launched gradient buckets
        inputs: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        outputs: dict[tuple[int, int, int], list[Root | None]] = {}
        losses: dict[tuple[int, int], torch.Tensor] = {}
        sends: list[tuple[Any, str, torch.Tensor, int, int]] = []  # work, what, tensor, peer, its action
        self._peer_done = {}
        final: list[Any] = []
        loss_sum = 0.0
        for idx, act in enumerate(self.actions):
            if act.kind != "F" and not train:
                continue
            self._post_upto(rx, idx)
            sends = self._release_done(sends)
            key = (act.replica, act.stage, act.microbatch)
            st = self.stages[act.stage]
            bk = self._open_buckets(act.stage) if act.kind == last and b_left[act.stage] == 1 else None
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
                sends = self._release_done(sends)  # what just arrived may show a peer ready for them
                with capturing(train and act.stage in self.deferred):
                    outs, grids = self._forward(st, ins, shapes, train, tiled)
                inputs[key] = ins
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
                    held_bufs.pop(key)
                else:  # a model output no stage reads is not kept: the loss is the backward's root
                    outputs[key] = [None if all(c == self.k for c in st.consumers.get(n, [])) else Root(o)
                                    for n, o in zip(st.outputs, outs, strict=True)]  # [Note: backward roots]
                del outs, model_out  # and no loop variable keeps this micro-batch's outputs alive:
                t = whole = result = msg = piece = None  # type: ignore[assignment]
            elif act.kind == "W":
                run_weight_grads(wq.pop(key, []), None if bk is None else bk.ready)
            else:
                part = self.part[(act.replica, act.stage)]
                me = (act.stage, part)
                kept = outputs.pop(key)
                ins = inputs.pop(key)
                roots: list[Any] = []  # GradientEdges (or tensors) and the loss
                grads: list[torch.Tensor | None] = []
                grad_bufs: list[torch.Tensor] = []
                for name, o in zip(st.outputs, kept, strict=True):
                    g: torch.Tensor | None = None
                    if o is not None and self._is_float(name):
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
                                    g = buf.to(o.dtype) if g is None else g + buf.to(o.dtype)
                                else:
                                    if g is None:
                                        g = o.zeros()
                                    g[self._rel(box, mine)] += buf.to(o.dtype)
                    if o is not None and o.requires_grad and g is not None:
                        roots.append(o.target)
                        grads.append(g)
                loss_t = losses.pop((act.replica, act.microbatch)) if (act.replica, act.microbatch) in losses else None
                if loss_t is not None and loss_t.numel() == 1:  # seeded with the scale: no scaled copy
                    roots.append(loss_t)
                    grads.append(torch.full_like(loss_t, scale * loss_scale))
                elif loss_t is not None:  # not a scalar: backward refuses it, as it should
                    roots.append(loss_t * (scale * loss_scale))
                    grads.append(None)
                sends = self._release_done(sends)  # before the backward's peak, as after a forward's inputs
                if roots:
                    with deferring(wq.setdefault(key, [])) if act.stage in self.deferred else contextlib.nullcontext():
                        torch.autograd.backward(roots, grads)
                del grads
                del grad_bufs  # consumed: freed when nothing else holds their storage
                held_bufs.pop(key, None)
                sends += self._send_input_grads(st, ins, act, me)
                # this micro-batch's inputs, outputs and loss die here, not at the next forward
                del ins, kept, roots, loss_t
                g = o = None
            if act.kind == last:
                b_left[act.stage] -= 1
            if bk is not None:  # this stage's gradients are final here ([Note: gradient sync])
                pending += self._close_buckets(bk)
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
            pieces.append((box, buf))
        if len(pieces) == 1 and pieces[0][0] == mine:
            t = pieces[0][1].detach()  # shares the receive buffer
            bufs.append(pieces[0][1])  # held until this micro-batch's backward
        else:  # tiles of another grid (or the whole image): assemble this part's region (the pieces die here)
            shape = self._piece_shape(name, mine)
            t = pieces[0][1].new_empty(shape)
            for box, buf in pieces:
                t[self._rel(box, mine)] = buf
        if train and t.is_floating_point():
            t.requires_grad_(True)
        return t, tuple(self._meta[name][0][2:])
