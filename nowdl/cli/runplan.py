"""How ``nowdl run`` gets a plan: rank 0 plans with the job's measured links and every rank gets it;
what the phases of a run share (:class:`Job`), how it compiles a plan, and how it re-plans when a
rank needs more memory than planned ([Note: re-plan on memory] in runtime/training/memory_guard.py)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nowdl.cli import validation
from nowdl.cli.levers import lever_kwargs
from nowdl.cli.losses import make_loss
from nowdl.cli.runspec import RunSource
from nowdl.plan.plan import Plan
from nowdl.runtime.data.feed import Feed, label_loss
from nowdl.runtime.training.checkpoint import Checkpoint
from nowdl.runtime.training.memory_guard import Charge, Replan, plan_text
from nowdl.runtime.training.reshard import HeldState

__all__ = ["plan_job", "probe_job_links", "job_nodes", "current_plan", "plan_line", "Job", "compile_job", "replanner"]


def plan_job(model: nn.Module, args: argparse.Namespace, rank: int, world: int, batch: int,
             micro_batch: int, src: RunSource, optimizer: Any, progress: bool, *, pin_micro_batch: bool = False) -> str:
    """Rank 0 plans a ``batch``-sample step from a ``micro_batch``-sample example (the micro-batch
    size when ``--input`` gives it or ``pin_micro_batch``, else the planner chooses it); every rank
    gets the plan JSON (or rank 0's error), through the trainer's ``plan_on_rank0``."""
    import dataclasses

    import nowdl
    from nowdl.runtime.training.plan_share import plan_on_rank0

    nodes, per_node = job_nodes(world)

    def make() -> nowdl.Plan:
        planner = nowdl.compile(model, gpus=world, balance=args.balance, stages=args.stages,
                                micro_batches=args.micro_batches, schedule=args.schedule,
                                replicas=args.replicas, dp=args.dp, spatial_parts=args.spatial_parts,
                                spatial_stages=args.spatial_stages, slice=args.slice, halo_fusion=args.halo_fusion,
                                gpu_memory=args.gpu_memory, mode="estimate", device_spec=args.device_spec,
                                optimizer=optimizer, progress=progress, nodes=nodes, gpus_per_node=per_node,
                                global_batch=batch, tiles_per_gpu=getattr(args, "tiles_per_gpu", "auto"),
                                **lever_kwargs(args))
        if planner.request is not None and (src.input_text is not None or pin_micro_batch):  # one micro-batch
            planner.request = dataclasses.replace(planner.request, micro_batch_size=micro_batch)
        plan = planner.plan(torch.empty((micro_batch, *src.sample_shape), device="meta"))
        plan.model["source"] = {"spec": src.spec, "args": json.loads(src.model_args or "{}")}
        return plan

    return plan_on_rank0(make, rank=rank, world=world).to_json()


def probe_job_links(args: argparse.Namespace, world: int, tmp: Path, say: bool) -> None:
    """Measure this job's links (or reuse rank 0's cache) and plan with them (docs/calibrate.md):
    ``args.device_spec`` becomes a spec file with the measured figures. Collective."""
    nodes, per = job_nodes(world)
    if world < 2 or getattr(args, "no_link_probe", False) or per == 1:  # per == 1: ranks 0 and 1 sit on different nodes
        return
    from nowdl.profiler.cache import default_cache_dir
    from nowdl.profiler.calibrate.links import probe_links, with_links_file

    links, where = probe_links(default_cache_dir() / "links")
    args.device_spec, text = with_links_file(args.device_spec, links, tmp / "device-spec.json",
                                             allreduce=nodes in (None, 1))
    if say:
        print(f"links: {text} ({'measured now' if where == 'measured' else 'cached in ' + where}; "
              "--no-link-probe plans without them)", flush=True)


def job_nodes(world: int) -> tuple[int | None, int | None]:
    """The launched job's (nodes, processes per node) for the planner (torchrun --nnodes, srun)."""
    from nowdl.runtime.launch.nodes import job_topology

    nodes, per = job_topology()
    return (nodes, per) if nodes is not None and per is not None and nodes * per == world else (None, None)


