"""What ``nowdl run`` runs: its options, where the model and the plan come from, the optimizer."""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nowdl.cli.inputs import whole_input
from nowdl.cli.levers import add_lever_arguments
from nowdl.cli.losses import add_loss_arguments
from nowdl.cli.validation import add_validation_arguments
from nowdl.errors import NowdlError
from nowdl.runtime.launch.local import add_nproc_argument
from nowdl.units import parse_parts

__all__ = ["add_run_arguments", "check_options", "RunSource", "output_shape", "run_source", "check_model_input", "step_batches",
           "check_pins", "pin_conflicts", "make_optimizer"]

_PRECISIONS = ("fp32", "bf16", "fp16")
_OPTIMIZERS = ("adam", "adamw", "sgd", "momentum")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Add the options of ``nowdl run`` to ``p``."""
    p.add_argument("model", metavar="MODEL|PLAN.json",
                   help="built-in model name, package.module:callable, or a plan JSON saved by `nowdl plan --out`")
    p.add_argument("--model-args", metavar="JSON", help="keyword arguments for the model, as a JSON object")
    p.add_argument("--input", metavar="NxCxHxW",
                   help="the whole input of one micro-batch, batch first, as `nowdl plan` reads it: N samples "
                   "of CxHxW, e.g. 1x3x1024x1024 (default: the built-in model's or the plan's)")
    p.add_argument("--steps", type=int, required=True, help="optimizer (or inference) steps to run")
    add_nproc_argument(p)
    p.add_argument("--batch-size", type=int, help="GLOBAL batch per step = micro-batch x micro-batches x replicas x "
                   "dp; the planner chooses the split (default with a plan: the plan's)")
    p.add_argument("--micro-batches", type=int, help="pin micro-batches per step")
    p.add_argument("--tiles-per-gpu", default="auto", metavar="auto|N",
                   help="tiles each GPU of a spatial stage runs one after another (auto: the planner chooses; 1: never)")
    p.add_argument("--stages", type=int, help="pin the number of pipeline stages")
    p.add_argument("--dp", type=int, help="pin the data-parallel degree")
    p.add_argument("--replicas", type=int, choices=(1, 2), help="pin replicas (2: GEMS-MASTER mirrored replica)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "zb"), help="pin the pipeline schedule (zb: zero bubble)")
    p.add_argument("--spatial-parts", type=parse_parts, metavar="P[,P2..]",
                   help="pin spatial parts (image tiles) per spatial stage: 4, or one per stage: 4,2 (1: none)")
    p.add_argument("--spatial-stages", type=int, help="pin how many leading stages are spatial")
    p.add_argument("--slice", choices=("vertical", "horizontal", "square", "depth", "cube"), help="tile shape")
    p.add_argument("--halo-fusion", default="auto", metavar="auto|off|N",
                   help="fuse conv/pool runs into one deeper halo exchange (auto, off, or up to N per exchange)")
    p.add_argument("--balance", choices=("memory", "compute"), default="memory",
                   help="what the planner balances (default memory)")
    add_lever_arguments(p)
    p.add_argument("--num-classes", type=int, metavar="C",
                   help="label classes (default: the model's output channels; built-in models are built "
                   "with it unless --model-args says otherwise)")
    p.add_argument("--data", default="synthetic", metavar="SOURCE",
                   help="synthetic (seeded random, default), imagefolder:PATH (PATH/<class>/<image or .npy>), "
                   "zarr:PATH[:ARRAY], tiff:PATH[:level=N] (a file or a folder of them), h5:PATH:DATASET, geotiff:PATH "
                   "(seeded --input crops of large images), or package.module:callable returning a torch Dataset")
    p.add_argument("--data-args", metavar="JSON", help="keyword arguments for --data package.module:callable")
    p.add_argument("--labels", metavar="SOURCE",
                   help="masks for zarr:/tiff:/h5: data, same layout and shape as the images (segmentation)")
    p.add_argument("--normalize", metavar="mean=M,..,std=S,..|auto",
                   help="per-band (x - mean) / std of a reader's scaled pixels: one mean and one std per band, or "
                   "auto (from 16 crops of --data; printed and recorded in the checkpoint for predict)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="DataLoader worker processes per rank (default min(4, CPU cores); 0: load in the loop)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="write DIR/metrics.jsonl (rank 0; one line per step) and TensorBoard events if installed")
    p.add_argument("--eval", action="store_true", help="inference steps (eval_step) instead of training")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--optimizer", choices=_OPTIMIZERS, default="adam",
                   help="adam (default), adamw, sgd, or momentum (SGD with momentum 0.9)")
    p.add_argument("--precision", choices=_PRECISIONS, default="fp32", help="numeric precision (default fp32)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="resume from DIR if it holds a checkpoint (re-planned and resharded when the job has "
                   "other GPUs or pins); save there after the last step, every --save-every steps, and on "
                   "SIGTERM/SIGINT")
    p.add_argument("--save-every", type=int, metavar="N", help="also save the checkpoint every N steps")
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="skip a step whose loss or a gradient is NaN or infinite, and count it (default: stop the run "
                   "at once, naming the step, the rank and the input, with no new checkpoint)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any rank waits for a peer before failing, naming it (default 300)")
    p.add_argument("--gpu-memory", metavar="SIZE", help="per-GPU memory cap for planning, e.g. 80GiB")
    p.add_argument("--device-spec", help="device spec the planner estimates with (default h100)")
    p.add_argument("--no-link-probe", action="store_true",
                   help="when planning, keep the device spec's link figures instead of measuring this job's "
                   "point-to-point and all-reduce links first (cached per host, backend, world size and device)")
    p.add_argument("-v", "--verbose", action="store_true", help="log what nowdl does")
    add_loss_arguments(p)
    add_validation_arguments(p)



# ---- model and plan -----------------------------------------------------------------------------------
def output_shape(model: nn.Module, sample_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of ``model``'s output for a batch of 2 samples, found on meta tensors.

    Raises:
        NowdlError: the model does not return one tensor.
    """
    was_training = model.training
    model.eval()
    try:
        x = torch.empty((2, *sample_shape), device="meta")
        try:
            meta = {k: torch.empty_like(v, device="meta")
                    for k, v in itertools.chain(model.named_parameters(), model.named_buffers())}
            with torch.no_grad():
                out = torch.func.functional_call(model, meta, (x,))
        except Exception:  # an op without a meta kernel: run once on real zeros
            with torch.no_grad():
                out = model(torch.zeros((2, *sample_shape)))
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor):
        raise NowdlError(f"nowdl run trains models that return one tensor; this one returns {type(out).__name__}")
    return tuple(out.shape)


