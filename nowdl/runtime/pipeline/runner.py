"""The schedule runner: what one rank does for each forward (F), backward (B) and weight-gradient (W) action.

The engine (``engine.py``) dispatches a step's actions to :meth:`ScheduleRunner.forward`,
:meth:`~ScheduleRunner.backward` and :meth:`~ScheduleRunner.weight_grads`, between
:meth:`~ScheduleRunner.before` and :meth:`~ScheduleRunner.after`; :class:`Step` holds what a
micro-batch keeps from its forward to its backward. See [Note: exactness] in engine.py.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nowdl.codegen.stage import StageModule
from nowdl.errors import NowdlError
from nowdl.runtime.launch import faults
from nowdl.runtime.launch.group import wait
from nowdl.runtime.pipeline.deferred_wgrad import WeightGrad, capturing, deferring, run_weight_grads
from nowdl.runtime.pipeline.grad_sync import Bucket, Buckets, GradSync
from nowdl.runtime.pipeline.micro_batches import detach, split_batch
from nowdl.runtime.pipeline.offload import Offload
from nowdl.runtime.pipeline.output_roots import Root
from nowdl.runtime.pipeline.rank_view import RankView
from nowdl.runtime.pipeline.recompute import Recompute
from nowdl.runtime.pipeline.segment import SegmentRun
from nowdl.runtime.pipeline.transfers import Send, StepReceives, Transfers
from nowdl.runtime.spatial.exchange import Window
from nowdl.runtime.spatial.stage import TiledStage
from nowdl.runtime.spatial.tiles import TiledInput, TileGrid
from nowdl.schedule import Action

__all__ = ["ScheduleRunner", "Step"]

_Key = tuple[int, int, int]  # replica, stage, micro-batch


@dataclass
class Step:
    """One step's state: this rank's micro-batches, its receives, what each micro-batch keeps
    from its forward to its backward, the sends in flight and the gradient buckets launched."""

    train: bool
    xs: dict[tuple[int, int], Any]  # (replica, micro-batch) -> input chunk
    ys: dict[tuple[int, int], Any]  # (replica, micro-batch) -> target chunk
    rx: StepReceives
    scale: float  # 1 / (dp x replicas x m): each micro-batch's share of the mean loss
    loss_scale: float  # fp16 loss scale (1 in eval)
    left: dict[int, int]  # per stage, its final gradient actions still to run ([Note: gradient sync])
    bucket: Buckets | None = None  # open during a stage's last gradient action
    held_bufs: dict[_Key, list[torch.Tensor]] = field(default_factory=dict)
    wq: dict[_Key, list[WeightGrad]] = field(default_factory=dict)
    pending: list[Bucket] = field(default_factory=list)  # launched gradient buckets
    inputs: dict[_Key, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[_Key, list[Root | None]] = field(default_factory=dict)
    losses: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    sends: list[Send] = field(default_factory=list)
    final: list[Any] = field(default_factory=list)  # eval: the model outputs made here
    loss_sum: float = 0.0


class ScheduleRunner:
    """Runs one rank's actions on its stages, moving tensors with ``transfers`` and reducing
    gradients with ``sync``.

    Args:
        view: this rank's part of the plan.
        transfers: its messages.
        sync: its gradient sync and optimizer step.
        tiled: the spatial stages it holds, by (replica, stage).
        loss_fn: ``loss_fn(output, target) -> scalar``, or None.
        checkpointed: stages whose forward is recomputed in their backward ([Note: recompute exactness]).
        offloaded: stages whose saved activations wait in host memory ([Note: offload]).
        segments: checkpointed stages that recompute only a segment ([Note: recompute segment]).
        deferred: stages whose weight gradients wait for their ``W`` action (zero bubble).
        data_names: the model inputs in the order a tuple batch gives them.
    """

    def __init__(self, view: RankView, transfers: Transfers, sync: GradSync, *,
                 tiled: dict[tuple[int, int], TiledStage], loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 checkpointed: set[int], deferred: set[int], data_names: list[str],
                 offloaded: frozenset[int] = frozenset(), segments: dict[int, SegmentRun] | None = None) -> None:
        self.view, self.transfers, self.sync = view, transfers, sync
        self.segments = segments or {}  # recomputed stages that recompute a segment only
        self.tiled, self.loss_fn = tiled, loss_fn
        self.checkpointed, self.deferred, self.data_names = checkpointed, deferred, data_names
        self.recompute = Recompute(checkpointed, view.device)
        self.offload = Offload(set(offloaded) - checkpointed, view.device)
        # per action, the next backward of an offloaded stage (prefetched while the action runs)
        self.next_b: list[Action | None] = [None] * len(view.actions)
        nxt: Action | None = None
        for i in range(len(view.actions) - 1, -1, -1):
            self.next_b[i] = nxt
            if view.actions[i].kind == "B":
                nxt = view.actions[i] if view.actions[i].stage in self.offload else None
        # zero bubble: B computes input gradients, W the deferred weight gradients
        self.final_kind = "W" if any(a.kind == "W" for a in view.actions) else "B"  # gradients are final after it
        self.final_left = Counter(a.stage for a in view.actions if a.kind == self.final_kind)
        # None: the model's output is gathered whole; a dict: an inference step keeps a spatial
        # stage's model output as this rank's tile and records id(tile) -> (grid, group) here
        self.skip_nonfinite = False  # [Note: non-finite steps]: skip them instead of stopping
        self.skipped = 0  # steps skipped for a non-finite loss or gradient
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # buffers before a step that may be skipped
        self.kept_tiles: dict[int, tuple[TileGrid, Any]] | None = None

    def begin(self, x: Any, y: Any, train: bool) -> Step:
        """Cut the batch, reset the gradients and the modules' mode, and plan the step's receives."""
        xs, ys = self._local_chunks(x), self._local_chunks(y)
        if train:
            self.sync.zero_grad()
            if self.skip_nonfinite:  # a skipped step leaves the buffers (BatchNorm's statistics) as they were
                self._buffers = [(b, b.detach().clone()) for _, s in self.view.held
                                 for b in self.view.stages[s].module.buffers()]
        for _, s in self.view.held:
            module = self.view.stages[s].module
            if any(m.training != train for m in module.modules()):  # train() sets every module's flag: slow
                module.train(train)
        place = self.view.place
        self.offload.begin_step()
        return Step(train=train, xs=xs, ys=ys, rx=self.transfers.start_step(train),
                    scale=1.0 / (place.dp * place.replicas * self.view.m),
                    loss_scale=self.sync.loss_scale if train else 1.0, left=dict(self.final_left))

    def end(self, step: Step) -> tuple[float, list[Any]]:
        """Wait for the sends left, finish the gradient sync, step; the mean loss and the outputs."""
        for w, what, _, q, _ in step.sends:
            wait(w, timeout_s=self.transfers.timeout_s, what=what, peer=q)
        if step.train:
            self.sync.finish(step.pending)
            mean, stepped = self.sync.check_and_step(step.loss_sum, skip_nonfinite=self.skip_nonfinite)
            if not stepped:
                self.skipped += 1
                with torch.no_grad():
                    for b, old in self._buffers:
                        b.copy_(old)
            self._buffers = []
            return mean, step.final
        return self.sync.mean_loss(step.loss_sum), step.final

    def _local_chunks(self, batch: Any) -> dict[tuple[int, int], Any]:
        place, m = self.view.place, self.view.m
        total = place.dp * place.replicas * m
        chunks = split_batch(batch, total, f"dp {place.dp} x replicas {place.replicas} x micro_batches {m}")
        base = self.view.dp_index * place.replicas
        return {(rep, i): chunks[(base + rep) * m + i] for rep in range(place.replicas) for i in range(m)}

    def before(self, step: Step, idx: int, act: Action) -> None:
        """Post the receives due, release the sends done; open the buckets of a stage's last
        gradient action ([Note: gradient sync])."""
        self.transfers.post_upto(step.rx, idx)
        step.sends = self.transfers.release_done(step.sends)
        last = act.kind == self.final_kind and step.left[act.stage] == 1
        step.bucket = self.sync.open_buckets(act.stage) if last else None
        ahead = self.next_b[idx]
        if step.train and ahead is not None:  # [Note: offload]: copied back while this action runs
            self.offload.prefetch((ahead.replica, ahead.stage, ahead.microbatch))

    def after(self, step: Step, act: Action) -> None:
        """Count the gradient action; launch what is left of a stage's buckets once its gradients are final."""
        if act.kind == self.final_kind:
            step.left[act.stage] -= 1
        if step.bucket is not None:
            step.pending += self.sync.close_buckets(step.bucket)
            step.bucket = None

    def forward(self, step: Step, act: Action) -> None:
        """Receive the inputs, run the stage, send the outputs; at the last stage, the loss."""
        if step.train:
            faults.point("train.forward")
        key = (act.replica, act.stage, act.microbatch)
        st = self.view.stages[act.stage]
        tiled = self.tiled.get((act.replica, act.stage))
        bufs: list[torch.Tensor] = []
        ins: list[torch.Tensor] = []
        shapes: list[tuple[int, ...]] = []
        for name in st.inputs:
            t_in, full = self._input(step, st, name, act, bufs, tiled)
            ins.append(t_in)
            shapes.append(full)
        step.held_bufs[key] = bufs
        step.sends = self.transfers.release_done(step.sends)  # what just arrived may show a peer ready for them
        with capturing(step.train and act.stage in self.deferred):
            outs, grids = self._run_stage(key, st, ins, shapes, step.train, tiled)
        step.inputs[key] = ins
        model_out: dict[str, torch.Tensor] = {}
        for name, t, g_out in zip(st.outputs, outs, grids, strict=True):
            self._send_output(step, act, st, name, t, g_out, model_out)
        if model_out:  # the model's output as the model returns it (tensor, tuple, list, dict)
            self._loss(step, act, st, model_out)
        if not step.train:
            step.inputs.pop(key)
            step.held_bufs.pop(key)
        else:  # a model output no stage reads is not kept: the loss is the backward's root
            step.outputs[key] = [None if all(c == self.view.k for c in st.consumers.get(n, [])) else Root(o)
                                 for n, o in zip(st.outputs, outs, strict=True)]  # [Note: backward roots]

    def _send_output(self, step: Step, act: Action, st: StageModule, name: str, t: torch.Tensor,
                     g_out: TileGrid | None, model_out: dict[str, torch.Tensor]) -> None:
        """Send output ``name`` to the stages reading it; keep it whole in ``model_out`` when the
        model returns it."""
        tiled = self.tiled.get((act.replica, act.stage))
        for c in st.consumers.get(name, []):
            if c != self.view.k:
                step.sends += self.transfers.send_forward(name, t, act, c)
                continue
            keep = self.kept_tiles is not None and not step.train and tiled is not None and g_out is not None
            whole = t if keep or tiled is None or g_out is None else g_out.gather(t, tiled.group)
            out = whole.float() if self.view.comm_dtype and whole.is_floating_point() else whole
            if keep and self.kept_tiles is not None and tiled is not None and g_out is not None:
                self.kept_tiles[id(out)] = (g_out, tiled.group)
            model_out[name] = out

    def _loss(self, step: Step, act: Action, st: StageModule, model_out: dict[str, torch.Tensor]) -> None:
        part = self.view.part[(act.replica, act.stage)]
        result = self._model_output(st, model_out)
        yi = step.ys[(act.replica, act.microbatch)]
        if self.loss_fn is not None and yi is not None:
            loss = self.loss_fn(result, yi.to(self.view.device) if isinstance(yi, torch.Tensor) else yi)
            step.losses[(act.replica, act.microbatch)] = loss
            if part == 0:  # every tile computes the same loss: count it once
                step.loss_sum += float(loss.detach())
        if not step.train and part == 0:
            step.final.append(detach(result))

    def backward(self, step: Step, act: Action) -> None:
        """Receive the outputs' gradients, run the backward (deferring the weight gradients of a
        zero-bubble stage), send the inputs' gradients."""
        faults.point("train.backward")
        key = (act.replica, act.stage, act.microbatch)
        st = self.view.stages[act.stage]
        me = (act.stage, self.view.part[(act.replica, act.stage)])
        if act.stage in self.recompute:  # first, on every tile alike ([Note: recompute in spatial stages])
            self.recompute.recompute(key)
        kept = step.outputs.pop(key)
        ins = step.inputs.pop(key)
        roots: list[Any] = []  # GradientEdges (or tensors) and the loss
        grads: list[torch.Tensor | None] = []
        grad_bufs: list[torch.Tensor] = []
        for name, o in zip(st.outputs, kept, strict=True):
            g = self._output_grad(step, act, st, me, name, o, grad_bufs)
            if o is not None and o.requires_grad and g is not None:
                roots.append(o.target)
                grads.append(g)
        self._loss_root(step, act, roots, grads)
        step.sends = self.transfers.release_done(step.sends)  # before the backward's peak, as after a forward's inputs
        if roots:
            sink = deferring(step.wq.setdefault(key, [])) if act.stage in self.deferred else contextlib.nullcontext()
            with sink:
                torch.autograd.backward(roots, grads)
        del grads
        del grad_bufs  # consumed: freed when nothing else holds their storage
        self.recompute.drop(key)
        self.offload.drop(key)
        step.held_bufs.pop(key, None)
        step.sends += self.transfers.send_input_grads(st, ins, act, me)

    def _output_grad(self, step: Step, act: Action, st: StageModule, me: tuple[int, int], name: str,
                     o: Root | None, grad_bufs: list[torch.Tensor]) -> torch.Tensor | None:
        """The gradient of output ``name`` summed over the pieces its consumers send back."""
        tr = self.transfers
        if o is None or not tr.is_float(name):
            return None
        g: torch.Tensor | None = None
        for c, j, box in tr.consumer_pieces(name, me, st.consumers.get(name, [])):
            buf = tr.take(step.rx, ("B", name, c, act.replica, act.microbatch, j), f"gradient of {name} from stage {c}")
            grad_bufs.append(buf)
            g = self._add_piece(g, o, buf, box, tr.box(name, *me) if box else ())
        return g

    def _add_piece(self, g: torch.Tensor | None, o: Root, buf: torch.Tensor, box: Window, mine: Window
                   ) -> torch.Tensor:
        if box == mine:
            return buf.to(o.dtype) if g is None else g + buf.to(o.dtype)
        if g is None:
            g = o.zeros()
        g[self.transfers.rel(box, mine)] += buf.to(o.dtype)
        return g

    @staticmethod
    def _loss_root(step: Step, act: Action, roots: list[Any], grads: list[torch.Tensor | None]) -> None:
        """Add the micro-batch's loss to the backward's roots, seeded with its scale."""
        loss_t = step.losses.pop((act.replica, act.microbatch), None)
        if loss_t is not None and loss_t.numel() == 1:  # seeded with the scale: no scaled copy
            roots.append(loss_t)
            grads.append(torch.full_like(loss_t, step.scale * step.loss_scale))
        elif loss_t is not None:  # not a scalar: backward refuses it, as it should
            roots.append(loss_t * (step.scale * step.loss_scale))
            grads.append(None)

    def weight_grads(self, step: Step, act: Action) -> None:
        """Zero bubble's W: the weight gradients the backward deferred."""
        key = (act.replica, act.stage, act.microbatch)
        run_weight_grads(step.wq.pop(key, []), None if step.bucket is None else step.bucket.ready)

    @staticmethod
    def _model_output(st: StageModule, values: dict[str, torch.Tensor]) -> Any:
        """The last stage's outputs in the structure the model returns them (see ``output_tree``)."""
        from nowdl.codegen.stage import fill_outputs

        if st.output_tree is None:
            flat = list(values.values())
            return flat[0] if len(flat) == 1 else tuple(flat)
        return fill_outputs(st.output_tree, [values.get(n) for n in st.outputs])

    def _run_stage(self, key: _Key, st: StageModule, ins: list[torch.Tensor], shapes: list[tuple[int, ...]],
                   train: bool, tiled: TiledStage | None) -> tuple[list[torch.Tensor], list[TileGrid | None]]:
        grids: list[TileGrid | None] = [None] * len(st.outputs)

        def run(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if tiled is None:
                return tuple(st.module(*xs))
            outs, gs = tiled(xs, shapes)
            grids[:] = gs
            return tuple(outs)

        def call() -> tuple[torch.Tensor, ...]:
            with torch.set_grad_enabled(train), self._autocast():
                return run(*ins)

        seg = self.segments.get(st.index) if tiled is None else None
        if train and st.index in self.recompute and seg is not None:
            def segment(hooks: Any, replay: bool, seg: SegmentRun = seg) -> Any:
                with torch.set_grad_enabled(train), self._autocast():
                    return seg(ins, hooks, replay)

            return list(self.recompute.forward(key, seg.owner, call, segment)), grids
        if train and st.index in self.recompute:
            return list(self.recompute.forward(key, st.module, call)), grids
        if train and st.index in self.offload:
            with self.offload.saving(key, ins, [st.module]):
                return list(call()), grids
        return list(call()), grids

    def _autocast(self) -> Any:
        dtype = self.view.comm_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.view.device.type, dtype=dtype)

    def _input(self, step: Step, st: StageModule, name: str, act: Action, bufs: list[torch.Tensor],
               tiled: TiledStage | None) -> tuple[torch.Tensor, tuple[int, ...]]:
        """This stage's input ``name`` (its tile, for a spatial stage) and the value's full spatial shape."""
        p = st.producers[name]
        if p < 0:
            return self._data_input(st, name, step.xs[(act.replica, act.microbatch)], tiled)
        tr, parts = self.transfers, self.view.parts
        part = self.view.part[(act.replica, act.stage)]
        mine = tr.box(name, st.index, part) if parts[st.index] > 1 or parts[p] > 1 else ()
        pieces = [(box, tr.take(step.rx, ("F", name, act.replica, act.microbatch, i), f"{name} from stage {p}"))
                  for i, box in tr.producer_pieces(name, p, (st.index, part))]
        if len(pieces) == 1 and pieces[0][0] == mine:
            t = pieces[0][1].detach()  # shares the receive buffer
            bufs.append(pieces[0][1])  # held until this micro-batch's backward
        else:  # tiles of another grid (or the whole image): assemble this part's region (the pieces die here)
            t = pieces[0][1].new_empty(tr.piece_shape(name, mine))
            for box, buf in pieces:
                t[tr.rel(box, mine)] = buf
        if step.train and t.is_floating_point():
            t.requires_grad_(True)
        return t, tuple(self.view.meta[name][0][2:])

    def _data_input(self, st: StageModule, name: str, x: Any, tiled: TiledStage | None
                    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """A model input read from the batch (only this rank's tile of a spatial stage)."""
        data = x if isinstance(x, (torch.Tensor, TiledInput)) else x[self.data_names.index(name)]
        full = tuple(int(n) for n in data.shape[2:])
        if isinstance(data, TiledInput):  # read only what this rank holds
            data = data.read(tiled.grid_of(full).tile_bounds() if tiled is not None else None)
        elif tiled is not None:
            if data.dim() < 3:
                raise NowdlError(f"model input {name!r} of shape {tuple(data.shape)} feeds spatial stage {st.index} "
                                 "but is not an (N, C, *spatial) image: re-plan without that spatial stage")
            data = tiled.grid_of(full).split(data)
        return data.to(self.view.device), full