def current_plan(cm: Any) -> Any:
    """The plan the compiled model ``cm`` runs now (None before its first step)."""
    trainer = getattr(cm, "_trainer", None)
    return getattr(trainer, "plan", None)


def plan_line(cm: Any, plan: Any = None) -> str:
    """The ``plan: ...`` line ``nowdl run`` prints after the first step (``plan``: the one the
    step ran on, default the training plan)."""
    plan = plan if plan is not None else current_plan(cm)
    return "plan: ?" if plan is None else plan_text(plan)


@dataclass
class Job:
    """What the phases of one ``nowdl run`` share: the options, this rank, the source and batch."""

    args: argparse.Namespace
    rank: int
    world: int
    tmp: Path
    src: RunSource
    batch: int  # samples per step (global)
    micro_batch: int  # samples per micro-batch when rank 0 plans
    ckpt: Path | None  # --checkpoint DIR
    ck: Checkpoint | None  # the checkpoint found there
    ckpt_plan: Path | None  # the checkpoint's plan, when this job can run it as is
    start: int  # steps done before this run
    total: int  # the step this run ends at (runguard.run_end)
    val: validation.ValidationSet | None = None  # --val-data
    charge: Charge | None = None  # a restart after an out-of-memory re-plans with it ([Note: restart on memory])
    normalize: Any = None  # the feed's per-band Normalize, recorded in the checkpoint for predict

    @property
    def say(self) -> bool:
        return self.rank == 0

    @property
    def training(self) -> bool:
        """Training with a checkpoint folder: saves at the end and every ``--save-every`` steps."""
        return self.ckpt is not None and not self.args.eval


def compile_job(job: Job, model: nn.Module, plan_path: str, optimizer: Any, compile_params: Any, progress: bool) -> Any:
    """``nowdl.compile`` of ``model`` on the plan at ``plan_path`` with the run's optimizer and loss
    (``compile_params``: ``nowdl.compile``'s parameters)."""
    import nowdl

    args = job.args
    extra: dict[str, Any] = {"precision": args.precision} if "precision" in compile_params else {}
    cm = nowdl.compile(model, plan=plan_path, optimizer=optimizer, loss_fn=label_loss(make_loss(args.loss, args.loss_args)),
                       progress=progress, timeout_s=args.timeout, **extra)
    cm.skip_nonfinite = bool(getattr(args, "skip_nonfinite", False))
    return cm


def replanner(job: Job, feed: Feed, optimizer: Any, compile_params: Any) -> Replan:
    """The guard's re-plan ([Note: re-plan on memory]): ``replan(gpu_memory, plan, step)`` plans
    the run again with ``gpu_memory``, the micro-batch size of ``plan`` kept, on a new copy of the
    model, and returns the plan's path and how to build it with the job's state before ``step``."""
    from nowdl.models.resolve import resolve_model

    def replan(gpu_memory: int, old: Plan, step: int) -> tuple[str, Callable[[HeldState], Any]]:
        rng = torch.get_rng_state()  # the run's RNG goes on as it would have
        torch.manual_seed(job.args.seed)
        fresh, _, _ = resolve_model(job.src.spec, job.src.model_args)
        torch.set_rng_state(rng)
        args = argparse.Namespace(**{**vars(job.args), "gpu_memory": gpu_memory})
        text = plan_job(fresh, args, job.rank, job.world, job.batch, int(old.model["inputs"][0][0]), job.src,
                        optimizer, False, pin_micro_batch=True)
        path = job.tmp / "replan.json"
        path.write_text(text)

        def build(state: HeldState) -> Any:
            cm = compile_job(job, fresh, str(path), optimizer, compile_params, False)
            feed.relayout(step, lazy=any(st.parts > 1 for st in Plan.load(path).stages))  # tiles read lazily
            x, _, _ = feed.next(step)
            cm._train().restore(state, x)
            return cm

        return str(path), build

    return replan
