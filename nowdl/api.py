"""The user API: nowdl.compile(model, gpus=..., ...) -> CompiledModel, and nowdl.profile."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from nowdl.codegen.chain import StageChain, chain_stages
from nowdl.errors import NowdlError, PlanError
from nowdl.optimizers import build_optimizer, optimizer_kind
from nowdl.partitioner.costs.costmodel import Costs, tied_nodes
from nowdl.partitioner.placement.layout import request_topology
from nowdl.partitioner.search.best_plan import build_plan, timed_search
from nowdl.partitioner.search.config import PlanRequest
from nowdl.partitioner.spatial.halo_fusion import check_policy, plan_fusion
from nowdl.partitioner.spatial.tileable import spatial_rules
from nowdl.plan.plan import Plan
from nowdl.profiler import check_precision
from nowdl.profiler.cost import Profile
from nowdl.profiler.loss_cost import loss_cost_for, with_loss
from nowdl.progress import Progress, status
from nowdl.trace.check import stand_in
from nowdl.trace.tracer import Traced, trace
from nowdl.units import parse_bytes

__all__ = ["compile", "CompiledModel", "profile_model", "MODES"]

log = logging.getLogger(__name__)

MODES = ("auto", "estimate", "measure")


def _params_per_node(gm: fx.GraphModule) -> dict[str, int]:
    """Parameter count owned by each node (a shared parameter counted once, at first use)."""
    from nowdl.profiler.memory import static_costs
    return {name: sc.params for name, sc in static_costs(gm, "sgd").items()}


class CompiledModel:
    """A model prepared for nowdl: plans lazily on the first example input, like torch.compile.

    Without a process group, calling it runs the plan's stages one after another in this
    process (useful to check a plan); the distributed runtime arrives with ``train_step``.
    """

    def __init__(self, model: nn.Module, *, request: PlanRequest | None, plan_path: str | None,
                 mode: str, device: str | torch.device | None, device_spec: Any, optimizer: str,
                 leaf_modules: Sequence[type | str], tracer: str, cache: bool | str | os.PathLike[str],
                 progress: bool) -> None:
        self.model = model
        self.request = request
        self.plan_path = plan_path
        self.mode = mode
        self.device = device
        self.device_spec = device_spec
        self.optimizer_kind = optimizer
        self.leaf_modules = tuple(leaf_modules)
        self.tracer = tracer
        self.cache = cache
        self.progress = progress
        self._traced: dict[tuple[tuple[int, ...], ...], Traced] = {}
        self._plans: dict[tuple[tuple[int, ...], ...], Plan] = {}
        self._chains: dict[tuple[tuple[int, ...], ...], StageChain] = {}  # what cm(x) runs, per input shapes
        self._trainer: Any = None
        self.optimizer: torch.optim.Optimizer | None = None  # built by compile() over model.parameters()
        self.loss_fn: Any = None
        self.timeout_s = 300.0
        self.backend: str | None = None
        self.precision = "fp32"
        self.halo_fusion: str | int = "auto"
        self.activation_checkpointing: bool | list[int] = False

    # ---- steps of the compiler, each usable on its own ----------------------------------------
    def trace(self, *example_inputs: torch.Tensor) -> Traced:
        """The validated fx graph of the model (cached per input shapes)."""
        key = tuple(tuple(x.shape) for x in example_inputs)
        if key not in self._traced:  # torch.export on a large model takes a while: say so on a terminal
            with status(f"tracing {type(self.model).__name__}", enabled=self.progress):
                self._traced[key] = trace(self.model, example_inputs, leaf_modules=self.leaf_modules, tracer=self.tracer)
        return self._traced[key]

    def _resolved_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        return "measure" if torch.cuda.is_available() else "estimate"

    def profile(self, *example_inputs: torch.Tensor) -> Profile:
        """Per-node costs of one micro-batch (see nowdl.profiler.profile)."""
        from nowdl.profiler import profile as _profile

        t = self.trace(*example_inputs)
        mode = self._resolved_mode()
        inputs = example_inputs
        if mode == "measure" and any(x.device.type == "meta" for x in example_inputs):
            inputs = tuple(stand_in(x.shape, x.dtype) for x in example_inputs)
        return _profile(t.gm, tuple(inputs), mode=mode, device=self.device, device_spec=self._spec_arg(),
                        optimizer=self.optimizer_kind, cache=self.cache, progress=self.progress,
                        fingerprint=t.fingerprint, precision=self.precision)

    def _spec_arg(self) -> Any:
        if self.device_spec is not None:
            return self.device_spec
        return "h100" if self._resolved_mode() == "estimate" else None

    def _spec(self) -> Any:
        from nowdl.profiler import get_device_spec

        spec = self._spec_arg()
        if spec is None:
            spec = _spec_for_local_gpu()
        return spec if not isinstance(spec, (str, os.PathLike)) else get_device_spec(spec)

    def plan(self, *example_inputs: torch.Tensor, target: Any = None) -> Plan:
        """Plan for one micro-batch shaped like ``example_inputs`` (no process group needed);
        ``target``, one micro-batch's target, lets the plan measure the loss's memory.

        Raises:
            InfeasibleError: nothing fits the memory cap (says what would).
            PlanError: a given plan file is malformed or for another model.
            TraceError: the model cannot be traced faithfully.
        """
        key = tuple(tuple(x.shape) for x in example_inputs)
        if key in self._plans:
            return self._plans[key]
        t0 = time.perf_counter()
        t = self.trace(*example_inputs)
        t1 = time.perf_counter()
        if self.plan_path is not None:
            plan = Plan.load(self.plan_path)
            plan.check_model(t.fingerprint, [list(s) for s in key])
            made = plan.config.get("precision", "fp32")
            if made != self.precision:
                log.warning("plan %s was made for %s, training runs in %s: its memory and time predictions "
                            "do not hold; re-plan with precision=%r", self.plan_path, made, self.precision, self.precision)
            self._plans[key] = plan
            return plan
        assert self.request is not None  # compile() guarantees a request or a plan path
        prof = self.profile(*example_inputs)
        loss = loss_cost_for(prof, self.loss_fn, target)  # [Note: loss memory] in profiler/loss_cost.py
        prof, t2 = with_loss(prof, loss), time.perf_counter()
        spec = self._spec()
        req = self.request
        cap = req.gpu_memory if req.gpu_memory is not None else getattr(spec, "memory_bytes", None)
        costs = Costs(profile=prof, rules=spatial_rules(t.gm, prof.out_ranks()), link_bw=float(spec.link_bw), mem_cap=cap,
                      tied=tied_nodes(t.gm), topology=request_topology(req, self._spec_arg(), spec))
        # time_limit bounds the whole plan() call: the search gets what tracing and profiling
        # left of it (less a second for the MILP's read-back and tie-breaks)
        left = max(min(1.0, req.time_limit), req.time_limit - (time.perf_counter() - t0) - 1.0)
        bar = Progress("planning", enabled=self.progress)
        try:
            result, secs = timed_search(costs, dataclasses.replace(req, time_limit=left), progress=bar.update)
        finally:
            bar.close()
        from nowdl import __version__

        plan = build_plan(
            costs, req, result,
            model_info={"fingerprint": t.fingerprint, "name": type(self.model).__name__,
                        "inputs": [list(s) for s in key], "tracer": t.tracer,
                        "nodes": len(prof.nodes)},
            profile_info={"source": prof.source, "device": prof.device, "dtype": prof.dtype,
                          "precision": prof.precision, "optimizer": prof.optimizer, "device_spec": getattr(spec, "name", str(spec)),
                          "link_bw": float(spec.link_bw), "wall_s": round(prof.wall_s, 3), "loss": loss.to_json()},
            solver_seconds=secs, created_by=f"nowdl {__version__}",
            params_per_node=_params_per_node(t.gm),
        )
        plan_fusion(t.gm, plan, prof, costs, result, self.halo_fusion, float(spec.link_bw), costs.topo(req.gpus).intra.latency_s)
        plan.config["halo_fusion"] = self.halo_fusion
        plan.config["precision"] = self.precision
        # where plan() spent its time (trace includes the eager check; 0 when cached)
        plan.solver["timing"] = {"trace_s": round(t1 - t0, 3), "profile_s": round(t2 - t1, 3),
                                 "search_s": round(secs, 3), "total_s": round(time.perf_counter() - t0, 3)}
        self._plans[key] = plan
        return plan

    # ---- training (the distributed runtime) -------------------------------------------------------
    def _train(self) -> Any:
        if self._trainer is None:
            from nowdl.runtime.training.trainer import Trainer

            self._trainer = Trainer(self, optimizer=self.optimizer, loss_fn=self.loss_fn,
                                    timeout_s=self.timeout_s, backend=self.backend)
        return self._trainer

    @property
    def _ready(self) -> bool:
        return self._trainer is not None and self._trainer.engine is not None

    def train_step(self, x: Any, y: Any) -> float:
        """One optimizer step on the global batch ``x``, ``y`` (every rank passes the same batch;
        ranks that need no data may pass None once set up). Returns the mean loss on every rank."""
        if self.loss_fn is None:
            raise NowdlError("train_step needs a loss: nowdl.compile(model, ..., loss_fn=torch.nn.CrossEntropyLoss())")
        return float(self._train().train_step(x, y))

    def eval_step(self, x: Any) -> Any:
        """Inference on the global batch: outputs on the ranks of the last stage (its part 0, whole
        images, when that stage is spatial), None elsewhere."""
        return self._train().eval_step(x)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's parameters under their original names; after the first step, the ones this
        rank trains are the live stage parameters (the others are not updated on this rank)."""
        live = self._train()._named_held() if self._ready else {}
        for name, p in self.model.named_parameters():
            yield name, live.get(name, p)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of :meth:`named_parameters` (what ``cm.optimizer`` steps)."""
        yield from (p for _, p in self.named_parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights under the original names: on rank 0 once training started
        (``{}`` on the other ranks), on every rank before the first step."""
        if not self._ready:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return dict(self._train().state_dict())

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load original-name weights; before the first step every rank loads them into the model
        (and into the stages when they are built)."""
        if self._ready:
            return self._train().load_state_dict(sd)  # type: ignore[no-any-return]
        self.model.load_state_dict(sd)
        self._train().pending_state = dict(sd)

    def save_checkpoint(self, directory: str | os.PathLike[str], *, meta: dict[str, Any] | None = None,
                        keep: int = 1) -> None:
        """Save weights, optimizer state and RNG state with torch.distributed.checkpoint (collective,
        atomic; ``meta``: JSON kept beside it; ``keep``: how many steps to keep). Needs a step first."""
        self._train().save_checkpoint(directory, extra=meta, keep=keep)

    def load_checkpoint(self, directory: str | os.PathLike[str], x: Any = None) -> None:
        """Resume from ``directory``, saved by any plan of this model (resharded by name); ``x`` (a
        batch) sets the runtime up when no step ran yet."""
        self._train().load_checkpoint(directory, x)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """Run the plan's stages, the modules training runs (``build_stages``), one after another
        in this process (a spatial stage untiled): the model's output, in its structure."""
        key = tuple(tuple(x.shape) for x in inputs)
        if key not in self._chains:
            self._chains[key] = chain_stages(self.trace(*inputs).gm, self.plan(*inputs))
        return self._chains[key](*inputs)


