"""Inference on any batch and image size: an inference plan and engine per input shape.

[Note: eval plans] ``CompiledModel.eval_step(x)`` runs the model forward on the plan made for
``x``'s sample shape (every input's shape without the batch dim), not on the training plan:

* the first call with a sample shape plans for inference (``cm.plan(x1, train=False)``: one
  sample per micro-batch; rank 0 plans and broadcasts) and builds that plan's stages and
  engine; later calls with that shape reuse them. A model compiled from an inference plan file
  uses that plan for its shape; other shapes, and a model compiled from a training plan file,
  get inference plans made for the file's GPU count (``CompiledModel.inference_plan``).
* the weights are the trained ones: when they changed since the engine last ran (a training
  step, ``load_state_dict``, ``load_checkpoint``), every rank gathers the whole state dict
  (``all_gather_object`` of each rank's share) and copies it into its stages.
* a batch of any size runs in steps of the plan's ``micro-batch x micro_batches x dp``
  samples, the last one padded with copies of its last sample (dropped from the result: in
  eval mode no sample affects another's output; a lazy ``TiledInput`` step that needs padding
  is read whole first).
* the outputs (whole images, in batch order, in the structure the model returns) are gathered
  on rank 0 (``gather="rank0"``, the default; None elsewhere) or on every rank
  (``gather="all"``), moved to this rank's device. With ``y`` and a ``loss_fn`` the mean loss
  over the batch (padding excluded: every step's mean weighted by its real samples) is
  returned too, on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan
from nowdl.runtime.pipeline.engine import PipelineEngine
from nowdl.runtime.spatial.tiles import TiledInput
from nowdl.runtime.training.state import stage_tensors


class _Trainer(Protocol):
    """What the evaluator needs of ``runtime.training.trainer.Trainer``."""

    rank: int
    world: int
    weights_version: int

    def join_group(self) -> None: ...

    def full_state(self) -> dict[str, torch.Tensor] | None: ...

    def device(self) -> torch.device: ...

__all__ = ["copy_state", "Evaluator", "GATHER", "concat_outputs"]

GATHER = ("rank0", "all")

Key = tuple[tuple[int, ...], ...]


@dataclass
class _Runner:
    plan: Plan
    engine: PipelineEngine
    per: int  # samples per engine step
    version: int = -1  # the trainer's weights version last copied in (-1: none)


def _inputs(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


def _rows(t: Any, lo: int, hi: int, n: int) -> Any:
    """Samples ``lo .. hi-1`` of ``t`` (a tensor, TiledInput or None), padded to ``n`` rows with the last."""
    if t is None:
        return None
    if isinstance(t, TiledInput):
        if hi - lo == n:
            return t.rows(lo, hi)  # each rank reads its tile only
        t = t.rows(lo, hi).read()  # a short step: read whole, then pad
        lo, hi = 0, t.shape[0]
    part = t[lo:hi]
    if hi - lo < n:
        part = torch.cat([part, part[-1:].expand(n - (hi - lo), *part.shape[1:])])
    return part


def concat_outputs(outs: list[Any]) -> Any:
    """Outputs of several micro-batches (each a tensor or a structure of them) joined along the batch
    (one output is returned as it is: no copy)."""
    if len(outs) == 1:
        return outs[0]
    flat = [tree_flatten(o) for o in outs]
    leaves = [torch.cat([f[0][i] for f in flat]) if isinstance(flat[0][0][i], torch.Tensor) else flat[0][0][i]
              for i in range(len(flat[0][0]))]
    return tree_unflatten(leaves, flat[0][1])


def _take(out: Any, n: int) -> Any:
    leaves, spec = tree_flatten(out)
    return tree_unflatten([v[:n] if isinstance(v, torch.Tensor) else v for v in leaves], spec)


def _to(out: Any, device: torch.device) -> Any:
    leaves, spec = tree_flatten(out)
    return tree_unflatten([v.to(device) if isinstance(v, torch.Tensor) else v for v in leaves], spec)


def copy_state(engine: PipelineEngine, state: dict[str, torch.Tensor] | None) -> None:
    """Copy the whole model's ``state`` (original names, ``Trainer.full_state``) into ``engine``'s
    stages; None: nothing newer than the model's own weights (nothing trained or loaded)."""
    if state is None:
        return
    for _, s in engine.held:
        for orig, t, _ in stage_tensors(engine.stages[s]):
            if orig in state:
                with torch.no_grad():
                    t.copy_(state[orig])


