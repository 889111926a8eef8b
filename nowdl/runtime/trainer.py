"""The training API behind CompiledModel.train_step / eval_step / state_dict / checkpoints."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from nowdl.codegen.stage import StageModule
from nowdl.errors import NowdlError, PlanError
from nowdl.partitioner.plan import Plan
from nowdl.runtime.engine import PipelineEngine
from nowdl.runtime.nodes import check_node_map
from nowdl.runtime.tiles import TiledInput

if TYPE_CHECKING:
    from nowdl.api import CompiledModel

__all__ = ["Trainer", "plan_on_rank0"]

log = logging.getLogger(__name__)

_CKPT_FORMAT = "nowdl.checkpoint"


def _example(t: Any) -> Any:
    return t.meta() if isinstance(t, TiledInput) else t


def _first_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, (torch.Tensor, TiledInput)):
        return _example(x)
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], (torch.Tensor, TiledInput)):
        return _example(x[0])
    raise NowdlError(f"train_step/eval_step take a tensor (or a tuple of tensors) as x, got {type(x).__name__}")


def plan_on_rank0(make: Callable[[], Plan], *, rank: int, world: int) -> Plan:
    """Rank 0 runs ``make()`` and broadcasts the plan; every rank returns the same Plan.

    If rank 0 fails, the other ranks (which would otherwise wait for the plan) raise a NowdlError
    carrying rank 0's message, and rank 0 re-raises its own error.
    """
    box: list[Any] = [None]
    failure: Exception | None = None
    if rank == 0:
        try:
            box[0] = make().to_json()
        except Exception as e:
            failure = e
            box[0] = {"error": str(e) if isinstance(e, NowdlError) else f"{type(e).__name__}: {e}"}
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if isinstance(box[0], dict):
        raise NowdlError(f"rank 0 could not plan: {box[0]['error']}")
    return Plan.from_json(str(box[0]), source="plan from rank 0")


def state_names(model: nn.Module, stages: Sequence[StageModule]
                ) -> tuple[dict[str, list[str]], dict[str, torch.Tensor], list[str]]:
    """What ``model.state_dict()`` holds beyond the stages' own names, so that ``state_dict()``
    returns the same keys as the model's (and no tensor a graph holds that is not model state,
    such as the constants torch.export lifts out of ``forward``).

    Returns ``(aliases, unused, order)``: for a stage tensor's original name, the other keys under
    which the model's state dict holds the same tensor (a module registered twice, as DynUNet's
    ``skip_layers``); copies of the entries no stage uses (parameters the forward never touches);
    and the model's key order. Call before the stages move to their device (tensor identity).
    """
    names: dict[int, list[str]] = {}
    full = model.state_dict(keep_vars=True)
    for key, t in full.items():
        names.setdefault(id(t), []).append(key)
    aliases: dict[str, list[str]] = {}
    owned: set[str] = set()
    for st in stages:
        local: dict[str, torch.Tensor] = dict(st.module.named_parameters())
        local.update(dict(st.module.named_buffers()))
        for name, orig in st.param_names.items():
            same = names.get(id(local[name]), [])
            owned.add(orig)
            owned.update(same)
            others = [k for k in same if k != orig]
            if others:
                aliases[orig] = others
    unused = {k: t.detach().cpu().clone() for k, t in full.items() if k not in owned}
    return aliases, unused, list(full)


class Trainer:
    """Owns this rank's engine; set up lazily on the first step (plans if needed)."""

    def __init__(self, cm: CompiledModel, *, optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None, timeout_s: float = 300.0,
                 backend: str | None = None) -> None:
        self.cm = cm
        self.optimizer_factory = optimizer
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

    # ---- set-up ----------------------------------------------------------------------------------
    def _setup(self, x: Any) -> PipelineEngine:
        if self.engine is not None:
            return self.engine
        from nowdl.codegen import build_stages
        from nowdl.runtime.launch import init_distributed, launch_env

        env = launch_env()
        if env.world_size > 1 or dist.is_initialized():
            init_distributed(backend=self.backend, timeout_s=self.timeout_s)
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        first = _first_tensor(x)
        plan = self._plan_everywhere(first)
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
        example = tuple(_example(t)[:mb] for t in (x if isinstance(x, (list, tuple)) else (x,)))
        traced = self.cm.trace(*example)
        plan.check_model(traced.fingerprint, [list(t.shape) for t in example])
        stages = build_stages(traced.gm, plan)
        self._aliases, self._unused, self._order = state_names(self.cm.model, stages)
        self._keys = set(self._order)
        device = self._device()
        self.plan = plan
        self.engine = PipelineEngine(plan, stages, self.rank, optimizer=self.optimizer_factory, loss_fn=self.loss_fn,
                                     device=device, timeout_s=self.timeout_s, precision=self.cm.precision,
                                     checkpointing=self.cm.activation_checkpointing)
        return self.engine

    def _device(self) -> torch.device:
        if self.cm.device is not None:
            return torch.device(self.cm.device)
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _plan_everywhere(self, first: torch.Tensor) -> Plan:
        """Rank 0 plans (or loads) and broadcasts the plan, so every rank runs the same one."""
        if self.cm.plan_path is not None:
            return Plan.load(self.cm.plan_path)
        return plan_on_rank0(lambda: self._plan_here(first), rank=self.rank, world=self.world)

    def _plan_here(self, first: torch.Tensor) -> Plan:
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
        example = torch.empty((b,) + tuple(first.shape[1:]), dtype=first.dtype, device="meta")
        return self.cm.plan(example)

    # ---- steps -----------------------------------------------------------------------------------
    def train_step(self, x: Any, y: Any) -> float:
        eng = self._setup(x)
        loss, _ = eng.run(x, y, train=True)
        return loss

    def eval_step(self, x: Any) -> Any:
        """Outputs on the ranks that run the last stage (part 0 of a spatial one, tiles gathered); None elsewhere.

        The micro-batches' outputs are concatenated along the batch, in the structure the model
        returns (a tensor, or a tuple/list/dict of tensors)."""
        eng = self._setup(x)
        _, outs = eng.run(x, None, train=False)
        if not outs:
            return None
        from torch.utils._pytree import tree_flatten, tree_unflatten

        flat = [tree_flatten(o) for o in outs]
        leaves = [torch.cat([f[0][i] for f in flat]) if isinstance(flat[0][0][i], torch.Tensor) else flat[0][0][i]
                  for i in range(len(flat[0][0]))]
        return tree_unflatten(leaves, flat[0][1])

    # ---- state -----------------------------------------------------------------------------------
    def _owned(self) -> dict[str, torch.Tensor]:
        """This rank's share of the model under original names (replica 0, dp copy 0 owners)."""
        eng = self._require()
        out: dict[str, torch.Tensor] = {}
        if eng.dp_index != 0:
            return out
        for rep, s in eng.held:
            if rep != 0 or eng.part[(rep, s)] != 0:  # tiles of a spatial stage hold equal copies
                continue
            st = eng.stages[s]
            local: dict[str, torch.Tensor] = dict(st.module.named_parameters())
            local.update(dict(st.module.named_buffers()))
            for name, orig in st.param_names.items():
                if self._order and orig not in self._keys:  # a graph constant (export's lifted tensors)
                    continue
                out[orig] = local[name].detach().cpu().clone()
                for alias in self._aliases.get(orig, ()):
                    out[alias] = out[orig]
        if self.rank == 0:
            out.update(self._unused)
        return out

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
            st = eng.stages[s]
            local: dict[str, torch.Tensor] = dict(st.module.named_parameters())
            local.update(dict(st.module.named_buffers()))
            for name, orig in st.param_names.items():
                if self._order and orig not in self._keys:  # not state: a constant of the graph
                    continue
                if orig not in sd:
                    raise NowdlError(f"state dict has no entry {orig!r} (stage {s}); it was saved from another model")
                with torch.no_grad():
                    local[name].copy_(sd[orig])
        for key in self._unused:  # parameters no stage uses: kept for state_dict() only
            if key in sd:
                self._unused[key] = sd[key].detach().cpu().clone()

    def save_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """Every rank writes its stages' weights, optimizer state and RNG state (atomically)."""
        eng = self._require()
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        state = {
            "format": _CKPT_FORMAT, "version": 1, "rank": self.rank, "world": self.world,
            "fingerprint": eng.plan.fingerprint, "plan": eng.plan.to_dict(),
            "modules": {s: eng.stages[s].module.state_dict() for _, s in eng.held},
            "optimizer": eng.optimizer.state_dict() if eng.optimizer is not None else None,
            "rng": torch.get_rng_state(),
        }
        tmp = d / f".rank{self.rank}.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, d / f"rank{self.rank}.pt")
        if self.rank == 0:
            (d / "nowdl-checkpoint.json").write_text(json.dumps({"format": _CKPT_FORMAT, "world": self.world,
                                                                 "fingerprint": eng.plan.fingerprint}))
        if self.world > 1:
            dist.barrier()

    def load_checkpoint(self, directory: str | os.PathLike[str], x: Any = None) -> None:
        """Resume from ``save_checkpoint``; ``x`` (a batch) sets the engine up if no step ran yet."""
        if self.engine is None:
            if x is None:
                raise NowdlError("load_checkpoint needs the engine: run a step first or pass a batch as x")
            self._setup(x)
        eng = self._require()
        f = Path(directory) / f"rank{self.rank}.pt"
        if not f.exists():
            raise PlanError(f"checkpoint {str(f)!r} does not exist (saved with another world size?)")
        state = torch.load(f, weights_only=False)
        if state.get("format") != _CKPT_FORMAT or state.get("fingerprint") != eng.plan.fingerprint:
            raise PlanError(f"{str(f)!r} is not a checkpoint of this model and plan")
        for s, sd in state["modules"].items():
            eng.stages[int(s)].module.load_state_dict(sd)
        if eng.optimizer is not None and state["optimizer"] is not None:
            eng.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