def _spec_for_local_gpu() -> Any:
    from nowdl.profiler import get_device_spec

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        for key in ("h200", "h100", "a100", "v100"):
            if key in name:
                return get_device_spec(key)
    return get_device_spec("h100")


def compile(  # noqa: A001 - the name mirrors torch.compile on purpose
    model: nn.Module,
    *,
    gpus: int | None = None,
    plan: str | os.PathLike[str] | None = None,
    balance: str = "memory",
    stages: int | None = None,
    micro_batches: int | None = None,
    schedule: str | None = None,
    replicas: int | None = None,
    dp: int | None = None,
    spatial_parts: int | Sequence[int] | None = None,
    spatial_stages: int | None = None,
    slice: str | None = None,  # noqa: A002 - the seeds' option name
    halo_fusion: str | int = "auto",
    gpu_memory: int | float | str | None = None,
    mode: str = "auto",
    device: str | torch.device | None = None,
    device_spec: Any = None,
    optimizer: Any = "adam",
    loss_fn: Any = None,
    time_limit: float = 30.0, mip_gap: float = 0.01,
    leaf_modules: Sequence[type | str] = (),
    tracer: str = "auto",
    cache: bool | str | os.PathLike[str] = True,
    progress: bool = True,
    timeout_s: float = 300.0,
    backend: str | None = None,
    precision: str = "fp32",
    activation_checkpointing: bool | Sequence[int] = False,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
) -> CompiledModel:
    """Prepare ``model`` for ``gpus`` GPUs; plans lazily on the first example input.

    Args:
        model: an ordinary nn.Module (no rewriting, no nn.Sequential needed).
        gpus: total GPUs (ranks). Settings left as None are searched.
        plan: a saved plan JSON to reuse instead of planning (checked against the model).
        balance: "memory" (smallest peak per GPU) or "compute" (fastest slowest stage).
        stages, micro_batches, schedule, replicas, dp, spatial_parts, spatial_stages, slice:
            pin any part of the parallel configuration. ``spatial_parts`` may be a list: the
            parts of each spatial stage in order (e.g. ``[4, 2]``).
        halo_fusion: "auto" (fuse runs of convs/pools into one deeper halo exchange where the
            cost model says it is faster), "off", or N (fuse up to N convs/pools per exchange).
        gpu_memory: per-GPU cap, bytes or a string like "80GiB" (default: the device's memory).
        mode: "estimate" (no allocation, device_spec roofline), "measure" (real tensors), or
            "auto" (measure on CUDA, else estimate).
        device_spec: "v100", "a100", "h100", "h200", "cpu" or a JSON path.
        optimizer: "sgd", "momentum", "adam" or "adamw" (optimizer state memory), or a factory
            ``params -> torch.optim.Optimizer`` used by ``train_step`` on each rank's parameters.
        loss_fn: ``loss_fn(output, target)``, a mean over the micro-batch (for train_step).
        timeout_s: how long any rank waits for a peer before failing (the peer is named).
        backend: torch.distributed backend (default: nccl with CUDA, gloo on CPU).
        precision: "fp32", "bf16" or "fp16" (autocast; fp16 with a loss scaler agreed by all ranks).
            The planner profiles under the same autocast: activations and the tensors sent
            between stages at that width, parameters, gradients and Adam state in float32.
        activation_checkpointing: True (every stage) or a list of stage indices whose forward is
            recomputed during their backward.
        time_limit: seconds ``plan()`` may take: what tracing and profiling leave of it goes
            to the configuration search, whose MILP (graphs with too many ideals for the exact
            DP) shares it among the best few configurations; a solve stopped by it reports
            status "feasible" and its gap. ``mip_gap``: the MILP stops once proven within it.
        nodes, gpus_per_node: the cluster (nodes x gpus_per_node must equal gpus); default:
            the device spec's node (h100/h200: 8-GPU DGX H100, a100: DGX A100) when it divides
            gpus, else one node. Placement and link costs follow it (docs/multinode.md).

    Returns:
        A CompiledModel; ``cm.plan(x)`` gives the Plan.

    Raises:
        NowdlError: a bad argument (the message says which and what to use).

    Example:
        >>> cm = nowdl.compile(UNet(), gpus=8, balance="memory")
        >>> print(cm.plan(torch.empty(1, 3, 2048, 2048, device="meta")))
    """
    if not isinstance(model, nn.Module):
        raise NowdlError(f"nowdl.compile expects an nn.Module, got {type(model).__name__}")
    if mode not in MODES:
        raise NowdlError(f"unknown mode {mode!r}: use 'estimate', 'measure' or 'auto'")
    request: PlanRequest | None = None
    plan_path: str | None = None
    if plan is not None:
        plan_path = os.fspath(plan)
        if not os.path.exists(plan_path):
            raise PlanError(f"plan file {plan_path!r} does not exist: plan first with `nowdl plan ... --out {plan_path}`")
    else:
        if gpus is None:
            raise NowdlError("give gpus=N (how many GPUs to plan for) or plan='file.json'")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise NowdlError(f"gpus must be a positive integer, got {gpus!r}")
        cap = parse_bytes(gpu_memory) if gpu_memory is not None else None
        request = PlanRequest(gpus=gpus, balance=balance, stages=stages, micro_batches=micro_batches,
                              schedule=schedule, replicas=replicas, dp=dp,
                              spatial_parts=_parts_arg(spatial_parts),
                              spatial_stages=spatial_stages, slice=slice, gpu_memory=cap, time_limit=time_limit,
                              mip_gap=mip_gap, nodes=nodes, gpus_per_node=gpus_per_node)
    cm = CompiledModel(model, request=request, plan_path=plan_path, mode=mode, device=device,
                       device_spec=device_spec, optimizer=optimizer_kind(optimizer), leaf_modules=leaf_modules,
                       tracer=tracer, cache=cache, progress=progress)
    cm.optimizer = build_optimizer(optimizer, model)
    cm.halo_fusion = check_policy(halo_fusion)
    cm.loss_fn = loss_fn
    cm.timeout_s = timeout_s
    cm.backend = backend
    cm.precision = check_precision(precision)
    cm.activation_checkpointing = (activation_checkpointing if isinstance(activation_checkpointing, bool)
                                   else [int(i) for i in activation_checkpointing])
    return cm


def _parts_arg(v: int | Sequence[int] | None) -> int | tuple[int, ...] | None:
    if v is None or isinstance(v, int):
        return v
    if isinstance(v, (list, tuple)):
        return tuple(v)
    raise NowdlError(f"spatial_parts must be an int or a list of ints (one per spatial stage), got {v!r}")


def profile_model(model: nn.Module, *example_inputs: torch.Tensor, mode: str = "auto",
                  device: str | torch.device | None = None, device_spec: Any = None,
                  optimizer: str = "adam", cache: bool | str | os.PathLike[str] = True,
                  progress: bool = True, precision: str = "fp32") -> Profile:
    """Trace and profile ``model`` on one micro-batch: per-node costs.

    Example:
        >>> prof = nowdl.profile(model, torch.randn(1, 3, 256, 256), mode="measure")
    """
    if mode not in MODES:
        raise NowdlError(f"unknown mode {mode!r}: use 'estimate', 'measure' or 'auto'")
    cm = CompiledModel(model, request=None, plan_path=None, mode=mode, device=device, device_spec=device_spec,
                       optimizer=optimizer, leaf_modules=(), tracer="auto", cache=cache, progress=progress)
    cm.precision = check_precision(precision)
    return cm.profile(*example_inputs)
