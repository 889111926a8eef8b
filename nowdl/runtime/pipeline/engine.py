"""The pipeline engine: runs one rank's schedule of forward/backward actions over torch.distributed.

[Note: exactness] One optimizer step equals one step of single-device training that runs the
same micro-batches with gradient accumulation: the global batch is cut into dp x replicas x m
micro-batches in the order (dp copy, replica, micro-batch); each micro-batch's loss is scaled by
1 / (dp x replicas x m) before backward, so the gradients summed over micro-batches, over the
two MASTER replicas and over data-parallel copies (all-reduce SUM, never an average of
averages) are exactly the gradient of the global mean loss. The reported loss is the mean of the
unscaled micro-batch losses. BatchNorm sees each micro-batch alone, as the single-device
reference does; running statistics update in micro-batch order.

The engine is composed of a :class:`~nowdl.runtime.pipeline.transfers.Transfers` (the messages),
a :class:`~nowdl.runtime.pipeline.grad_sync.GradSync` (gradient all-reduce, optimizer step) and a
:class:`~nowdl.runtime.pipeline.runner.ScheduleRunner` (what each action does); :meth:`PipelineEngine.run`
dispatches the actions to the runner by kind. See [Note: gradient sync] in
runtime/pipeline/grad_sync.py and [Note: communication] in runtime/pipeline/transfers.py.
"""

from __future__ import annotations

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
from nowdl.runtime.launch.where import set_action
from nowdl.runtime.pipeline.deferred_wgrad import enable
from nowdl.runtime.pipeline.grad_sync import GradSync
from nowdl.runtime.pipeline.rank_view import RankView
from nowdl.runtime.pipeline.ranks import Placement
from nowdl.runtime.pipeline.runner import ScheduleRunner, Step
from nowdl.runtime.pipeline.segment import SegmentRun, segment_names
from nowdl.runtime.pipeline.transfers import Transfers
from nowdl.runtime.spatial.stage import TiledStage
from nowdl.schedule import Action

__all__ = ["PipelineEngine", "Placement", "PRECISIONS", "check_precision"]


PRECISIONS = tuple(AUTOCAST_DTYPES)


def _checkpointed(checkpointing: bool | Sequence[int], k: int) -> set[int]:
    """The stages whose forward is recomputed in their backward."""
    if isinstance(checkpointing, bool):
        return set(range(k)) if checkpointing else set()
    bad = [i for i in checkpointing if not isinstance(i, int) or not 0 <= i < k]
    if bad:
        raise NowdlError(f"activation_checkpointing names stages {bad}, but the plan has stages 0..{k - 1}")
    return set(checkpointing)


def _process_groups(place: Placement, rank: int, dp_index: int
                    ) -> tuple[dict[int, Any], dict[tuple[int, int], Any]]:
    """Per held stage, the group of every rank holding a copy (gradient sync; None when only
    this rank does); per held (replica, stage) of several tiles, the group of its tiles. Every
    rank creates every group, in the same order."""
    groups: dict[int, Any] = {}
    for s in range(place.k):
        ranks = place.group_ranks(s)
        g = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            groups[s] = g
    tile_groups: dict[tuple[int, int], Any] = {}
    for (d, rep, s), prs in sorted(place.where.items()):  # same order on every rank
        g = dist.new_group(prs) if len(prs) > 1 else None
        if g is not None and d == dp_index and rank in prs:
            tile_groups[(rep, s)] = g
    return groups, tile_groups


