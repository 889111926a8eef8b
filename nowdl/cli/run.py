"""``nowdl run``: train (or evaluate) a model on synthetic or image-folder data, as one command.

Launched like any torch.distributed job, every rank runs the same command::

    torchrun --nproc-per-node 4 -m nowdl run resnet --input 1x3x1024x1024 --batch-size 8 --steps 10

Every rank seeds torch with ``--seed`` before building the model (so the weights agree) and trains
on the same global batch. The ranks probe their links (cached; ``--no-link-probe``: not, see
docs/calibrate.md), then rank 0 plans (``nowdl.compile(model, gpus=WORLD_SIZE, <the pinned options>,
mode="estimate")`` on the device spec with those links) and broadcasts the plan JSON, which every rank then
runs (``nowdl.compile(model, plan=...)``); a planning error is reported by every rank. Given a plan
JSON as MODEL, every rank loads it and rebuilds the model from the plan's recorded source.

``--input NxCxHxW`` is the whole input of one micro-batch, batch first, as ``nowdl plan`` reads it:
a micro-batch is N samples of CxHxW. ``--batch-size`` is the GLOBAL batch of a step: N x
micro-batches x replicas x dp (the planner picks a configuration that makes it). Without
``--input`` (the built-in model's default sample shape), a micro-batch is ``batch / (micro-batches
x replicas x dp)`` samples when all three are pinned, otherwise the planner chooses its size from
the global batch (the plan's ``micro_batch_size``). ``--precision`` is passed to ``nowdl.compile`` when it takes one
(fp32 only otherwise).

The loss is cross-entropy (``--loss``: any callable, nowdl/cli/losses.py): against one integer
label per sample for ``(N, C)`` logits, against an integer label map of the output's spatial
shape for dense outputs (segmentation). ``--val-data``: nowdl/cli/validation.py.

Data (``--data``): ``synthetic`` (default: a seeded random global batch per step, the same on
every rank and after a resume), ``imagefolder:PATH``, ``zarr:``/``tiff:``/``h5:`` crops of large
images with ``--labels`` masks (with a spatial plan each rank reads only its tile), or a torch
Dataset ``package.module:callable`` (``--data-args JSON``); see docs/runtime.md.

``--log-dir DIR``: ``DIR/metrics.jsonl`` and TensorBoard events (``nowdl.runtime.training.metrics``).

Output (rank 0 only; the other ranks print nothing but errors)::

    step 3/10  loss 0.6931  1.23 s  6.5 images/s
    mean: 6.4 images/s over steps 2..10 (first step excluded: planning and warm-up)

and a tqdm bar on stderr when stderr is a terminal. Data loading is not timed.

``--checkpoint DIR``: if ``DIR`` holds a checkpoint written by ``nowdl run`` the run resumes from
it (weights, optimizer state, RNG state, the step number and the plan it ran with) and runs on
to step ``--steps`` (the run's total: the same command finishes a stopped run; with ``--eval``,
``--steps`` counts inference steps from 0). When this job has another number of ranks, or
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
import json
import shutil
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

from nowdl.cli import validation
from nowdl.cli.resume import StopSignal, check_normalize, finished_text, reusable_plan, run_state
from nowdl.cli.runguard import check_outputs, checked_step, run_end
from nowdl.cli.runplan import (
    Job,
    compile_job,
    current_plan,
    plan_job,
    plan_line,
    probe_job_links,
    replanner,
)
from nowdl.cli.runspec import (
    check_model_input,
    check_options,
    check_pins,
    output_shape,
    run_source,
    step_batches,
)
from nowdl.errors import NowdlError
from nowdl.runtime.data.feed import Feed, make_feed
from nowdl.runtime.launch.failure import open_channel
from nowdl.runtime.launch.lost import report_failure
from nowdl.runtime.training.checkpoint import open_checkpoint
from nowdl.runtime.training.memory_cap import injected_cap
from nowdl.runtime.training.memory_guard import MemoryGuard, replanned_line, restart_charge
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
    compile_params, optimizer = check_options(args)
    world, rank = env.world_size, env.rank
    initialized_here = False
    if world > 1 and not dist.is_initialized():
        init_distributed(timeout_s=args.timeout)
        initialized_here = True
    channel = open_channel(rank, world, report=lambda m: print(f"nowdl run: error: {m}", file=sys.stderr, flush=True),
                           timeout_s=args.timeout)
    tmp = Path(tempfile.mkdtemp(prefix="nowdl-run-"))
    if channel is not None:  # also when a peer's failure ends this process from the watcher thread
        channel.before_exit.append(functools.partial(shutil.rmtree, tmp, ignore_errors=True))
    try:
        check_outputs(args, rank)  # before anything is planned or trained; a failure on any rank is reported
        return _run(args, rank, world, optimizer, compile_params, tmp)
    except Exception as e:
        instead = report_failure(e, rank, world, channel)  # once for the job; a lost peer is named
        if instead is None:
            raise
        raise instead from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if channel is not None:
            channel.close()
        if initialized_here and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer may be gone; the error that got us here matters more
                pass


def _run(args: argparse.Namespace, rank: int, world: int,
         optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], compile_params: Any, tmp: Path) -> int:
    job, model, name = _open_job(args, rank, world, tmp)
    finished = finished_text(job.ckpt, job.start, job.total) if job.training else None
    if finished is not None:  # a stopped run's command given again, or a restarted attempt that had finished
        if job.say:
            print(f"nowdl run: {finished}", flush=True)
        return 0
    feed = _feed(job, model, name)
    job.normalize = feed.normalize
    if job.ck is not None and not args.eval:
        check_normalize(job.ck, feed.normalize)
    job.val = (validation.ValidationSet(args, job.src.sample_shape, feed.normalize) if args.val_data is not None
               else None)
    if job.say and feed.normalize is not None:
        how = f"computed from {feed.auto} crop(s) of the data" if feed.auto else "as given"
        print(f"nowdl run: --normalize {feed.normalize.text()} ({how}; recorded in the checkpoint for predict)",
              flush=True)
    progress = job.say and sys.stderr.isatty()
    if job.say:
        what = "inference" if args.eval else f"training ({args.optimizer}, lr {args.lr:g})"
        print(f"nowdl run: {name} on {world} rank{'s' if world > 1 else ''}, global batch {job.batch} of "
              f"{'x'.join(map(str, job.src.sample_shape))}, {feed.label} data, {what}", flush=True)
    cm, metrics, setup_s = _start(job, model, feed, optimizer, compile_params, progress)
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=job.total - job.start, desc="eval" if args.eval else "train", unit="step", file=sys.stderr,
                   leave=False)
    emit = _Printer(job.say, bar)
    guard = None if args.eval else MemoryGuard(rank, world, emit, replanner(job, feed, optimizer, compile_params),
                                               records=job.ckpt, budget=job.charge.budget if job.charge else None,
                                               watch=torch.cuda.is_available() or injected_cap()[0] is not None)
    with StopSignal() as stop:
        try:
            times, stopped, cm = _steps(job, cm, feed, metrics, setup_s, emit, bar, stop, guard)
        finally:
            if bar is not None:
                bar.close()
            if metrics is not None:
                metrics.close()
            feed.close()
        done = _summary(job, times, emit)
        if job.training:
            _save(job, cm, done, emit)
    if stopped:
        name = signal.Signals(stopped).name
        emit(f"interrupted at step {done}: resume with the same command ({name}; step {done} of {job.total} saved "
             f"to {job.ckpt})" if job.training else
             f"interrupted at step {done} of {job.total} ({name}): nothing saved (no --checkpoint)")
        return 128 + stopped
    return 0


def _open_job(args: argparse.Namespace, rank: int, world: int, tmp: Path) -> tuple[Job, nn.Module, str]:
    """Open ``--checkpoint``, find the plan to run, build the model (seeded: the same weights on
    every rank) and find the batch of a step: ``(job, model, model's name)``."""
    from nowdl.models.resolve import resolve_model

    ckpt = Path(args.checkpoint) if args.checkpoint else None
    ck = open_checkpoint(ckpt) if ckpt is not None else None  # every rank gets the same answer or error
    saved_run = run_state(ck, args) if ck is not None else None
    charge = restart_charge(ckpt, rank, world) if ckpt is not None and not args.eval else None
    ckpt_plan = None
    if ck is not None and charge is None and reusable_plan(ck, args, world):
        ckpt_plan = tmp / "checkpoint-plan.json"
        ckpt_plan.write_text(json.dumps(ck.record["plan"]))
    src = run_source(args, str(ckpt_plan) if ckpt_plan is not None else None)
    if src.plan_config is not None:
        check_pins(args, src.plan_config, str(src.plan_path))
        validation.check_plan_purpose(args, str(src.plan_path))
        if src.plan_config.get("gpus") != world:
            g = src.plan_config.get("gpus")
            raise NowdlError(f"the plan in {src.plan_path} needs {g} ranks but this job has {world}: launch with "
                             f"torchrun --nproc-per-node {g}")
    torch.manual_seed(args.seed)
    model, _, name = resolve_model(src.spec, src.model_args)
    check_model_input(src, model)
    batch, micro_batch = step_batches(args, src, saved_run)
    start = ck.step if ck is not None and not args.eval else 0
    total = run_end(saved_run, start, args.steps) if not args.eval else args.steps
    return Job(args, rank, world, tmp, src, batch, micro_batch, ckpt, ck, ckpt_plan, start, total, charge=charge), model, name


def _feed(job: Job, model: nn.Module, name: str) -> Feed:
    """The data feed the model trains on, checked against the model's output shape."""
    out = output_shape(model, job.src.sample_shape)
    if len(out) < 2:
        raise NowdlError(f"{name} returns shape {out}: nowdl run needs (N, C) logits or dense (N, C, ...) outputs")
    return make_feed(job.args, job.src.sample_shape, out, name)  # checks the data before anything is written


def _start(job: Job, model: nn.Module, feed: Feed, optimizer: Any, compile_params: Any,
           progress: bool) -> tuple[Any, MetricsWriter | None, float]:
    """Plan (rank 0) or load the plan, compile, start the feed and the metrics, load the checkpoint:
    ``(compiled model, metrics writer, seconds taken)``."""
    import nowdl

    args, src, rank, world = job.args, job.src, job.rank, job.world
    t_plan = time.perf_counter()
    plan_path = src.plan_path
    if plan_path is None or job.charge is not None:  # rank 0 plans, every rank runs what it planned
        plan_path = str(job.tmp / PLAN_FILE)
        probe_job_links(args, world, job.tmp, job.say)
        charge = job.charge  # a restart after an out-of-memory [Note: restart on memory]
        asked = args if charge is None else argparse.Namespace(**{**vars(args), "gpu_memory": charge.gpu_memory})
        text = plan_job(model, asked, rank, world, job.batch, job.micro_batch if charge is None else charge.micro_batch,
                        src, optimizer, progress, pin_micro_batch=charge is not None)
        Path(plan_path).write_text(text)
        if charge is not None and job.say:
            print(replanned_line(charge.said, charge.budget, nowdl.Plan.from_json(text), f"goes on from step {job.start + 1}"
                                 + (" with the latest checkpoint's weights" if job.ck else " (no checkpoint was saved)")),
                  flush=True)
    cm = compile_job(job, model, plan_path, optimizer, compile_params, progress)
    run_plan = nowdl.Plan.load(plan_path)
    feed.start(job.start, job.batch, lazy=any(st.parts > 1 for st in run_plan.stages), stop=job.total)
    log_dir = getattr(args, "log_dir", None)
    metrics = None if log_dir is None else MetricsWriter(
        log_dir, rank=rank, world=world, predicted_bytes=run_plan.ranks[rank].predicted_peak_bytes,
        meta={"model": src.spec, "world": world, "config": dict(run_plan.config)})
    if job.ck is not None and job.ckpt is not None:
        x0, _, _ = feed.next(job.start)
        cm.load_checkpoint(job.ckpt, x0)
        if job.say:
            what = "loaded the weights of" if args.eval else "resumed from"
            how = "" if job.ckpt_plan is not None else (
                f" (saved by a plan for {job.ck.record['plan']['config'].get('gpus')} "
                "GPU(s); re-planned, weights and optimizer state resharded)")
            print(f"{what} {job.ckpt} at step {job.ck.step}{how}", flush=True)
    return cm, metrics, time.perf_counter() - t_plan  # the setup is counted in the first step


class _Printer:
    """Rank 0's output lines, written above the progress bar when there is one."""

    def __init__(self, say: bool, bar: Any) -> None:
        self.say, self.bar = say, bar

    def __call__(self, line: str) -> None:
        if not self.say:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)


