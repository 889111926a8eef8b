"""``nowdl run``: train (or evaluate) a model on synthetic or image-folder data, as one command.

Launched like any torch.distributed job, every rank runs the same command::

    torchrun --nproc-per-node 4 -m nowdl run resnet --input 3x1024x1024 --batch-size 8 --steps 10

Every rank seeds torch with ``--seed`` before building the model (so the weights agree) and trains
on the same global batch. The ranks probe their links (cached; ``--no-link-probe``: not, see
docs/calibrate.md), then rank 0 plans (``nowdl.compile(model, gpus=WORLD_SIZE, <the pinned options>,
mode="estimate")`` on the device spec with those links) and broadcasts the plan JSON, which every rank then
runs (``nowdl.compile(model, plan=...)``); a planning error is reported by every rank. Given a plan
JSON as MODEL, every rank loads it and rebuilds the model from the plan's recorded source.

``--batch-size`` is the GLOBAL batch of a step. When ``--micro-batches``, ``--replicas`` and
``--dp`` are all pinned, a micro-batch is ``batch / (micro-batches x replicas x dp)`` samples;
otherwise it is one sample and the planner picks a configuration whose micro-batches x replicas
x dp equals the batch. ``--precision`` is passed to ``nowdl.compile`` when it takes one
(fp32 only otherwise).

The loss is cross-entropy: against one integer label per sample when the model's output is
``(N, C)`` logits, against an integer label map of the output's spatial shape when the output
is dense ``(N, C, H, W[, D])`` (segmentation). The output's shape is found once on meta tensors.

Data (``--data``):

* ``synthetic`` (default): a seeded random global batch per step, generated on every rank from
  ``--seed`` and the step number, so the ranks (and a resumed run) see the same data.
* ``imagefolder:PATH``: ``PATH/<class>/<file>``, one class per subfolder (sorted names give the
  labels 0, 1, ...). ``.npy`` arrays ``(C, H, W)`` (or ``(H, W)``; 3D models: ``(C, D, H, W)``)
  load with numpy; ``.png``/``.jpg``/``.jpeg``/``.tif``/``.tiff`` need Pillow (``pip install
  pillow``; it is not a dependency of nowdl). Samples are scaled to ``[0, 1]`` (uint8 / 255),
  resized so that they cover ``--input`` and centre-cropped to it; the order is a seeded
  shuffle per epoch. Per-image labels only fit classification models.
* ``zarr:PATH[:ARRAY]``, ``tiff:PATH[:level=N]``, ``h5:PATH:DATASET``: seeded ``--input`` crops of
  large images, masks from ``--labels`` (``nowdl.runtime.data.feed``); with a spatial plan each rank
  reads only its tile. ``package.module:callable`` (``--data-args JSON``): a torch Dataset.
  Datasets load through ``nowdl.data.loader`` with ``--workers`` processes.

``--log-dir DIR``: ``DIR/metrics.jsonl`` and TensorBoard events (``nowdl.runtime.training.metrics``).

Output (rank 0 only; the other ranks print nothing but errors)::

    step 3/10  loss 0.6931  1.23 s  6.5 images/s
    mean: 6.4 images/s over steps 2..10 (first step excluded: planning and warm-up)

and a tqdm bar on stderr when stderr is a terminal. Data loading is not timed.

``--checkpoint DIR``: if ``DIR`` holds a checkpoint written by ``nowdl run`` the run resumes from
it (weights, optimizer state, RNG state, the step number and the plan it ran with) and runs
``--steps`` MORE steps, numbered on from there. When this job has another number of ranks, or
pins (``--stages``, ``--dp``, ...) the saved plan disagrees with, rank 0 re-plans and the weights
and optimizer state are resharded by name. It saves after the last step, every ``--save-every N``
steps, and when SIGTERM or SIGINT arrives (the step in flight finishes, every rank agrees to stop
after it, the checkpoint is written, and the run exits with 128 + the signal number; a second
signal stops at once). Checkpoints are torch.distributed.checkpoint folders, written atomically
(see docs/checkpoints.md). ``DIR`` must be visible to every rank (a shared filesystem when the
job spans nodes).
"""


from __future__ import annotations

import argparse
import functools
import inspect
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nowdl.cli.resume import StopSignal, reusable_plan, run_state
from nowdl.cli.runspec import (
    RunSource,
    check_pins,
    make_optimizer,
    output_shape,
    run_source,
)
from nowdl.errors import NowdlError, ReportedError, error_text
from nowdl.runtime.data.feed import Feed, check_data_spec, label_loss, make_feed
from nowdl.runtime.launch.failure import open_channel
from nowdl.runtime.launch.group import PeerError
from nowdl.runtime.training.checkpoint import open_checkpoint
from nowdl.runtime.training.metrics import MetricsWriter, PeakMeter

