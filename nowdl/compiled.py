"""CompiledModel: a model prepared by nowdl.compile; plans on its first example input, trains on the first step."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch import nn

from nowdl.codegen.chain import StageChain, chain_stages
from nowdl.errors import InfeasibleError, NowdlError, TileHaloError
from nowdl.gcpause import gc_paused
from nowdl.optimizers import OptimizerSlot, optimizer_kind
from nowdl.options import DeviceSpecLike, LossFn, PlannerOptions, RuntimeOptions
from nowdl.partitioner.config.candidate import PlanRequest
from nowdl.partitioner.config.reserve import memory_reserve
from nowdl.partitioner.config.two_samples import plans_two_samples
from nowdl.partitioner.costs.costmodel import Costs
from nowdl.partitioner.costs.inference import inference_profile, inference_request, mark_inference
from nowdl.partitioner.costs.levers import host_share
from nowdl.partitioner.costs.tied import tied_nodes
from nowdl.partitioner.placement.layout import request_topology
from nowdl.partitioner.search.best_plan import build_plan, timed_search
from nowdl.partitioner.search.halo_fusion import fusion as halo_fusion
from nowdl.partitioner.spatial import pooled_groups, spatial_rules
from nowdl.plan.plan import Plan, format_bytes
from nowdl.plan.purpose import is_inference, require_inference, require_training
from nowdl.profiler.alloc.predict import allocator_reserve
from nowdl.profiler.cost import Profile
from nowdl.profiler.devices import DeviceSpec, local_gpu_spec
from nowdl.profiler.loss_cost import loss_cost_for, with_loss
from nowdl.progress import Progress, status
from nowdl.trace.check import stand_in
from nowdl.trace.tracer import Traced, trace

if TYPE_CHECKING:
    from nowdl.runtime.predict.summary import PredictSummary
    from nowdl.runtime.spatial.tiles import TiledInput
    from nowdl.runtime.training.trainer import Trainer

__all__ = ["CompiledModel"]

log = logging.getLogger(__name__)


def _params_per_node(gm: fx.GraphModule) -> dict[str, int]:
    """Parameter count owned by each node (a shared parameter counted once, at first use)."""
    from nowdl.profiler.memory import static_costs
    return {name: sc.params for name, sc in static_costs(gm, "sgd").items()}


class CompiledModel:
    """A model prepared for nowdl: plans lazily on the first example input, like torch.compile.

    Without a process group, calling it runs the plan's stages one after another in this
    process (useful to check a plan); the distributed runtime arrives with ``train_step``.
    """

    optimizer = OptimizerSlot()  # over model.parameters(), built on first use (training)

    def __init__(self, model: nn.Module, *, request: PlanRequest | None, plan_path: str | None,
                 options: RuntimeOptions, planner: PlannerOptions) -> None:
        self.model = model
        self.request = request
        self.plan_path = plan_path
        self.options = options
        self.planner = planner
        self.optimizer_kind = optimizer_kind(options.optimizer)  # the state family the profile counts
        self._traced: dict[tuple[tuple[int, ...], ...], Traced] = {}
        self._plans: dict[tuple[Any, ...], Plan] = {}  # per input shapes, train (and one sample per step)
        self._chains: dict[tuple[tuple[int, ...], ...], StageChain] = {}  # what cm(x) runs, per input shapes
        self._trainer: Trainer | None = None
        #: a step whose loss or a gradient is NaN or infinite: stop (False: NonFiniteError) or skip it
        #: (True; ``skipped_steps`` counts them) ([Note: non-finite steps] in runtime/pipeline/grad_sync.py)
        self.skip_nonfinite = False

    @property
    def skipped_steps(self) -> int:
        """Training steps skipped for a non-finite loss or gradient (``skip_nonfinite``)."""
        eng = self._trainer.engine if self._trainer is not None else None
        return int(eng.runner.skipped) if eng is not None else 0

    # ---- the runtime options the trainer reads; setting one checks it again ------------------
    @property
    def precision(self) -> str:
        """"fp32", "bf16" or "fp16": the autocast the plan is profiled and the model trained under."""
        return self.options.precision

    @precision.setter
    def precision(self, value: str) -> None:
        self.options = dataclasses.replace(self.options, precision=value)

    @property
    def device(self) -> str | torch.device | None:
        """Where this process profiles and trains (None: its CUDA device under a launcher, else cpu)."""
        return self.options.device

    @device.setter
    def device(self, value: str | torch.device | None) -> None:
        self.options = dataclasses.replace(self.options, device=value)

    @property
    def activation_checkpointing(self) -> bool | list[int]:
        """True (every stage) or the stages whose forward is recomputed during their backward."""
        ckpt = self.options.activation_checkpointing
        return ckpt if isinstance(ckpt, bool) else list(ckpt)

    @activation_checkpointing.setter
    def activation_checkpointing(self, value: bool | list[int]) -> None:
        self.options = dataclasses.replace(self.options, activation_checkpointing=value)

    @property
    def loss_fn(self) -> LossFn | None:
        """``loss_fn(output, target)`` of ``train_step``."""
        return self.options.loss_fn

    # ---- steps of the compiler, each usable on its own ----------------------------------------
    def trace(self, *example_inputs: torch.Tensor) -> Traced:
        """The validated fx graph of the model (cached per input shapes)."""
        key = tuple(tuple(x.shape) for x in example_inputs)
        if key not in self._traced:  # torch.export on a large model takes a while: say so on a terminal
            with status(f"tracing {type(self.model).__name__}", enabled=self.options.progress):
                self._traced[key] = trace(self.model, example_inputs, leaf_modules=self.planner.leaf_modules,
                                          tracer=self.planner.tracer)
        return self._traced[key]

    def _resolved_mode(self) -> str:
        if self.options.mode != "auto":
            return self.options.mode
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
                        optimizer=self.optimizer_kind, cache=self.options.cache, progress=self.options.progress,
                        fingerprint=t.fingerprint, precision=self.precision)

    def _spec_arg(self) -> DeviceSpecLike | None:
        if self.options.device_spec is not None:
            return self.options.device_spec
        return "h100" if self._resolved_mode() == "estimate" else None

    def _spec(self) -> DeviceSpec:
        from nowdl.profiler import get_device_spec

        spec = self._spec_arg()
        if spec is None:
            spec = local_gpu_spec()
        return spec if not isinstance(spec, (str, os.PathLike)) else get_device_spec(spec)

    @plans_two_samples  # [Note: one-sample norms]: micro-batches of 2 samples or more
    def plan(self, *example_inputs: torch.Tensor, target: torch.Tensor | None = None, train: bool = True,
             single: bool = False) -> Plan:
        """Plan for one micro-batch shaped like ``example_inputs`` (no process group needed);
        ``target``, one micro-batch's target, lets the plan measure the loss's memory.
        ``train=False`` makes an inference plan: forward only, no gradients, optimizer state or
        saved activations (docs/evaluation.md). ``single``: one sample per step, as ``predict``
        runs its windows: one micro-batch, one replica and no dp copies, whatever ``compile``
        pinned (cached apart from the plan of ``compile``'s pins).

        Raises:
            InfeasibleError: nothing fits the memory cap (says what would).
            PlanError: a given plan file is malformed or for another model.
            TraceError: the model cannot be traced faithfully.
        """
        with gc_paused(self._resolved_mode() == "estimate"):  # [Note: planning without gc]
            return self._plan(example_inputs, target=target, train=train, single=single)

    def _plan(self, example_inputs: tuple[torch.Tensor, ...], *, target: torch.Tensor | None, train: bool,
              single: bool) -> Plan:
        key = tuple(tuple(x.shape) for x in example_inputs)
        req = self.request
        own = single and self.plan_path is None and req is not None and (req.micro_batches, req.replicas, req.dp) != (
            1, 1, 1)
        cached = (key, train, "single") if own else (key, train)
        if cached in self._plans:
            return self._plans[cached]
        t0 = time.perf_counter()
        t = self.trace(*example_inputs)
        t1 = time.perf_counter()
        if self.plan_path is not None:
            plan = Plan.load(self.plan_path)
            plan.check_model(t.fingerprint, [list(s) for s in key])
            (require_training if train else require_inference)(plan, f"plan {self.plan_path}")
            made = plan.config.get("precision", "fp32")
            if made != self.precision:
                log.warning("plan %s was made for %s, training runs in %s: its memory and time predictions "
                            "do not hold; re-plan with precision=%r", self.plan_path, made, self.precision, self.precision)
            self._plans[(key, train)] = plan
            return plan
        assert req is not None  # compile() guarantees a request or a plan path
        if not own:
            return self._search(example_inputs, req, train=train, target=target, t0=t0, t1=t1)
        free = dataclasses.replace(req, global_batch=None, micro_batches=1, replicas=1, dp=1)
        kept = self._plans.get((key, train))
        plan = self._search(example_inputs, free, train=train, target=target, t0=t0, t1=t1)
        self._plans.pop((key, train), None)  # _search cached it there: keep it apart from compile's pins
        if kept is not None:
            self._plans[(key, train)] = kept
        self._plans[cached] = plan
        return plan

    def inference_plan(self, *example_inputs: torch.Tensor) -> Plan:
        """The plan ``eval_step`` runs for one sample shaped like ``example_inputs``: ``plan(x,
        train=False)``; a model compiled from a plan file that is not an inference plan for these
        shapes gets an inference plan made for the file's GPU count and memory cap."""
        if self.plan_path is not None:
            made = Plan.load(self.plan_path)
            if not (is_inference(made) and made.model.get("inputs") == [list(x.shape) for x in example_inputs]):
                key = tuple(tuple(x.shape) for x in example_inputs)
                if (key, False) not in self._plans:
                    req = PlanRequest(gpus=int(made.config["gpus"]), gpu_memory=made.config.get("gpu_memory"),
                                      time_limit=self.planner.budget[0], milp=self.planner.budget[1],
                                      mip_gap=self.planner.mip_gap)
                    t0 = time.perf_counter()
                    self.trace(*example_inputs)
                    self._search(example_inputs, req, train=False, target=None, t0=t0, t1=time.perf_counter())
                return self._plans[(key, False)]
        return self.plan(*example_inputs, train=False)

    def _search(self, example_inputs: tuple[torch.Tensor, ...], request: PlanRequest, *, train: bool,
                target: torch.Tensor | None, t0: float, t1: float) -> Plan:
        """Profile and search a plan for ``request`` (cached under the input shapes and ``train``)."""
        key = tuple(tuple(x.shape) for x in example_inputs)
        t = self.trace(*example_inputs)
        prof = self.profile(*example_inputs)
        loss = loss_cost_for(prof, self.loss_fn if train else None, target if train else None)  # [Note: loss memory]
        prof, t2 = with_loss(prof, loss) if train else inference_profile(prof), time.perf_counter()
        spec = self._spec()
        req = request if train else inference_request(request)
        cap = req.gpu_memory if req.gpu_memory is not None else getattr(spec, "memory_bytes", None)
        reserve = memory_reserve(spec, req.gpus) if cap is not None and isinstance(spec, DeviceSpec) else {}
        budget = None if cap is None else cap - sum(reserve.values())  # [Note: memory reserve]
        costs = Costs(profile=prof, rules=(rules := spatial_rules(t.gm, prof.out_ranks())), link_bw=float(spec.link_bw), mem_cap=budget,
                      tied=tied_nodes(t.gm, pooled_groups(t.gm, rules, prof.out_ranks())), topology=request_topology(req, self._spec_arg(), spec), inference=not train,
                      host_memory=host_share(spec, self._spec_arg()), host_link_bw=getattr(spec, "host_link_bw", None),
                      tile_op_s=getattr(spec, "tile_op_s", None), tile_op_bwd_s=getattr(spec, "tile_op_bwd_s", None),
                      recompute_tensor_s=getattr(spec, "recompute_tensor_s", None) or 0.0, norm_schedule=self.planner.norm_schedule)
        # time_limit bounds the whole plan() call: the search gets what tracing and profiling
        # left of it (less a second for the MILP's read-back and tie-breaks)
        left = max(min(1.0, req.time_limit), req.time_limit - (time.perf_counter() - t0) - 1.0)
        bar = Progress("planning", enabled=self.options.progress)
        try:
            result, secs = timed_search(costs, dataclasses.replace(req, time_limit=left), progress=bar.update)
        except InfeasibleError as e:
            if not reserve or isinstance(e, TileHaloError):  # no cap would do: [Note: halo wider than a tile]
                raise
            raise InfeasibleError(f"{e} (each GPU's {format_bytes(cap or 0)} less {format_bytes(sum(reserve.values()))} "
                                  "kept for the CUDA context, NCCL and the allocator's slack: docs/memory.md, "
                                  "[Note: memory reserve])") from None
        finally:
            bar.close()
        from nowdl import __version__

        fusion = self.options.halo_fusion

        def assemble(policy: str | int) -> Plan:
            return build_plan(
                costs, req, result,
                model_info={"fingerprint": t.fingerprint, "name": type(self.model).__name__,
                            "inputs": [list(s) for s in key], "tracer": t.tracer,
                            "nodes": len(prof.nodes)},
                profile_info={"source": prof.source, "device": prof.device, "dtype": prof.dtype,
                              "precision": prof.precision, "optimizer": prof.optimizer,
                              "device_spec": getattr(spec, "name", str(spec)), "link_bw": float(spec.link_bw),
                              "wall_s": round(prof.wall_s, 3), "loss": loss.to_json()},
                solver_seconds=secs, created_by=f"nowdl {__version__}",
                params_per_node=_params_per_node(t.gm),
                fusion=halo_fusion(t.gm, policy, float(spec.link_bw), costs.topo(req.gpus).intra.latency_s),
            )

        plan = assemble(fusion)
        if not train and fusion == "auto" and cap is not None and max(r.predicted_peak_bytes for r in plan.ranks) > cap:
            plan, fusion = assemble("off"), "off"  # inference: a fused window's copy would pass the cap
        if result.costs is not None:  # planned at another micro-batch size than the example's
            costs, prof = result.costs, result.costs.profile
        plan.config["halo_fusion"] = fusion
        if cap is not None:
            plan.config["gpu_memory"] = cap
        plan.config["precision"] = self.precision
        if not train:
            mark_inference(plan, t.gm, prof, costs.tile_op_s)  # and its whole-image ops: [Note: whole-image ops]
        allocator_reserve(plan, prof, reserve, cap)  # [Note: allocator reserve]: the slack becomes the simulated share
        if reserve:
            plan.config["reserve"] = reserve
        # where plan() spent its time (trace includes the eager check; 0 when cached)
        plan.solver["timing"] = {"trace_s": round(t1 - t0, 3), "profile_s": round(t2 - t1, 3),
                                 "search_s": round(secs, 3), "total_s": round(time.perf_counter() - t0, 3)}
        self._plans[(key, train)] = plan
        return plan

    # ---- training (the distributed runtime) -------------------------------------------------------
    def _train(self) -> Trainer:
        if self._trainer is None:  # the runtime loads here, on the first train, eval or checkpoint call
            from nowdl.runtime.training.trainer import Trainer

            self._trainer = Trainer(self, loss_fn=self.loss_fn, timeout_s=self.options.timeout_s, backend=self.options.backend)
        return self._trainer

    @property
    def _ready(self) -> bool:
        return self._trainer is not None and self._trainer.engine is not None

    def train_step(self, x: torch.Tensor | TiledInput | None, y: torch.Tensor | TiledInput | None) -> float:
        """One optimizer step on the global batch ``x``, ``y`` (every rank passes the same batch;
        ranks that need no data may pass None once set up). Returns the mean loss on every rank."""
        if self.loss_fn is None:
            raise NowdlError("train_step needs a loss: nowdl.compile(model, ..., loss_fn=torch.nn.CrossEntropyLoss())")
        return float(self._train().train_step(x, y))

    def eval_step(self, x: Any, *, gather: str = "rank0") -> Any:
        """Inference on a batch of any size and any image size the model accepts (every rank passes
        the same batch): the model's outputs, whole images in batch order, on rank 0 (None on the
        others) or, with ``gather="all"``, on every rank. Runs on an inference plan made for
        ``x``'s sample shape on first use and cached ([Note: eval plans] in
        runtime/training/evaluate.py), with the current (trained) weights."""
        return self._train().evaluate(x, None, gather=gather)[0]

    def evaluate(self, x: Any, y: Any, *, gather: str = "rank0") -> tuple[Any, float]:
        """:meth:`eval_step` with targets ``y``: ``(outputs, mean loss_fn(output, y) over the batch)``,
        the loss on every rank (NaN without a ``loss_fn``)."""
        return self._train().evaluate(x, y, gather=gather)

    def eval_plan(self, x: Any) -> Plan:
        """The inference plan ``eval_step(x)`` runs on (planned on first use: then collective)."""
        return self._train().evaluator().plan_for(x)

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
            return self._train().load_state_dict(sd)
        self.model.load_state_dict(sd)
        self._train().pending_state = dict(sd)

    def save_checkpoint(self, directory: str | os.PathLike[str], *, meta: dict[str, Any] | None = None,
                        keep: int = 1) -> None:
        """Save weights, optimizer state and RNG state with torch.distributed.checkpoint (collective,
        atomic; ``meta``: JSON kept beside it; ``keep``: how many steps to keep). Needs a step first."""
        self._train().save_checkpoint(directory, extra=meta, keep=keep)

    def load_checkpoint(self, directory: str | os.PathLike[str], x: torch.Tensor | TiledInput | None = None) -> None:
        """Resume from ``directory``, saved by any plan of this model (resharded by name); ``x`` (a
        batch) sets the runtime up when no step ran yet."""
        self._train().load_checkpoint(directory, x)

    def predict(self, source: Any, out: str | os.PathLike[str], *, output: str = "logits",
                window: Any = None, overwrite: bool = False, format: str | None = None,
                on_window: Any = None, measure_memory: bool = True, normalize: Any = None) -> PredictSummary:
        """Predict ``source`` (a ``--data`` spec such as ``"openslide:slide.svs"``, or opened images)
        into ``out`` (``.zarr``, ``.tif``, ``.nii.gz`` or a folder) on this plan's ranks, in windows
        whose centres are exact; every rank calls it. ``output``: logits, probabilities or argmax;
        ``measure_memory=False`` skips the peak-memory meter (slow on CPU); ``normalize``: the training
        data's ``nowdl.data.Normalize`` (or its text). See docs/predict.md."""
        from nowdl.runtime.predict.job import predict

        weights = self._train().full_state() if self._ready else None  # trained here: the stages hold them
        return predict(self, source, out, output=output, window=window, overwrite=overwrite, fmt=format,
                       on_window=on_window, timeout_s=self.options.timeout_s, backend=self.options.backend,
                       measure_memory=measure_memory, weights=weights, normalize=normalize)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """Run the plan's stages, the modules training runs (``build_stages``), one after another
        in this process (a spatial stage untiled): the model's output, in its structure."""
        key = tuple(tuple(x.shape) for x in inputs)
        if key not in self._chains:
            self._chains[key] = chain_stages(self.trace(*inputs).gm, self.plan(*inputs))
        return self._chains[key](*inputs)