def _steps(job: Job, cm: Any, feed: Feed, metrics: MetricsWriter | None, setup_s: float, emit: _Printer,
           bar: Any, stop: StopSignal, guard: MemoryGuard | None) -> tuple[list[float], int, Any]:
    """Run the steps: ``(seconds of each step run, the signal that stopped the run or 0, the
    compiled model they ended on)`` (``guard`` may re-plan: [Note: re-plan on memory])."""
    args, batch, start = job.args, job.batch, job.start
    meter = PeakMeter(cm, cuda=torch.cuda.is_available(), evaluation=args.eval)
    meter.watch = guard is not None and guard.watching
    labelled = args.labels is not None or feed.kind in ("dataset", "imagefolder")
    times: list[float] = []
    for step in range(start, job.total):
        x, y, wait = feed.next(step)
        t0, read0 = time.perf_counter(), feed.read_seconds()
        run_step = (functools.partial(validation.eval_batch, cm, x, y, job.rank, labelled) if args.eval
                    else functools.partial(cm.train_step, x, y))
        result: Any
        measured = metrics is not None or meter.watch or meter.oom_cap is not None
        try:
            result, peak, skipped = checked_step(cm, run_step, meter if measured else None, feed, step, x, args.eval)
        except torch.OutOfMemoryError as e:
            if guard is None:
                raise
            raise guard.out_of_memory(e, cm, step + 1) from None
        loss, scores = result if args.eval else (float(result), None)
        loss_text = "" if loss is None else f"  loss {loss:.4f}" + "".join(f"  {k} {v:.4f}" for k, v in (scores or {}).items())
        dt = time.perf_counter() - t0 + (setup_s if step == start else 0.0)
        if metrics is not None and args.eval and step == start:  # eval steps run on the inference plan
            metrics.predicted = int(cm.eval_plan(x).ranks[job.rank].predicted_peak_bytes)
        if metrics is not None:  # lazy reads (a rank's tile) happen inside the step: data wait too
            metrics.step(step + 1, loss=loss, images_per_s=batch / dt if dt > 0 else 0.0, step_s=dt,
                         data_wait_s=wait + feed.read_seconds() - read0, peak_bytes=peak, scores=scores)
        times.append(dt)
        if step == start:
            emit(plan_line(cm, cm.eval_plan(x) if args.eval else None))
        emit(f"step {step + 1}/{job.total}{loss_text}  {dt:.2f} s  {_rate(batch, dt)} images/s{skipped}")
        if bar is not None:
            bar.update(1)
        if job.val is not None and validation.val_due(args, step + 1, start, job.total):
            res = validation.validate(cm, job.val, job.rank)
            emit(validation.val_line(step + 1, res))
            if metrics is not None:
                metrics.validation(step + 1, res)
        stopped = stop.agreed(job.world)
        if stopped or step + 1 == job.total:
            return times, stopped, cm
        if guard is not None and meter.watch:  # after the step's peak, before the next step
            cm = meter.cm = guard.check(cm, peak, step + 1)
            meter.watch = guard.watching
            if metrics is not None:
                metrics.predicted = int(current_plan(cm).ranks[job.rank].predicted_peak_bytes)
        if job.training and args.save_every and (step + 1 - start) % args.save_every == 0:
            _save(job, cm, step + 1, emit)
    return times, 0, cm


