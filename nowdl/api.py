"""The user API: nowdl.compile(model, gpus=..., ...) -> CompiledModel, and nowdl.profile."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import TracebackType

import torch
from torch import nn

from nowdl.compiled import CompiledModel
from nowdl.errors import NowdlError, PlanError
from nowdl.optimizers import OptimizerSpec
from nowdl.options import CacheSetting, DeviceSpecLike, LossFn, PlannerOptions, RuntimeOptions
from nowdl.partitioner.config.candidate import PlanRequest
from nowdl.partitioner.config.lever_options import check_lever, recompute_setting
from nowdl.profiler.cost import Profile
from nowdl.units import parse_bytes

__all__ = ["compile", "CompiledModel", "PlannerOptions", "profile_model", "tiles_arg"]


def compile(  # noqa: A001 - the name mirrors torch.compile on purpose
    model: nn.Module,
    *,
    gpus: int | None = None,
    plan: str | os.PathLike[str] | None = None,
    # the parallel configuration: None lets the search choose
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
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    recompute: str | Sequence[int] = "auto",
    offload: str | Sequence[int] = "auto",
    global_batch: int | None = None,
    tiles_per_gpu: str | int = "auto",
    # profiling
    mode: str = "auto",
    device: str | torch.device | None = None,
    device_spec: DeviceSpecLike | None = None,
    cache: CacheSetting = True,
    # training
    optimizer: OptimizerSpec = "adam",
    loss_fn: LossFn | None = None,
    precision: str = "fp32",
    activation_checkpointing: bool | Sequence[int] = False,
    timeout_s: float = 300.0,
    backend: str | None = None,
    progress: bool = True,
    planner: PlannerOptions | None = None,
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
        recompute, offload: "auto" (the planner recomputes, or keeps in host memory, the saved
            activations of the stages that do not fit the cap otherwise, whichever adds less
            time), "on" (every stage), "off" (never) or a list of stage indices; the plan
            records the choice per stage (docs/planner.md, "Recompute and offload").
        activation_checkpointing: the older name of ``recompute``: True means recompute="on",
            a list of stage indices recompute=[...] (the runtime also reads it as before).
        cache: the profile cache: True (the default folder), False (none) or a folder.
        progress: show tracing and planning progress on a terminal.
        planner: planner tuning, rarely needed: ``nowdl.PlannerOptions(time_limit=None,
            mip_gap=0.01, leaf_modules=(), tracer="auto", exact=False)`` (see :class:`PlannerOptions`).
        nodes, gpus_per_node: the cluster (nodes x gpus_per_node must equal gpus); default:
            the device spec's node (h100/h200: 8-GPU DGX H100, a100: DGX A100) when it divides
            gpus, else one node. Placement and link costs follow it (docs/multinode.md).
        global_batch: samples per optimizer step; the planner chooses how to split it into
            micro-batches x replicas x dp x samples per micro-batch. Default: the batch of the first
            ``train_step``; ``plan(x)`` without it treats ``x`` as one micro-batch and says which
            global batch it chose (docs/plan-format.md).
        tiles_per_gpu: "auto" (the planner may run a spatial stage's tiles one after another on
            each GPU, recomputing them in the backward), 1 (never) or N (N tiles per GPU; the
            image must cut into them). Norms with image statistics stay outside such stages.

    Returns:
        A CompiledModel; ``cm.plan(x)`` gives the Plan.

    Raises:
        NowdlError: a bad argument (the message says which and what to use).

    Example:
        >>> cm = nowdl.compile(UNet(), gpus=8, balance="memory")
        >>> print(cm.plan(torch.empty(1, 3, 2048, 2048, device="meta")))
    """
    _report_errors_once()  # under a launcher: one paragraph per job for a NowdlError
    if not isinstance(model, nn.Module):
        raise NowdlError(f"nowdl.compile expects an nn.Module, got {type(model).__name__}")
    if planner is None:
        planner = PlannerOptions()
    elif not isinstance(planner, PlannerOptions):
        raise NowdlError(f"planner={planner!r} is not a PlannerOptions: pass e.g. "
                         "planner=nowdl.PlannerOptions(time_limit=60, mip_gap=0)")
    options = RuntimeOptions(mode=mode, device=device, device_spec=device_spec, cache=cache, progress=progress,
                             optimizer=optimizer, loss_fn=loss_fn, precision=precision, activation_checkpointing=activation_checkpointing,
                             halo_fusion=halo_fusion, timeout_s=timeout_s, backend=backend)
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
                              spatial_stages=spatial_stages, slice=slice, gpu_memory=cap,
                              time_limit=planner.budget[0], milp=planner.budget[1], mip_gap=planner.mip_gap, nodes=nodes,
                              gpus_per_node=gpus_per_node, offload=check_lever("offload", offload),
                              recompute=recompute_setting(recompute, options.activation_checkpointing),
                              global_batch=global_batch, tiles_per_gpu=tiles_arg(tiles_per_gpu))
    cm = CompiledModel(model, request=request, plan_path=plan_path, options=options, planner=planner)
    return cm


def tiles_arg(v: object) -> int | None:
    """``tiles_per_gpu`` as the PlanRequest takes it: None for "auto", else a positive int."""
    if v == "auto" or v is None:
        return None
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise NowdlError(f"tiles_per_gpu={v!r} is neither 'auto' nor a positive integer: pass 'auto' (the planner "
                         "chooses), 1 (no sequential tiles) or e.g. 4 (--tiles-per-gpu auto|1|4)")
    return v


def _report_errors_once() -> None:
    """Under a launcher (several ranks), route uncaught exceptions to the one-paragraph report of
    runtime/training/report_once.py ([Note: API errors under a launcher]); it is imported only
    when an exception arrives, so planning loads no runtime module."""
    if sys.excepthook is not sys.__excepthook__:
        return  # the user's own hook, or installed already
    sizes = [os.environ.get(k, "") for k in ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")]
    if max((int(v) for v in sizes if v.isdigit()), default=1) <= 1:
        return

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        from nowdl.runtime.training.report_once import install

        sys.excepthook = sys.__excepthook__
        install()
        sys.excepthook(kind, value, tb)

    sys.excepthook = hook


def _parts_arg(v: int | Sequence[int] | None) -> int | tuple[int, ...] | None:
    if v is None or isinstance(v, int):
        return v
    if isinstance(v, (list, tuple)):
        return tuple(v)
    raise NowdlError(f"spatial_parts must be an int or a list of ints (one per spatial stage), got {v!r}")


def profile_model(model: nn.Module, *example_inputs: torch.Tensor, mode: str = "auto",
                  device: str | torch.device | None = None, device_spec: DeviceSpecLike | None = None,
                  optimizer: str = "adam", cache: CacheSetting = True,
                  progress: bool = True, precision: str = "fp32") -> Profile:
    """Trace and profile ``model`` on one micro-batch: per-node costs.

    Example:
        >>> prof = nowdl.profile(model, torch.randn(1, 3, 256, 256), mode="measure")
    """
    options = RuntimeOptions(mode=mode, device=device, device_spec=device_spec, optimizer=optimizer, cache=cache,
                             progress=progress, precision=precision)
    cm = CompiledModel(model, request=None, plan_path=None, options=options, planner=PlannerOptions())
    return cm.profile(*example_inputs)