class Evaluator:
    """The trainer's inference engines, one per input shape ([Note: eval plans])."""

    def __init__(self, trainer: _Trainer, build: Callable[[Plan, Any], PipelineEngine],
                 plan: Callable[[tuple[torch.Tensor, ...]], Plan]) -> None:
        self.trainer = trainer
        self.build = build  # (plan, example inputs) -> an engine holding this rank's stages of it
        self.plan = plan  # one-sample example inputs -> the inference plan (the same on every rank)
        self.runners: dict[Key, _Runner] = {}
        self.last: _Runner | None = None  # the runner of the latest run

    def plan_for(self, x: Any) -> Plan:
        """The plan ``eval_step(x)`` runs on (planned and cached on first use)."""
        return self._runner(x).plan

    def _runner(self, x: Any) -> _Runner:
        xs = _inputs(x)
        key = tuple(_shape(t)[1:] for t in xs)
        if key in self.runners:
            return self.runners[key]
        tr = self.trainer
        tr.join_group()
        examples = tuple(torch.empty((1,) + tuple(_example(t).shape[1:]), dtype=_example(t).dtype, device="meta")
                         for t in xs)
        plan = self.plan(examples)
        if plan.config["gpus"] != tr.world:
            raise NowdlError(f"the inference plan for samples of shape {list(key)} needs {plan.config['gpus']} ranks "
                             f"but the job has {tr.world}: compile with gpus={tr.world}")
        c = plan.config
        runner = _Runner(plan, self.build(plan, examples), int(plan.model["inputs"][0][0] * c["dp"] * c["micro_batches"]))
        self.runners[key] = runner
        return runner

    def _sync_weights(self, runner: _Runner) -> None:
        tr = self.trainer
        if runner.version == tr.weights_version:
            return
        copy_state(runner.engine, tr.full_state())
        runner.version = tr.weights_version

    def run(self, x: Any, y: Any = None, *, gather: str = "rank0") -> tuple[Any, float]:
        """Outputs of ``x`` (gathered as ``gather`` says) and the mean loss over ``y`` (NaN without)."""
        if gather not in GATHER:
            raise NowdlError(f"gather={gather!r}: use 'rank0' (outputs on rank 0, None elsewhere) or 'all' (every rank)")
        runner = self.last = self._runner(x)
        self._sync_weights(runner)
        xs = _inputs(x)
        n = int(_example(xs[0]).shape[0])
        if n < 1:
            raise NowdlError("eval_step got an empty batch: pass at least one sample")
        mine: list[Any] = []
        loss_sum, counted = 0.0, 0
        for lo in range(0, n, runner.per):
            hi = min(n, lo + runner.per)
            xi = tuple(_rows(t, lo, hi, runner.per) for t in xs)
            yi = _rows(y, lo, hi, runner.per) if isinstance(y, (torch.Tensor, TiledInput)) else None
            loss, outs = runner.engine.run(xi if isinstance(x, (list, tuple)) else xi[0], yi, train=False)
            if yi is not None and not math.isnan(loss):
                loss_sum += loss * (hi - lo)
                counted += hi - lo
            mine.append((lo, hi, concat_outputs(outs) if outs else None))
        out = self._gather(runner, mine, gather)
        return out, (loss_sum / counted if counted else math.nan)

    def _gather(self, runner: _Runner, mine: list[Any], gather: str) -> Any:
        """Each step's outputs from the ranks that made them, in batch order ([Note: eval plans])."""
        tr, eng = self.trainer, runner.engine
        dp = int(runner.plan.config["dp"])
        share = runner.per // dp  # samples of one step that each dp copy runs
        pieces = [(lo + eng.dp_index * share, lo + (eng.dp_index + 1) * share, hi, o) for lo, hi, o in mine
                  if o is not None]
        if tr.world > 1:
            box: list[Any] = [None] * tr.world
            local = [(a, b, c, _to(o, torch.device("cpu"))) for a, b, c, o in pieces]
            if gather == "all":
                dist.all_gather_object(box, local)
            else:
                dist.gather_object(local, box if tr.rank == 0 else None, dst=0)
                if tr.rank != 0:
                    return None
            pieces = [p for got in box for p in (got or [])]
        kept = []
        for a, b, hi, o in sorted(pieces, key=lambda p: p[0]):
            if a < hi:  # a step's padding is dropped
                kept.append(_take(o, min(b, hi) - a))
        if not kept:
            return None
        return _to(concat_outputs(kept), tr.device())


def _example(t: Any) -> Any:
    return t.meta() if isinstance(t, TiledInput) else t
