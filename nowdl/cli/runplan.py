"""How ``nowdl run`` gets a plan: rank 0 plans with the job's measured links and every rank gets it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nowdl.cli.levers import lever_kwargs
from nowdl.cli.runspec import RunSource

__all__ = ["plan_job", "probe_job_links", "job_nodes", "current_plan", "plan_line"]


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
    if plan is None:
        return "plan: ?"
    c = plan.config
    return (f"{'inference plan' if c.get('inference') else 'plan'}: {c.get('stages')} stage(s) x {c.get('micro_batches')} micro-batch(es) ({c.get('schedule')}), "
            f"replicas {c.get('replicas')}, dp {c.get('dp')}, {c.get('gpus')} rank(s)"
            + "".join(f"; {s.tiles()}" + (f", {len(s.fused)} fused halo run(s)" if s.fused else "")
                      for s in plan.stages if s.parts > 1))