def _builtin_class_arg(spec: str) -> str | None:
    """The keyword a built-in model takes for its class count (None: not a built-in)."""
    from nowdl.models import MODELS

    if ":" in spec or spec not in MODELS:
        return None
    params = inspect.signature(MODELS[spec]).parameters
    return next((k for k in ("num_classes", "out_channels") if k in params), None)


@dataclass
class RunSource:
    """The model (``spec``, ``model_args``), one sample's shape, and the plan to run, if any."""

    spec: str
    model_args: str | None
    sample_shape: tuple[int, ...]
    plan_path: str | None
    plan_config: dict[str, Any] | None
    plan_batch: int | None  # samples per step of the plan
    input_text: str | None = None  # --input, when it was given
    micro_batch: int | None = None  # samples per micro-batch: --input's (or the plan's) batch dimension


def _is_plan_arg(model: str) -> bool:
    return model.lower().endswith(".json") or (os.path.isfile(model) and ":" not in model)


def _whole_input(text: str | None, default: Sequence[int] | None, what: str) -> tuple[int, ...]:
    """``--input`` (or ``default``): the whole input of one micro-batch, batch first."""
    if text is None:
        if default is None:
            raise NowdlError(f"give --input NxCxHxW (the whole input of one micro-batch, batch first, e.g. "
                             f"--input 1x3x512x512): {what} has no default input")
        return tuple(default)
    shape = whole_input(text, default=default)
    if len(shape) < 2:
        raise NowdlError(f"--input {text} has no sample shape: give the whole input, batch first, e.g. "
                         f"--input 1x{text}")
    return shape


