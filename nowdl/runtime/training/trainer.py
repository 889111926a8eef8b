"""The training API behind CompiledModel.train_step / eval_step / state_dict / checkpoints."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan
from nowdl.plan.purpose import require_training
from nowdl.runtime.launch.nodes import check_node_map
from nowdl.runtime.launch.where import set_step
from nowdl.runtime.pipeline.engine import PipelineEngine
from nowdl.runtime.spatial.tiles import TiledInput
from nowdl.runtime.training.checkpoint import CheckpointError, open_checkpoint, save_checkpoint
from nowdl.runtime.training.input_check import InputSpec, check_step_inputs, input_spec, with_target
from nowdl.runtime.training.plan_share import plan_on_rank0
from nowdl.runtime.training.state import (
    StateSource,
    bind_optimizer,
    load_optimizer_state,
    optimizer_snapshot,
    stage_tensors,
    state_names,
)

__all__ = ["Trainer", "Compiled"]

log = logging.getLogger(__name__)
_NEEDS_ENGINE = "load_checkpoint needs the engine: run a step first or pass a batch as x"


class Compiled(Protocol):
    """What the trainer needs of a compiled model (``nowdl.CompiledModel`` is one)."""

    model: nn.Module
    plan_path: str | None
    request: Any
    precision: str
    device: str | torch.device | None
    activation_checkpointing: bool | list[int]

    def trace(self, *example_inputs: torch.Tensor) -> Any: ...

    def plan(self, *example_inputs: torch.Tensor, target: Any = None) -> Plan: ...

    def inference_plan(self, *example_inputs: torch.Tensor) -> Plan: ...


def _example(t: Any) -> Any:
    return t.meta() if isinstance(t, TiledInput) else t


def _first_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, (torch.Tensor, TiledInput)):
        return _example(x)
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], (torch.Tensor, TiledInput)):
        return _example(x[0])
    raise NowdlError(f"train_step/eval_step take a tensor (or a tuple of tensors) as x, got {type(x).__name__}")


class Trainer:
    """Owns this rank's engine; set up lazily on the first step (plans if needed)."""

    optimizer = property(lambda self: self.cm.optimizer)  # built on first use; bound to the stages' at set-up

    def __init__(self, cm: Compiled, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None, timeout_s: float = 300.0,
                 backend: str | None = None) -> None:
        self.cm = cm
        self.steps = 0  # optimizer steps taken (restored by load_checkpoint)
        self.pending_state: dict[str, torch.Tensor] | None = None  # load_state_dict before set-up
        self.loss_fn = loss_fn
        self.timeout_s = timeout_s
        self.backend = backend
        self.engine: PipelineEngine | None = None
        self.plan: Plan | None = None
        self.rank = 0
        self.world = 1
        self._aliases: dict[str, list[str]] = {}
        self._unused: dict[str, torch.Tensor] = {}
        self._order: list[str] = []  # the model's state_dict() keys, in its order
        self._keys: set[str] = set()
        self.weights_version = 0  # bumped whenever the weights change (eval engines copy them then)
        self._evaluator: Any = None  # runtime.training.evaluate.Evaluator, made on the first eval_step
        self._inputs: InputSpec | None = None  # [Note: input check]

    # ---- set-up ----------------------------------------------------------------------------------
    def _setup(self, x: Any, y: Any = None) -> PipelineEngine:
        if self.engine is not None:
            return self.engine
        from nowdl.codegen import build_stages
        from nowdl.runtime.training.report_once import install

        install()  # [Note: API errors under a launcher]
        self.join_group()
        first = _first_tensor(x)
        plan = self._plan_everywhere(x, y)
        require_training(plan, f"plan {self.cm.plan_path}" if self.cm.plan_path else "the plan")
        if plan.config["gpus"] != self.world:
            raise NowdlError(
                f"this plan needs {plan.config['gpus']} ranks (gpus) but the job has {self.world}: launch with "
                f"torchrun --nproc-per-node {plan.config['gpus']} (or re-plan with gpus={self.world})"
            )
        check_node_map(plan, self.world)  # a launch that splits a tile group / MASTER pair the plan keeps on one node
        per = plan.config["dp"] * plan.config["replicas"] * plan.config["micro_batches"]
        mb = plan.model["inputs"][0][0]
        if first.shape[0] != mb * per:
            raise NowdlError(
                f"the global batch has {first.shape[0]} samples but this plan takes {mb * per} per step "
                f"(micro-batch {mb} x micro_batches {plan.config['micro_batches']} x replicas "
                f"{plan.config['replicas']} x dp {plan.config['dp']}): pass {mb * per} samples or re-plan"
            )
        self._inputs = input_spec(plan.model["inputs"], mb * per, x, y)
        example = tuple(_example(t)[:mb] for t in (x if isinstance(x, (list, tuple)) else (x,)))
        traced = self.cm.trace(*example)
        plan.check_model(traced.fingerprint, [list(t.shape) for t in example])
        stages = build_stages(traced.gm, plan)
        self._aliases, self._unused, self._order = state_names(self.cm.model, stages)
        self._keys = set(self._order)
        device = self.device()
        self.plan = plan
        opt = self.optimizer
        self.engine = PipelineEngine(plan, stages, self.rank, optimizer=None if opt is None else (lambda _params: opt),
                                     loss_fn=self.loss_fn, device=device, timeout_s=self.timeout_s,
                                     precision=self.cm.precision, checkpointing=self.cm.activation_checkpointing)
        if opt is not None:
            bind_optimizer(opt, self.cm.model, [self.engine.stages[s] for _, s in self.engine.held])
        if self.pending_state is not None:
            sd, self.pending_state = self.pending_state, None
            self.load_state_dict(sd)
        return self.engine

    def join_group(self) -> None:
        """Join the launcher's process group (once), setting ``rank`` and ``world``."""
        from nowdl.runtime.launch.group import init_distributed, launch_env

        if launch_env().world_size > 1 or dist.is_initialized():
            init_distributed(backend=self.backend, timeout_s=self.timeout_s)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state on every rank (collective), or None before the first step (the
        model itself then holds the weights)."""
        if self.engine is None:
            return None
        mine = self._owned()
        if self.world == 1:
            return mine
        box: list[Any] = [None] * self.world
        dist.all_gather_object(box, mine)
        return {k: v for part in box for k, v in part.items()}

    def _eval_engine(self, plan: Plan, examples: Any) -> PipelineEngine:
        from nowdl.codegen import build_stages

        traced = self.cm.trace(*examples)
        plan.check_model(traced.fingerprint, [list(t.shape) for t in examples])
        return PipelineEngine(plan, build_stages(traced.gm, plan), self.rank, optimizer=None, loss_fn=self.loss_fn,
                              device=self.device(), timeout_s=self.timeout_s, precision=self.cm.precision)

    def device(self) -> torch.device:
        """This rank's device."""
        if self.cm.device is not None:
            dev = torch.device(self.cm.device)
            if dev.type == "cuda" and dev.index is not None and dist.is_initialized() and dist.get_backend() == "nccl":
                bound = torch.cuda.current_device()  # cuda:LOCAL_RANK ([Note: NCCL device])
                if dev.index != bound:
                    raise NowdlError(f"rank {self.rank}: compile(device={str(dev)!r}) but NCCL bound this rank to "
                                     f"cuda:{bound} (its LOCAL_RANK): pass device='cuda' (each rank its own GPU) or "
                                     "leave device unset")
            return dev
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _plan_everywhere(self, x: Any, y: Any = None) -> Plan:
        """Rank 0 plans (or loads) and broadcasts the plan, so every rank runs the same one."""
        if self.cm.plan_path is not None:
            return Plan.load(self.cm.plan_path)
        return plan_on_rank0(lambda: self._plan_here(x, y), rank=self.rank, world=self.world)

    def _plan_here(self, x: Any, y: Any = None) -> Plan:
        """Plan for one micro-batch of every model input (a model may take several)."""
        xs = tuple(_example(t) for t in (x if isinstance(x, (list, tuple)) else (x,)))
        first = xs[0]
        req = self.cm.request
        n = int(first.shape[0])
        b = 1  # micro-batch size: one sample, unless m, replicas and dp are all pinned
        if req is not None and req.micro_batches and req.replicas and req.dp:
            per = req.micro_batches * req.replicas * req.dp
            if n % per:
                raise NowdlError(f"the global batch of {n} samples does not split into micro_batches "
                                 f"{req.micro_batches} x replicas {req.replicas} x dp {req.dp} = {per}")
            b = n // per
        if req is not None and req.global_batch is None:
            self.cm.request = dataclasses.replace(req, global_batch=n)
        elif req is not None and req.global_batch != n:
            raise NowdlError(f"compile(global_batch={req.global_batch}) but the first step has {n} samples: pass "
                             f"batches of {req.global_batch} samples, or compile with global_batch={n}")
        examples = tuple(torch.empty((b,) + tuple(t.shape[1:]), dtype=t.dtype, device="meta") for t in xs)
        target = y[:b] if isinstance(y, torch.Tensor) and y.dim() and y.shape[0] == n else None  # [Note: loss memory]
        return self.cm.plan(*examples, target=target)

    # ---- steps -----------------------------------------------------------------------------------
    def train_step(self, x: Any, y: Any) -> float:
        set_step(self.steps + 1)  # named in a lost peer's message (runtime/launch/where.py)
        eng = self._setup(x, y)
        if self._inputs is not None:  # every step, before any communication [Note: input check]
            self._inputs = with_target(self._inputs, y)
            check_step_inputs(self._inputs, x, y)
        eng.runner.skip_nonfinite = bool(getattr(self.cm, "skip_nonfinite", False))
        loss, _ = eng.run(x, y, train=True)
        self.steps += 1
        self.weights_version += 1
        return loss

    def evaluate(self, x: Any, y: Any = None, *, gather: str = "rank0") -> tuple[Any, float]:
        """Inference on any batch and sample shape on its inference plan ([Note: eval plans] in
        evaluate.py): the outputs (whole images, batch order; on rank 0, or every rank with
        ``gather="all"``, else None) and the mean loss over ``y`` (NaN without a target or loss)."""
        return self.evaluator().run(x, y, gather=gather)

    def evaluator(self) -> Any:
        """The inference engines of ``evaluate`` (``runtime.training.evaluate.Evaluator``), made once."""
        if self._evaluator is None:
            from nowdl.runtime.training.evaluate import Evaluator

            self._evaluator = Evaluator(self, self._eval_engine, lambda ex: plan_on_rank0(
                lambda: self.cm.inference_plan(*ex), rank=self.rank, world=self.world))
        return self._evaluator

    # ---- state -----------------------------------------------------------------------------------
    def _owned(self) -> dict[str, torch.Tensor]:
        """This rank's share of the model under original names (replica 0, dp copy 0 owners)."""
        eng = self._require()
        out: dict[str, torch.Tensor] = {}
        for st in self._owner_stages():
            for orig, t, _ in stage_tensors(st, self._keys if self._order else None):
                out[orig] = t.detach().cpu().clone()
                for alias in self._aliases.get(orig, ()):
                    out[alias] = out[orig]
        if self.rank == 0 and eng.dp_index == 0:
            out.update(self._unused)
        return out

    def _owner_stages(self) -> list[Any]:
        """The stages whose state this rank writes: replica 0, dp copy 0, tile 0 of each."""
        eng = self._require()
        if eng.dp_index != 0:
            return []
        return [eng.stages[s] for rep, s in eng.held if rep == 0 and eng.part[(rep, s)] == 0]

    def _require(self) -> PipelineEngine:
        if self.engine is None:
            raise NowdlError("the model has not run a step yet: call train_step or eval_step first "
                             "(the plan and the stages are built on the first step)")
        return self.engine

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state under its original names, on rank 0 ({} on other ranks)."""
        mine = self._owned()
        if self.world == 1:
            return self._in_model_order(mine)
        parts: list[Any] = [None] * self.world if self.rank == 0 else []
        dist.gather_object(mine, parts if self.rank == 0 else None, dst=0)
        if self.rank != 0:
            return {}
        merged: dict[str, torch.Tensor] = {}
        for p in parts:
            merged.update(p)
        return self._in_model_order(merged)

    def _in_model_order(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rank = {k: i for i, k in enumerate(self._order)}
        return dict(sorted(sd.items(), key=lambda kv: rank.get(kv[0], len(rank))))

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load original-name weights (every rank passes the same dict, or rank 0 and others {})."""
        eng = self._require()
        if self.world > 1:
            box: list[Any] = [sd if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            sd = box[0]
        for _, s in eng.held:
            for orig, t, _ in stage_tensors(eng.stages[s], self._keys if self._order else None):
                if orig not in sd:
                    raise NowdlError(f"state dict has no entry {orig!r} (stage {s}); it was saved from another model")
                with torch.no_grad():
                    t.copy_(sd[orig])
        self.weights_version += 1
        for key in self._unused:  # parameters no stage uses: kept for state_dict() only
            if key in sd:
                self._unused[key] = sd[key].detach().cpu().clone()

    # ---- checkpoints -----------------------------------------------------------------------------
    def _named_held(self) -> dict[str, nn.Parameter]:
        eng = self._require()
        named: dict[str, nn.Parameter] = {}
        for _, s in eng.held:
            for orig, t, is_param in stage_tensors(eng.stages[s]):
                if is_param:
                    named[orig] = t  # type: ignore[assignment]
        return named

    def save_checkpoint(self, directory: str | os.PathLike[str], extra: dict[str, Any] | None = None,
                        keep: int = 1) -> None:
        """Every rank writes what it owns (weights, optimizer state, its RNG state) under the model's
        original names with torch.distributed.checkpoint; ``extra`` (JSON) is kept beside it.
        Atomic: the previous checkpoint stays valid until this one is complete."""
        tensors, meta = self.snapshot(extra)
        save_checkpoint(directory, self.steps, tensors, meta, keep=keep)

    def snapshot(self, extra: dict[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What this rank's share of a checkpoint holds (collective): ``model/<name>``,
        ``optim/<name>/<key>`` and ``rng/<rank>`` tensors, and the record's fields (the plan, the
        steps, the optimizer's groups and scalar keys, ``extra``)."""
        eng = self._require()
        tensors: dict[str, torch.Tensor] = {}
        for st in self._owner_stages():
            for orig, t, _ in stage_tensors(st, self._keys if self._order else None):
                tensors[f"model/{orig}"] = t.detach()
        if self.rank == 0 and eng.dp_index == 0:
            tensors.update({f"model/{k}": v for k, v in self._unused.items()})
        opt = self.optimizer
        owned = {orig for st in self._owner_stages() for orig, _, p in stage_tensors(st) if p}
        more, scalars, groups = ({}, [], None) if opt is None else optimizer_snapshot(opt, self.cm.model,
                                                                                       self._named_held(), owned)
        tensors.update(more)
        tensors[f"rng/{self.rank}"] = torch.get_rng_state()
        gathered: list[Any] = [None] * self.world if self.world > 1 else [scalars]
        if self.world > 1:
            dist.all_gather_object(gathered, scalars)
        meta = {"fingerprint": eng.plan.fingerprint, "plan": eng.plan.to_dict(), "steps": self.steps,
                "optimizer": None if opt is None else {"class": type(opt).__name__, "groups": groups,
                                                       "scalars": sorted({k for g in gathered for k in g})},
                **(extra or {})}
        return tensors, meta

    def load_checkpoint(self, directory: str | os.PathLike[str], x: Any = None) -> dict[str, Any]:
        """Resume from the latest checkpoint in ``directory`` (written by any plan of this model:
        weights and optimizer state are resharded by name). ``x`` (a batch) sets the engine up if no
        step ran yet. Returns the checkpoint's record (``nowdl.json``)."""
        if self.engine is None and x is None:
            raise NowdlError(_NEEDS_ENGINE)
        ck = open_checkpoint(directory)
        if ck is None:
            raise CheckpointError(f"no checkpoint in {directory}: save one first (cm.save_checkpoint / nowdl run "
                                  "--checkpoint), or check the folder")
        return self.restore(ck, x)

    def restore(self, ck: StateSource, x: Any = None) -> dict[str, Any]:
        """Load weights, optimizer state (and RNG state, when saved by this plan) from ``ck`` by original
        name (collective; ``x`` sets the engine up if no step ran yet); returns its record."""
        if self.engine is None:
            if x is None:
                raise NowdlError(_NEEDS_ENGINE)
            self._setup(x)
        eng = self._require()
        wanted: dict[str, tuple[int, ...] | None] = {}
        for _, s in eng.held:
            for orig, t, _ in stage_tensors(eng.stages[s], self._keys if self._order else None):
                wanted[f"model/{orig}"] = tuple(t.shape)
        optional = set()
        if self.rank == 0:
            for k, v in self._unused.items():
                wanted[f"model/{k}"] = tuple(v.shape)
                optional.add(f"model/{k}")
        index = ck.index()
        named = self._named_held()
        saved_opt = ck.record.get("optimizer")
        if self.optimizer is not None and saved_opt is not None:
            for name in named:
                wanted.update({k: None for k in index if k.startswith(f"optim/{name}/")})
        same_run = ck.world == self.world and ck.record.get("plan", {}).get("config") == eng.plan.config
        if same_run:
            wanted[f"rng/{self.rank}"] = None
            optional.add(f"rng/{self.rank}")
        got = ck.read(wanted, optional=frozenset(optional))
        for _, s in eng.held:
            for orig, t, _ in stage_tensors(eng.stages[s], self._keys if self._order else None):
                with torch.no_grad():
                    t.copy_(got[f"model/{orig}"])
        for k in self._unused:
            if f"model/{k}" in got:
                self._unused[k] = got[f"model/{k}"].clone()
        if self.optimizer is not None and saved_opt is not None:
            load_optimizer_state(self.optimizer, named, got, saved_opt.get("scalars", []), saved_opt.get("groups"),
                                 str(ck.dir))
        if f"rng/{self.rank}" in got:
            torch.set_rng_state(got[f"rng/{self.rank}"])
        self.steps = int(ck.record.get("steps", ck.step))
        self.weights_version += 1
        return ck.record