def _summary(job: Job, times: list[float], emit: _Printer) -> int:
    """Print the mean rate; return the number of the last step run."""
    done = job.start + len(times)
    if len(times) > 1:
        emit(f"mean: {_rate(job.batch * (len(times) - 1), sum(times[1:]))} images/s over steps "
             f"{job.start + 2}..{done} (first step excluded: planning and warm-up)")
    else:
        emit(f"mean: {_rate(job.batch, times[0])} images/s over step {done} (the only step: includes planning "
             "and warm-up)")
    return done


def _save(job: Job, cm: Any, step: int, emit: _Printer) -> None:
    """Save the checkpoint after ``step`` (and, from rank 0, a copy of its plan)."""
    assert job.ckpt is not None
    src = job.src
    run = {"model": src.spec, "model_args": json.loads(src.model_args or "{}"), "batch_size": job.batch,
           "seed": job.args.seed, "data": job.args.data, "step": step, "total": job.total}
    if job.normalize is not None:
        run["normalize"] = job.normalize.to_json()
    cm.save_checkpoint(job.ckpt, meta={"run": run})
    if job.rank == 0:
        plan = current_plan(cm)
        if plan is not None:
            if not isinstance(plan.model.get("source"), dict):  # so `nowdl run DIR/plan.json` works too
                plan.model["source"] = {"spec": src.spec, "args": json.loads(src.model_args or "{}")}
            plan.save(job.ckpt / PLAN_FILE)  # atomic
    emit(f"saved checkpoint at step {step} to {job.ckpt}")