def _with_num_classes(spec: str, model_args: str | None, num_classes: int | None) -> str | None:
    """``model_args`` with ``--num-classes`` added for a built-in model that takes it (unless given)."""
    key = _builtin_class_arg(spec)
    if num_classes is None or key is None:
        return model_args
    try:
        kwargs = json.loads(model_args) if model_args else {}
    except json.JSONDecodeError:
        return model_args  # resolve_model says what is wrong with it
    if isinstance(kwargs, dict) and key not in kwargs:
        kwargs[key] = num_classes
        return json.dumps(kwargs)
    return model_args


def run_source(args: argparse.Namespace, ckpt_plan: str | None) -> RunSource:
    """Where the model and the plan come from: MODEL, a plan JSON, or a checkpoint's plan."""
    from nowdl.models import DEFAULT_INPUTS
    from nowdl.plan.plan import Plan

    plan_path = args.model if _is_plan_arg(args.model) else None
    margs: str | None
    if plan_path is not None:
        plan = Plan.load(plan_path)
        src = plan.model.get("source")
        if not isinstance(src, dict) or not isinstance(src.get("spec"), str):
            raise NowdlError(
                f"{plan_path} does not record how to build its model ({plan.model.get('name', '?')}): "
                "re-plan with `nowdl plan MODEL ... --out PLAN.json` (which records it), or run the model "
                "by name: `nowdl run MODEL --model-args JSON --stages ... --micro-batches ...`"
            )
        spec, margs = str(src["spec"]), json.dumps(src.get("args") or {})
        if args.model_args is not None:
            try:
                given = json.loads(args.model_args)
            except json.JSONDecodeError:
                given = None
            if given != (src.get("args") or {}):
                raise NowdlError(f"--model-args {args.model_args} differ from the ones {plan_path} was made "
                                 f"with ({margs}): drop --model-args or re-plan")
    else:
        spec, margs = args.model, _with_num_classes(args.model, args.model_args, args.num_classes)
    where = ckpt_plan if ckpt_plan is not None else plan_path
    if where is None:
        shape = _whole_input(args.input, DEFAULT_INPUTS.get(spec), spec)
        return RunSource(spec, margs, shape[1:], None, None, None, args.input,
                         shape[0] if args.input is not None else None)
    plan = Plan.load(where)
    inputs = plan.model.get("inputs") or [[1]]
    default = tuple(int(d) for d in inputs[0])
    c = plan.config
    per = default[0] * int(c["micro_batches"]) * int(c["replicas"]) * int(c["dp"])
    shape = _whole_input(args.input, default, where)
    if shape != default:
        raise NowdlError(f"--input {'x'.join(map(str, shape))} differs from the plan's input "
                         f"{'x'.join(map(str, default))} ({where}): drop --input or re-plan")
    return RunSource(spec, margs, shape[1:], where, dict(c), per, args.input, default[0])


def check_model_input(src: RunSource, model: nn.Module) -> None:
    """Refuse an ``--input`` without the batch dimension for a model with no default input, by the
    rank its first convolution or pooling takes."""
    if src.input_text is not None and src.plan_path is None:
        whole_input(src.input_text, model=model)