__all__ = ["run_main", "PLAN_FILE"]

#: File in ``--checkpoint DIR`` holding a copy of the latest checkpoint's plan (``nowdl run DIR/plan.json``).
PLAN_FILE = "plan.json"


# ---- main ----------------------------------------------------------------------------------------
def _rate(images: int, secs: float) -> str:
    return f"{images / secs:.1f}" if secs > 0 else "inf"


def run_main(args: argparse.Namespace) -> int:
    """``nowdl run``: returns the exit status (errors are raised as NowdlError)."""
    from nowdl.runtime.launch.group import init_distributed, launch_env

    env = launch_env()
    if args.steps is None or args.steps < 1:
        raise NowdlError(f"--steps must be a positive integer, got {args.steps}")
    if args.batch_size is not None and args.batch_size < 1:
        raise NowdlError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.num_classes is not None and args.num_classes < 1:
        raise NowdlError(f"--num-classes must be a positive integer, got {args.num_classes}")
    if args.save_every is not None and args.save_every < 1:
        raise NowdlError(f"--save-every must be a positive number of steps, got {args.save_every}")
    if args.save_every is not None and not args.checkpoint:
        raise NowdlError("--save-every needs --checkpoint DIR (where to save)")
    if not args.timeout > 0:
        raise NowdlError(f"--timeout must be positive seconds, got {args.timeout}")
    if args.device_spec is not None and str(args.device_spec).strip().lower() != "cpu":
        from nowdl.profiler.devices import get_device_spec

        get_device_spec(args.device_spec)  # a bad name or file is refused before anything runs
    import nowdl

    compile_params = inspect.signature(nowdl.compile).parameters
    if args.precision != "fp32" and "precision" not in compile_params:
        raise NowdlError(f"--precision {args.precision} is not supported yet: nowdl trains in fp32 for now "
                         "(use --precision fp32)")
    data_kind, data_path = check_data_spec(str(args.data)), str(args.data).partition(":")[2]
    optimizer = make_optimizer(args.optimizer, args.lr)

    world, rank = env.world_size, env.rank
    initialized_here = False
    if world > 1 and not dist.is_initialized():
        init_distributed(timeout_s=args.timeout)
        initialized_here = True
    channel = open_channel(rank, world, report=lambda m: print(f"nowdl run: error: {m}", file=sys.stderr, flush=True),
                           timeout_s=args.timeout)
    try:
        with tempfile.TemporaryDirectory(prefix="nowdl-run-") as tmp:
            return _run(args, rank, world, optimizer, data_kind, data_path, compile_params, Path(tmp))
    except Exception as e:
        if channel is None:
            raise
        channel.fail(error_text(e), consequence=isinstance(e, PeerError))  # rank 0 prints the job's first failure; every rank exits 2
        raise ReportedError(str(e)) from e
    finally:
        if channel is not None:
            channel.close()
        if initialized_here and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer may be gone; the error that got us here matters more
                pass


def _plan_on_rank0(model: nn.Module, args: argparse.Namespace, rank: int, world: int, batch: int,
                   micro_batch: int, src: RunSource, optimizer: Any, progress: bool) -> str:
    """Rank 0 plans one ``micro_batch``-sample micro-batch for a ``batch``-sample step; every rank
    gets the plan JSON (or rank 0's error), through the trainer's ``plan_on_rank0``."""
    import dataclasses

    import nowdl
    from nowdl.runtime.training.trainer import plan_on_rank0

    nodes, per_node = _job_nodes(world)

    def make() -> nowdl.Plan:
        planner = nowdl.compile(model, gpus=world, balance=args.balance, stages=args.stages,
                                micro_batches=args.micro_batches, schedule=args.schedule,
                                replicas=args.replicas, dp=args.dp, spatial_parts=args.spatial_parts,
                                spatial_stages=args.spatial_stages, slice=args.slice, halo_fusion=args.halo_fusion,
                                gpu_memory=args.gpu_memory, mode="estimate", device_spec=args.device_spec,
                                optimizer=optimizer, progress=progress, nodes=nodes, gpus_per_node=per_node)
        if planner.request is not None:
            planner.request = dataclasses.replace(planner.request, global_batch=batch)
        plan = planner.plan(torch.empty((micro_batch, *src.sample_shape), device="meta"))
        plan.model["source"] = {"spec": src.spec, "args": json.loads(src.model_args or "{}")}
        return plan

    return plan_on_rank0(make, rank=rank, world=world).to_json()