def _lanes(place: Placement, stages: Sequence[StageModule], rank: int) -> dict[tuple[int, int, int], Any]:
    """(sender, receiver, replica) -> the process group of that lane, for every pair of ranks that
    exchange stage values of a replica and include ``rank`` ([Note: p2p lanes] in
    runtime/pipeline/transfers.py). Every rank creates every group, in the same order."""
    lanes: set[tuple[int, int, int]] = set()
    for c, st in enumerate(stages):
        for p in {p for p in st.producers.values() if 0 <= p < place.k and p != c}:
            for (d, rep, s), consumers in place.where.items():
                if s == c and (d, rep, p) in place.where:
                    for a in place.where[(d, rep, p)]:
                        lanes.update((x, y, rep) for b in consumers for x, y in ((a, b), (b, a)) if x != y)
    mine: dict[tuple[int, int, int], Any] = {}
    for lane in sorted(lanes):
        g = dist.new_group(sorted(lane[:2]))
        if rank in lane[:2]:
            mine[lane] = g
    return mine


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
            their backward, besides the plan's ``recompute`` stages (less memory, the same
            weights: [Note: recompute exactness] in runtime/pipeline/recompute.py). The plan's
            ``offload`` stages keep their saved activations in host memory ([Note: offload]).
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
        forced = _checkpointed(checkpointing, len(plan.stages))
        self.checkpointed = forced | {s.index for s in plan.stages if s.recompute}
        view = self.view = RankView.build(plan, stages, rank, device, self.comm_dtype)
        self.place, self.m, self.k, self.dp_index = view.place, view.m, view.k, view.dp_index
        self.held, self.part, self.parts, self.stages = view.held, view.part, view.parts, view.stages
        for _, s in self.held:
            self.stages[s].module.to(device)
        self.actions: list[Action] = view.actions
        # one module per held stage; MASTER's two copies of the same stage on one rank share it
        params: dict[int, nn.Parameter] = {}
        for _, s in self.held:
            params.update((id(p), p) for p in self.stages[s].module.parameters())
        self.params = list(params.values())
        self.optimizer = optimizer(self.params) if optimizer is not None and self.params else None
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        groups, tile_groups = _process_groups(self.place, rank, self.dp_index) if distributed else ({}, {})
        self.sync = GradSync(self.place, self.stages, groups, self.params, self.optimizer, device, timeout_s,
                             scaling=precision == "fp16", has_loss=loss_fn is not None, m=self.m)
        if distributed:
            self.sync.sync_initial_weights()
        elif any(p > 1 for p in self.parts):
            raise NowdlError("this plan has spatial stages, which need several ranks: launch it with torchrun "
                             f"--nproc-per-node {len(plan.ranks)}")
        self.tiled: dict[tuple[int, int], TiledStage] = {}
        for rep, s in self.held:
            st = plan.stages[s]
            if self.parts[s] > 1 or st.tiles_per_gpu > 1:  # one rank may run sequential tiles too
                self.tiled[(rep, s)] = TiledStage(self.stages[s], st.grid, self.place.part_ranks(self.dp_index, rep, s),
                                                  rank, tile_groups.get((rep, s)), fused=st.fused,
                                                  tiles_per_gpu=st.tiles_per_gpu,
                                                  norm_schedule=st.norm_schedule or "passes")
        data = {n for st in stages for n, p in st.producers.items() if p < 0}
        self._check_spatial_values()
        self.transfers = Transfers(view, timeout_s, _lanes(self.place, stages, rank) if distributed else {})
        has_w = any(a.kind == "W" for a in self.actions)  # zero bubble: W computes the weight gradients
        self.deferred = {s for rep, s in self.held if has_w and (rep, s) not in self.tiled
                         and s not in self.checkpointed and enable(self.stages[s].module)}
        self.runner = ScheduleRunner(view, self.transfers, self.sync, tiled=self.tiled, loss_fn=loss_fn,
                                     checkpointed=self.checkpointed, deferred=self.deferred,
                                     data_names=[n for n in plan.stages[0].nodes if n in data],
                                     offloaded=frozenset(s.index for s in plan.stages if s.offload),
                                     segments=self._segments(forced))
        self.offload = self.runner.offload  # its byte counters: [Note: offload]
        self._kinds: dict[str, Callable[[Step, Action], None]] = {
            "F": self.runner.forward, "B": self.runner.backward, "W": self.runner.weight_grads,
        }

    def _segments(self, forced: set[int]) -> dict[int, SegmentRun]:
        """The held plan stages that recompute a segment only ([Note: recompute segment]); a stage
        ``checkpointing`` forces recomputes whole."""
        out: dict[int, SegmentRun] = {}
        for rep, s in self.held:
            st = self.plan.stages[s]
            if st.recompute and st.recompute_segment and s not in forced:
                if (rep, s) in self.tiled:
                    raise NowdlError(f"stage {s} runs on tiles and has recompute_segment {st.recompute_segment}: a tiled "
                                     "stage recomputes whole; drop the stage's recompute_segment (or re-plan)")
                mod = self.stages[s].module
                out[s] = SegmentRun(mod, segment_names(st.nodes, st.recompute_segment, mod, f"stage {s}"))
        return out

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale (1 without fp16)."""
        return self.sync.loss_scale

    def _check_spatial_values(self) -> None:
        for t in self.plan.tensors:
            ends = [t.from_stage] + [c for c in t.to_stages if c < self.k]
            if any(self.parts[s] > 1 for s in ends) and len(t.shape) < 3:
                raise NowdlError(
                    f"value {t.producer!r} of shape {t.shape} crosses between stages {ends}, one of them spatial, but it "
                    "is not an (N, C, *spatial) image tensor that can be cut into tiles: re-plan so the spatial "
                    "region ends elsewhere"
                )

    def run(self, x: Any, y: Any, *, train: bool = True) -> tuple[float, list[Any]]:
        """Run one step (train: forward+backward+sync+step; else forward only): each action goes
        to the runner's method for its kind.

        Returns the mean loss over the global batch (every rank gets the same float; NaN when no
        loss_fn) and the outputs of the micro-batches whose last stage runs here (eval).
        """
        step = self.runner.begin(x, y, train)
        for idx, act in enumerate(self.actions):
            if train or act.kind == "F":
                set_action(act)  # named in a lost peer's message (runtime/launch/where.py)
                self.runner.before(step, idx, act)
                self._kinds[act.kind](step, act)
                self.runner.after(step, act)
        set_action(None)
        return self.runner.end(step)