def step_batches(args: argparse.Namespace, src: RunSource, saved_run: dict[str, Any] | None) -> tuple[int, int]:
    """``(global batch of a step, samples per micro-batch when planning)``.

    The global batch is ``--batch-size``, else the plan's, else the checkpoint's. A micro-batch is
    ``--input``'s batch dimension; without ``--input`` it is ``batch / (micro-batches x replicas x
    dp)`` when all three are pinned, else the planner chooses it from a one-sample example (the
    second value is then that example's size, 1).
    """
    if saved_run is not None and args.batch_size is None and src.plan_batch is None:
        args.batch_size = int(saved_run["batch_size"])
    batch = args.batch_size if args.batch_size is not None else src.plan_batch
    if batch is None:
        raise NowdlError("give --batch-size B (the global batch per step; when planning it is micro-batches x "
                         "replicas x dp x --input's batch dimension, one sample by default)")
    if src.plan_batch is not None and batch != src.plan_batch:
        raise NowdlError(f"--batch-size {batch} but the plan in {src.plan_path} takes {src.plan_batch} samples per step")
    if src.plan_config is not None:
        return batch, int(src.micro_batch or 1)
    m, r, d, n = args.micro_batches, args.replicas, args.dp, src.micro_batch
    if m is not None and r is not None and d is not None:
        if n is None:
            if batch % (m * r * d):
                raise NowdlError(f"--batch-size {batch} does not split into micro-batches {m} x replicas {r} x dp "
                                 f"{d} = {m * r * d} equal micro-batches: pass a multiple of {m * r * d}")
            return batch, batch // (m * r * d)
        if n * m * r * d != batch:
            sample = "x".join(map(str, src.sample_shape))
            other = f", or --input {batch // (m * r * d)}x{sample}" if batch % (m * r * d) == 0 else ""
            raise NowdlError(f"--batch-size {batch} but --input {src.input_text} (micro-batches of {n}) x "
                             f"micro-batches {m} x replicas {r} x dp {d} makes {n * m * r * d} samples per step: "
                             f"give --batch-size {n * m * r * d}{other}")
        return batch, n
    n = n or 1
    if batch % n:
        raise NowdlError(f"--batch-size {batch} is not a multiple of --input {src.input_text}'s batch dimension {n} "
                         f"(samples per micro-batch): give a multiple of {n}")
    return batch, n


def pin_conflicts(args: argparse.Namespace, config: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(flag, pinned, plan's)`` for every pinned option the plan ``config`` disagrees with."""
    out = []
    for opt in ("stages", "micro_batches", "dp", "replicas", "schedule"):
        want = getattr(args, opt)
        if want is not None and want != config.get(opt):
            out.append(("--" + opt.replace("_", "-"), want, config.get(opt)))
    for opt in ("recompute", "offload"):  # "auto" pins nothing; a plan without the key was made with "auto"
        want, have = getattr(args, opt, "auto"), config.get(opt, "auto")
        if want != "auto" and (list(want) if isinstance(want, tuple) else want) != have:
            out.append(("--" + opt, want, have))
    return out


def check_pins(args: argparse.Namespace, config: dict[str, Any], where: str) -> None:
    """Raise if a pinned option disagrees with the plan in ``where``."""
    for flag, want, have in pin_conflicts(args, config):
        raise NowdlError(f"{flag} {want} but the plan in {where} has {flag[2:].replace('-', '_')} {have}: drop {flag} "
                         "(the plan fixes it) or use another plan")


def make_optimizer(name: str, lr: float) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    if not (lr > 0 and math.isfinite(lr)):
        raise NowdlError(f"--lr {lr} must be a positive number")

    def make(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        if name == "adam":
            return torch.optim.Adam(params, lr=lr)
        if name == "adamw":
            return torch.optim.AdamW(params, lr=lr)
        if name == "momentum":
            return torch.optim.SGD(params, lr=lr, momentum=0.9)
        return torch.optim.SGD(params, lr=lr)

    return make


def check_options(args: argparse.Namespace) -> tuple[Any, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]]:
    """Refuse bad ``nowdl run`` options before anything starts: ``(nowdl.compile's parameters, the
    optimizer factory)``."""
    from nowdl.cli import validation
    from nowdl.cli.losses import make_loss
    from nowdl.runtime.data.feed import check_data_spec

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
    check_data_spec(str(args.data))
    validation.check_validation(args)
    make_loss(args.loss, args.loss_args)  # a bad --loss is refused before anything runs
    return compile_params, make_optimizer(args.optimizer, args.lr)