def _probe_links(args: argparse.Namespace, world: int, tmp: Path, say: bool) -> None:
    """Measure this job's links (or reuse rank 0's cache) and plan with them (docs/calibrate.md):
    ``args.device_spec`` becomes a spec file with the measured figures. Collective."""
    nodes, per = _job_nodes(world)
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


def _job_nodes(world: int) -> tuple[int | None, int | None]:
    """The launched job's (nodes, processes per node) for the planner (torchrun --nnodes, srun)."""
    from nowdl.runtime.launch.nodes import job_topology

    nodes, per = job_topology()
    return (nodes, per) if nodes is not None and per is not None and nodes * per == world else (None, None)


def _run(args: argparse.Namespace, rank: int, world: int,
         optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], data_kind: str, data_path: str,
         compile_params: Any, tmp: Path) -> int:
    import nowdl
    from nowdl.models.resolve import resolve_model

    say = rank == 0
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    ck = open_checkpoint(ckpt) if ckpt is not None else None  # every rank gets the same answer or error
    saved_run = run_state(ck, args) if ck is not None else None
    ckpt_plan = None
    if ck is not None and reusable_plan(ck, args, world):
        ckpt_plan = tmp / "checkpoint-plan.json"
        ckpt_plan.write_text(json.dumps(ck.record["plan"]))
    src = run_source(args, str(ckpt_plan) if ckpt_plan is not None else None)
    if src.plan_config is not None:
        check_pins(args, src.plan_config, str(src.plan_path))
        if src.plan_config.get("gpus") != world:
            g = src.plan_config.get("gpus")
            raise NowdlError(f"the plan in {src.plan_path} needs {g} ranks but this job has {world}: launch with "
                             f"torchrun --nproc-per-node {g}")
    if saved_run is not None and args.batch_size is None and src.plan_batch is None:
        args.batch_size = int(saved_run["batch_size"])
    batch = args.batch_size if args.batch_size is not None else src.plan_batch
    if batch is None:
        raise NowdlError("give --batch-size B (the global batch per step; when planning it is micro-batches x "
                         "replicas x dp, one sample per micro-batch)")
    if src.plan_batch is not None and batch != src.plan_batch:
        raise NowdlError(f"--batch-size {batch} but the plan in {src.plan_path} takes {src.plan_batch} samples per step")
    micro_batch = 1
    if src.plan_config is None:
        m, r, d = args.micro_batches, args.replicas, args.dp
        if m is not None and r is not None and d is not None:
            if batch % (m * r * d):
                raise NowdlError(f"--batch-size {batch} does not split into micro-batches {m} x replicas {r} x dp {d} "
                                 f"= {m * r * d} equal micro-batches: pass a multiple of {m * r * d}")
            micro_batch = batch // (m * r * d)

    torch.manual_seed(args.seed)  # the same weights on every rank
    model, _, name = resolve_model(src.spec, src.model_args)
    out = output_shape(model, src.sample_shape)
    if len(out) < 2:
        raise NowdlError(f"{name} returns shape {out}: nowdl run needs (N, C) logits or dense (N, C, ...) outputs")
    feed: Feed = make_feed(args, src.sample_shape, out, name)  # checks the data before anything is written
    progress = say and sys.stderr.isatty()
    extra: dict[str, Any] = {}
    if "precision" in compile_params:
        extra["precision"] = args.precision
    common: dict[str, Any] = dict(optimizer=optimizer, loss_fn=label_loss(nn.CrossEntropyLoss()), progress=progress,
                                  timeout_s=args.timeout, **extra)
    start = ck.step if ck is not None and not args.eval else 0
    total = start + args.steps
    if say:
        what = "inference" if args.eval else f"training ({args.optimizer}, lr {args.lr:g})"
        print(f"nowdl run: {name} on {world} rank{'s' if world > 1 else ''}, global batch {batch} of "
              f"{'x'.join(map(str, src.sample_shape))}, {feed.label} data, {what}", flush=True)
    t_plan = time.perf_counter()
    plan_path = src.plan_path
    if plan_path is None:  # rank 0 plans, every rank runs what it planned
        plan_path = str(tmp / PLAN_FILE)
        _probe_links(args, world, tmp, say)
        text = _plan_on_rank0(model, args, rank, world, batch, micro_batch, src, optimizer, progress)
        Path(plan_path).write_text(text)
    cm = nowdl.compile(model, plan=plan_path, **common)
    run_plan = nowdl.Plan.load(plan_path)
    feed.start(start, batch, lazy=any(st.parts > 1 for st in run_plan.stages), stop=total)
    log_dir = getattr(args, "log_dir", None)
    metrics = None if log_dir is None else MetricsWriter(
        log_dir, rank=rank, world=world, predicted_bytes=run_plan.ranks[rank].predicted_peak_bytes,
        meta={"model": src.spec, "world": world, "config": dict(run_plan.config)})
    if ck is not None and ckpt is not None:
        x0, _, _ = feed.next(start)
        cm.load_checkpoint(ckpt, x0)
        if say:
            what = "loaded the weights of" if args.eval else "resumed from"
            how = "" if ckpt_plan is not None else (f" (saved by a plan for {ck.record['plan']['config'].get('gpus')} "
                                                    "GPU(s); re-planned, weights and optimizer state resharded)")
            print(f"{what} {ckpt} at step {ck.step}{how}", flush=True)
    setup_s = time.perf_counter() - t_plan  # counted in the first step, as when the trainer plans
    meter = PeakMeter(cm, cuda=torch.cuda.is_available())

    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="eval" if args.eval else "train", unit="step", file=sys.stderr,
                   leave=False)

    def emit(line: str) -> None:
        if not say:
            return
        if bar is not None:
            bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def save(step: int) -> None:
        assert ckpt is not None
        run = {"model": src.spec, "model_args": json.loads(src.model_args or "{}"), "batch_size": batch,
               "seed": args.seed, "data": args.data, "step": step}
        cm.save_checkpoint(ckpt, meta={"run": run})
        if rank == 0:
            plan = _current_plan(cm)
            if plan is not None:
                if not isinstance(plan.model.get("source"), dict):  # so `nowdl run DIR/plan.json` works too
                    plan.model["source"] = {"spec": src.spec, "args": json.loads(src.model_args or "{}")}
                plan.save(ckpt / PLAN_FILE)  # atomic
        emit(f"saved checkpoint at step {step} to {ckpt}")

    training = ckpt is not None and not args.eval
    times: list[float] = []
    stopped = 0
    with StopSignal() as stop:
        try:
            for step in range(start, total):
                x, y, wait = feed.next(step)
                t0, read0 = time.perf_counter(), feed.read_seconds()
                run_step = functools.partial(cm.eval_step, x) if args.eval else functools.partial(cm.train_step, x, y)
                loss, peak = meter.run(run_step) if metrics is not None else (run_step(), 0)
                if args.eval:
                    if world > 1:
                        dist.barrier()
                    loss, loss_text = None, ""
                else:
                    loss_text = f"  loss {loss:.4f}"
                dt = time.perf_counter() - t0 + (setup_s if step == start else 0.0)
                if metrics is not None:  # lazy reads (a rank's tile) happen inside the step: data wait too
                    metrics.step(step + 1, loss=loss, images_per_s=batch / dt if dt > 0 else 0.0, step_s=dt,
                                 data_wait_s=wait + feed.read_seconds() - read0, peak_bytes=peak)
                times.append(dt)
                if step == start:
                    emit(_plan_line(cm))
                emit(f"step {step + 1}/{total}{loss_text}  {dt:.2f} s  {_rate(batch, dt)} images/s")
                if bar is not None:
                    bar.update(1)
                stopped = stop.agreed(world)
                if stopped or step + 1 == total:
                    break
                if training and args.save_every and (step + 1 - start) % args.save_every == 0:
                    save(step + 1)
        finally:
            if bar is not None:
                bar.close()
            if metrics is not None:
                metrics.close()
            feed.close()
        done = start + len(times)
        if len(times) > 1:
            emit(f"mean: {_rate(batch * (len(times) - 1), sum(times[1:]))} images/s over steps "
                 f"{start + 2}..{done} (first step excluded: planning and warm-up)")
        else:
            emit(f"mean: {_rate(batch, times[0])} images/s over step {done} (the only step: includes planning "
                 "and warm-up)")
        if training:
            save(done)
    if stopped:
        name = signal.Signals(stopped).name
        emit(f"stopped by {name} after step {done} of {total}"
             + (f"; resume with the same command and --checkpoint {ckpt}" if training else " (no --checkpoint: "
                "nothing saved)"))
        return 128 + stopped
    return 0


def _current_plan(cm: Any) -> Any:
    trainer = getattr(cm, "_trainer", None)
    return getattr(trainer, "plan", None)


def _plan_line(cm: Any) -> str:
    plan = _current_plan(cm)
    if plan is None:
        return "plan: ?"
    c = plan.config
    return (f"plan: {c.get('stages')} stage(s) x {c.get('micro_batches')} micro-batch(es) ({c.get('schedule')}), "
            f"replicas {c.get('replicas')}, dp {c.get('dp')}, {c.get('gpus')} rank(s)"
            + "".join(f"; {s.tiles()}" + (f", {len(s.fused)} fused halo run(s)" if s.fused else "")
                      for s in plan.stages if s.parts > 1))
