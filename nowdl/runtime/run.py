"""``nowdl run``: train (or evaluate) a model on synthetic or image-folder data, as one command.

Launched like any torch.distributed job, every rank runs the same command::

    torchrun --nproc-per-node 4 -m nowdl run resnet --input 3x1024x1024 --batch-size 8 --steps 10

Every rank seeds torch with ``--seed`` before building the model (so the weights agree) and trains
on the same global batch. Rank 0 plans (``nowdl.compile(model, gpus=WORLD_SIZE, <the pinned
options>, mode="estimate")``) and broadcasts the plan JSON, which every rank then
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

Output (rank 0 only; the other ranks print nothing but errors)::

    step 3/10  loss 0.6931  1.23 s  6.5 images/s
    mean: 6.4 images/s over steps 2..10 (first step excluded: planning and warm-up)

and a tqdm bar on stderr when stderr is a terminal. Data loading is not timed.

``--checkpoint DIR``: if ``DIR`` holds a checkpoint written by ``nowdl run`` the run resumes from
it (weights, optimizer state, RNG state, the plan it ran with and the step number, which rank 0
keeps in ``DIR/nowdl-run.json``) and runs ``--steps`` MORE steps, numbered on from there; after
the last step it saves again. ``DIR`` must be visible to every rank (a shared filesystem when the
job spans nodes).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from nowdl.errors import NowdlError
from nowdl.units import parse_parts

__all__ = [
    "add_run_arguments",
    "run_main",
    "SyntheticData",
    "ImageFolderData",
    "output_shape",
    "RUN_STATE",
    "PLAN_FILE",
]

#: File in ``--checkpoint DIR`` holding the step number (written by rank 0).
RUN_STATE = "nowdl-run.json"
#: File in ``--checkpoint DIR`` holding the plan the run used (reused on resume).
PLAN_FILE = "plan.json"
_RUN_FORMAT = "nowdl.run"

_IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".tif", ".tiff")
_ARRAY_EXTS = (".npy",)
_PRECISIONS = ("fp32", "bf16", "fp16")
_OPTIMIZERS = ("adam", "adamw", "sgd", "momentum")


# ---- command line --------------------------------------------------------------------------------
def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Add the options of ``nowdl run`` to ``p``."""
    p.add_argument("model", metavar="MODEL|PLAN.json",
                   help="built-in model name, package.module:callable, or a plan JSON saved by `nowdl plan --out`")
    p.add_argument("--model-args", metavar="JSON", help="keyword arguments for the model, as a JSON object")
    p.add_argument("--input", metavar="CxHxW",
                   help="ONE sample's shape, without the batch dimension, e.g. 3x1024x1024 "
                   "(default: the built-in model's or the plan's)")
    p.add_argument("--steps", type=int, required=True, help="optimizer (or inference) steps to run")
    p.add_argument("--batch-size", type=int, help="GLOBAL batch per step = micro-batch (1 sample when planning) "
                   "x micro-batches x replicas x dp (default with a plan: the plan's)")
    p.add_argument("--micro-batches", type=int, help="pin micro-batches per step")
    p.add_argument("--stages", type=int, help="pin the number of pipeline stages")
    p.add_argument("--dp", type=int, help="pin the data-parallel degree")
    p.add_argument("--replicas", type=int, choices=(1, 2), help="pin replicas (2: GEMS-MASTER mirrored replica)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), help="pin the pipeline schedule")
    p.add_argument("--spatial-parts", type=parse_parts, metavar="P[,P2..]",
                   help="pin spatial parts (image tiles) per spatial stage: 4, or one per stage: 4,2 (1: none)")
    p.add_argument("--spatial-stages", type=int, help="pin how many leading stages are spatial")
    p.add_argument("--slice", choices=("vertical", "horizontal", "square", "depth", "cube"), help="tile shape")
    p.add_argument("--halo-fusion", default="auto", metavar="auto|off|N",
                   help="fuse conv/pool runs into one deeper halo exchange (auto, off, or up to N per exchange)")
    p.add_argument("--balance", choices=("memory", "compute"), default="memory",
                   help="what the planner balances (default memory)")
    p.add_argument("--num-classes", type=int, metavar="C",
                   help="label classes (default: the model's output channels; built-in models are built "
                   "with it unless --model-args says otherwise)")
    p.add_argument("--data", default="synthetic", metavar="synthetic|imagefolder:PATH",
                   help="synthetic (seeded random, default) or imagefolder:PATH (PATH/<class>/<image or .npy>)")
    p.add_argument("--eval", action="store_true", help="inference steps (eval_step) instead of training")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--optimizer", choices=_OPTIMIZERS, default="adam",
                   help="adam (default), adamw, sgd, or momentum (SGD with momentum 0.9)")
    p.add_argument("--precision", choices=_PRECISIONS, default="fp32", help="numeric precision (default fp32)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="resume from DIR if it holds a checkpoint; save there after the last step")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds any rank waits for a peer before failing, naming it (default 300)")
    p.add_argument("--gpu-memory", metavar="SIZE", help="per-GPU memory cap for planning, e.g. 80GiB")
    p.add_argument("--device-spec", help="device spec the planner estimates with (default h100)")
    p.add_argument("-v", "--verbose", action="store_true", help="log what nowdl does")


# ---- data ----------------------------------------------------------------------------------------
class Batches(Protocol):
    """A source of global batches: the same ``(x, y)`` for the same step on every rank."""

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))


@dataclass
class SyntheticData:
    """Seeded random images (standard normal) and integer labels, a function of (seed, step).

    ``label_shape`` is ``()`` for classification, the output's spatial shape for segmentation.
    """

    sample_shape: tuple[int, ...]
    label_shape: tuple[int, ...]
    num_classes: int
    seed: int = 0

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(self.seed, step)
        x = torch.randn((batch_size, *self.sample_shape), generator=g)
        y = torch.randint(0, self.num_classes, (batch_size, *self.label_shape), generator=g)
        return x, y


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        return None
    return Image


class ImageFolderData:
    """``root/<class>/<file>`` samples with the class index as label, resized to ``sample_shape``.

    Raises:
        NowdlError: the folder is missing or has no class subfolders or no samples, a sample has
            the wrong channel count, or image files need Pillow and it is not installed.
    """

    def __init__(self, root: str | os.PathLike[str], sample_shape: Sequence[int], seed: int = 0) -> None:
        self.root = Path(root)
        self.sample_shape = tuple(int(d) for d in sample_shape)
        self.seed = seed
        layout = f"lay it out as {self.root}/<class name>/<sample> (one subfolder per class)"
        if not self.root.exists():
            raise NowdlError(f"--data imagefolder:{self.root}: the folder does not exist; {layout}")
        if not self.root.is_dir():
            raise NowdlError(f"--data imagefolder:{self.root} is not a folder; {layout}")
        self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if not self.classes:
            raise NowdlError(f"--data imagefolder:{self.root} has no class subfolders; {layout}")
        exts = _IMAGE_EXTS + _ARRAY_EXTS
        self.samples: list[tuple[Path, int]] = []
        for label, name in enumerate(self.classes):
            files = sorted(f for f in (self.root / name).rglob("*")
                           if f.is_file() and f.suffix.lower() in exts and not f.name.startswith("."))
            self.samples.extend((f, label) for f in files)
        if not self.samples:
            raise NowdlError(f"--data imagefolder:{self.root}: no {'/'.join(exts)} files in its class subfolders "
                             f"({', '.join(self.classes[:5])}{', ...' if len(self.classes) > 5 else ''}); {layout}")
        images = [f for f, _ in self.samples if f.suffix.lower() in _IMAGE_EXTS]
        if images and _pil() is None:
            raise NowdlError(
                f"--data imagefolder:{self.root} holds image files (e.g. {images[0]}) but Pillow is not "
                "installed: `pip install pillow` (nowdl does not depend on it), or convert the images "
                "to .npy arrays shaped (C, H, W)"
            )
        if images and len(self.sample_shape) != 3:
            raise NowdlError(f"image files are 2D but --input {'x'.join(map(str, self.sample_shape))} is not "
                             "CxHxW: use .npy arrays (C, D, H, W) for 3D models")
        self.sample(0)  # fail now, not mid-run, on a sample of the wrong shape

    def __len__(self) -> int:
        return len(self.samples)

    def sample(self, index: int) -> torch.Tensor:
        """Sample ``index`` as a float tensor shaped ``sample_shape`` in ``[0, 1]`` (uint8 inputs)."""
        path, _ = self.samples[index]
        t = _load_array(path) if path.suffix.lower() in _ARRAY_EXTS else _load_image(path, self.sample_shape[0])
        c, spatial = self.sample_shape[0], self.sample_shape[1:]
        if t.ndim == len(spatial):
            t = t.unsqueeze(0)
        if t.ndim != len(self.sample_shape) or t.shape[0] != c:
            raise NowdlError(f"{path} has shape {tuple(t.shape)} but --input is {'x'.join(map(str, self.sample_shape))} "
                             f"(channels first): store samples as ({c}, {', '.join('..' for _ in spatial)})")
        return _fit(t, spatial)

    def _order(self, epoch: int) -> list[int]:
        return torch.randperm(len(self.samples), generator=_generator(self.seed, -1 - epoch)).tolist()

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.samples)
        xs, ys = [], []
        orders: dict[int, list[int]] = {}
        for k in range(step * batch_size, (step + 1) * batch_size):
            epoch, pos = divmod(k, n)
            if epoch not in orders:
                orders[epoch] = self._order(epoch)
            idx = orders[epoch][pos]
            xs.append(self.sample(idx))
            ys.append(self.samples[idx][1])
        return torch.stack(xs), torch.tensor(ys, dtype=torch.long)


def _scaled(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t.float() / 255.0
    if t.dtype == torch.bool:
        return t.float()
    return t.float()


def _load_array(path: Path) -> torch.Tensor:
    import numpy as np

    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise NowdlError(f"cannot read {path} as a .npy array: {e}") from None
    return _scaled(torch.from_numpy(np.ascontiguousarray(arr)))


def _load_image(path: Path, channels: int) -> torch.Tensor:
    import numpy as np

    image_mod = _pil()
    modes = {1: "L", 3: "RGB", 4: "RGBA"}
    if channels not in modes:
        raise NowdlError(f"{path}: images give 1, 3 or 4 channels but --input has {channels}: use .npy arrays")
    try:
        with image_mod.open(path) as img:
            arr = np.asarray(img.convert(modes[channels]))
    except OSError as e:
        raise NowdlError(f"cannot read {path} as an image: {e}") from None
    t = torch.from_numpy(np.ascontiguousarray(arr))
    t = t.unsqueeze(0) if t.ndim == 2 else t.permute(2, 0, 1)
    return _scaled(t)


def _fit(t: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """Resize ``t`` (C, *spatial) so it covers ``size`` keeping its aspect, then centre-crop to it."""
    have = tuple(t.shape[1:])
    if have != tuple(size):
        scale = max(s / h for s, h in zip(size, have, strict=True))
        new = [max(s, round(h * scale)) for s, h in zip(size, have, strict=True)]
        if new != list(have):
            mode = {1: "linear", 2: "bilinear", 3: "trilinear"}.get(len(size), "nearest")
            kw: dict[str, Any] = {} if mode == "nearest" else {"align_corners": False}
            t = nn.functional.interpolate(t.unsqueeze(0), size=new, mode=mode, **kw).squeeze(0)
        starts = [(n - s) // 2 for n, s in zip(t.shape[1:], size, strict=True)]
        t = t[(slice(None), *(slice(a, a + s) for a, s in zip(starts, size, strict=True)))]
    return t.contiguous()


# ---- the model -----------------------------------------------------------------------------------
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
class _Source:
    spec: str
    model_args: str | None
    sample_shape: tuple[int, ...]
    plan_path: str | None
    plan_config: dict[str, Any] | None
    plan_batch: int | None


def _is_plan_arg(model: str) -> bool:
    return model.lower().endswith(".json") or (os.path.isfile(model) and ":" not in model)


def _sample_shape(text: str | None, default: Sequence[int] | None, what: str) -> tuple[int, ...]:
    from nowdl.units import parse_shape

    if text is None:
        if default is None:
            raise NowdlError(f"give --input CxHxW (one sample's shape, e.g. --input 3x512x512): {what} has no default input")
        return tuple(default)
    shape = tuple(parse_shape(text))
    if default is not None and len(shape) == len(default) + 1 and shape[0] == 1:
        raise NowdlError(f"--input {text} looks like it has a batch dimension: --input is ONE sample's shape, "
                         f"e.g. {'x'.join(map(str, shape[1:]))} (the batch is --batch-size)")
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


def _source(args: argparse.Namespace, ckpt_plan: str | None) -> _Source:
    """Where the model and the plan come from: MODEL, a plan JSON, or a checkpoint's plan."""
    from nowdl.models import DEFAULT_INPUTS
    from nowdl.partitioner.plan import Plan

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
        default_in = DEFAULT_INPUTS.get(spec)
        shape = _sample_shape(args.input, tuple(default_in[1:]) if default_in else None, spec)
        return _Source(spec, margs, shape, None, None, None)
    plan = Plan.load(where)
    inputs = plan.model.get("inputs") or [[1]]
    default = tuple(int(d) for d in inputs[0][1:])
    c = plan.config
    per = int(inputs[0][0]) * int(c["micro_batches"]) * int(c["replicas"]) * int(c["dp"])
    shape = _sample_shape(args.input, default, where)
    if shape != default:
        raise NowdlError(f"--input {'x'.join(map(str, shape))} differs from the plan's sample shape "
                         f"{'x'.join(map(str, default))} ({where}): drop --input or re-plan")
    return _Source(spec, margs, shape, where, dict(c), per)


def _check_pins(args: argparse.Namespace, config: dict[str, Any], where: str) -> None:
    for opt, key in (("stages", "stages"), ("micro_batches", "micro_batches"), ("dp", "dp"),
                     ("replicas", "replicas"), ("schedule", "schedule")):
        want = getattr(args, opt)
        if want is not None and want != config.get(key):
            flag = "--" + opt.replace("_", "-")
            raise NowdlError(f"{flag} {want} but the plan in {where} has {key} {config.get(key)}: drop {flag} "
                             "(the plan fixes it) or use another plan / --checkpoint directory")


def _optimizer(name: str, lr: float) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
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


# ---- checkpoint state ----------------------------------------------------------------------------
def _read_state(directory: Path) -> dict[str, Any] | None:
    """The run state in ``directory`` (None: no checkpoint there yet)."""
    state_file = directory / RUN_STATE
    if directory.exists() and not directory.is_dir():
        raise NowdlError(f"--checkpoint {directory} is a file, not a folder")
    if not state_file.exists():
        if (directory / "nowdl-checkpoint.json").exists():
            raise NowdlError(f"--checkpoint {directory} holds a checkpoint without {RUN_STATE} (not written by "
                             "`nowdl run`, or interrupted while saving): use another folder")
        return None
    try:
        state = json.loads(state_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise NowdlError(f"cannot read {state_file}: {e}") from None
    if not isinstance(state, dict) or state.get("format") != _RUN_FORMAT or not isinstance(state.get("step"), int):
        raise NowdlError(f"{state_file} is not a `nowdl run` state file")
    if not (directory / PLAN_FILE).exists():
        raise NowdlError(f"--checkpoint {directory} has {RUN_STATE} but no {PLAN_FILE}: use another folder")
    return state


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# ---- main ----------------------------------------------------------------------------------------
def _broadcast(value: Any, world: int) -> Any:
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rate(images: int, secs: float) -> str:
    return f"{images / secs:.1f}" if secs > 0 else "inf"


def run_main(args: argparse.Namespace) -> int:
    """``nowdl run``: returns the exit status (errors are raised as NowdlError)."""
    from nowdl.runtime.launch import init_distributed, launch_env

    env = launch_env()
    if args.steps is None or args.steps < 1:
        raise NowdlError(f"--steps must be a positive integer, got {args.steps}")
    if args.batch_size is not None and args.batch_size < 1:
        raise NowdlError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.num_classes is not None and args.num_classes < 1:
        raise NowdlError(f"--num-classes must be a positive integer, got {args.num_classes}")
    if not args.timeout > 0:
        raise NowdlError(f"--timeout must be positive seconds, got {args.timeout}")
    import nowdl

    compile_params = inspect.signature(nowdl.compile).parameters
    if args.precision != "fp32" and "precision" not in compile_params:
        raise NowdlError(f"--precision {args.precision} is not supported yet: nowdl trains in fp32 for now "
                         "(use --precision fp32)")
    data_kind, _, data_path = str(args.data).partition(":")
    if data_kind not in ("synthetic", "imagefolder") or (data_kind == "imagefolder") != bool(data_path):
        raise NowdlError(f"--data {args.data}: use 'synthetic' or 'imagefolder:PATH' (a folder of class subfolders)")
    optimizer = _optimizer(args.optimizer, args.lr)

    world, rank = env.world_size, env.rank
    initialized_here = False
    if world > 1 and not dist.is_initialized():
        init_distributed(timeout_s=args.timeout)
        initialized_here = True
    try:
        with tempfile.TemporaryDirectory(prefix="nowdl-run-") as tmp:
            return _run(args, rank, world, optimizer, data_kind, data_path, compile_params, Path(tmp))
    finally:
        if initialized_here and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer may be gone; the error that got us here matters more
                pass


def _plan_on_rank0(model: nn.Module, args: argparse.Namespace, rank: int, world: int, batch: int,
                   micro_batch: int, src: _Source, optimizer: Any, progress: bool) -> str:
    """Rank 0 plans one ``micro_batch``-sample micro-batch for a ``batch``-sample step; every rank
    gets the plan JSON (or rank 0's error), through the trainer's ``plan_on_rank0``."""
    import dataclasses

    import nowdl
    from nowdl.runtime.trainer import plan_on_rank0

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


def _job_nodes(world: int) -> tuple[int | None, int | None]:
    """The launched job's (nodes, processes per node) for the planner (torchrun --nnodes, srun)."""
    from nowdl.runtime.nodes import job_topology

    nodes, per = job_topology()
    return (nodes, per) if nodes is not None and per is not None and nodes * per == world else (None, None)


def _run(args: argparse.Namespace, rank: int, world: int,
         optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], data_kind: str, data_path: str,
         compile_params: Any, tmp: Path) -> int:
    import nowdl
    from nowdl.cli import resolve_model

    say = rank == 0
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    state: Any = None
    if ckpt is not None:  # rank 0 decides whether to resume; every rank follows
        try:
            state = {"ok": _read_state(ckpt)} if rank == 0 else None
        except NowdlError as e:
            state = {"error": str(e)}
        state = _broadcast(state, world)
        if "error" in state:
            raise NowdlError(state["error"])
        state = state["ok"]
    resume = state is not None
    assert ckpt is not None or not resume
    src = _source(args, str(ckpt / PLAN_FILE) if resume and ckpt is not None else None)
    if src.plan_config is not None:
        _check_pins(args, src.plan_config, str(src.plan_path))
        if src.plan_config.get("gpus") != world:
            g = src.plan_config.get("gpus")
            raise NowdlError(f"the plan in {src.plan_path} needs {g} ranks but this job has {world}: launch with "
                             f"torchrun --nproc-per-node {g}")
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
    channels, label_shape = out[1], tuple(out[2:])
    data: Batches
    if data_kind == "imagefolder":
        folder = ImageFolderData(data_path, src.sample_shape, seed=args.seed)
        if label_shape and not args.eval:
            raise NowdlError(f"{name} has dense outputs {out} (segmentation) but imagefolder gives one label per "
                             "image: train it with --data synthetic, or use --eval")
        classes = len(folder.classes)
        if classes > channels:
            raise NowdlError(f"{data_path} has {classes} classes but {name} outputs {channels}: build it with "
                             f"num_classes={classes} (--model-args / --num-classes)")
        data = folder
    else:
        classes = args.num_classes if args.num_classes is not None else channels
        if classes > channels:
            raise NowdlError(f"--num-classes {classes} but {name} outputs {channels} classes: build it with more "
                             f"(--model-args '{{\"num_classes\": {classes}}}')")
        data = SyntheticData(src.sample_shape, label_shape, classes, seed=args.seed)

    progress = say and sys.stderr.isatty()
    extra: dict[str, Any] = {}
    if "precision" in compile_params:
        extra["precision"] = args.precision
    common: dict[str, Any] = dict(optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(), progress=progress,
                                  timeout_s=args.timeout, **extra)
    start = int(state["step"]) if resume and not args.eval else 0
    total = start + args.steps
    if say:
        what = "inference" if args.eval else f"training ({args.optimizer}, lr {args.lr:g})"
        print(f"nowdl run: {name} on {world} rank{'s' if world > 1 else ''}, global batch {batch} of "
              f"{'x'.join(map(str, src.sample_shape))}, {data_kind} data, {what}", flush=True)
    t_plan = time.perf_counter()
    plan_path = src.plan_path
    if plan_path is None:  # rank 0 plans, every rank runs what it planned
        plan_path = str(tmp / PLAN_FILE)
        text = _plan_on_rank0(model, args, rank, world, batch, micro_batch, src, optimizer, progress)
        Path(plan_path).write_text(text)
    cm = nowdl.compile(model, plan=plan_path, **common)
    if resume and ckpt is not None:
        x0, _ = data.batch(start, batch)
        cm.load_checkpoint(ckpt, x0)
        if say:
            what = "loaded the weights of" if args.eval else "resumed from"
            print(f"{what} {ckpt} at step {state['step']}", flush=True)
    setup_s = time.perf_counter() - t_plan  # counted in the first step, as when the trainer plans

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

    times: list[float] = []
    try:
        for step in range(start, total):
            x, y = data.batch(step, batch)
            t0 = time.perf_counter()
            if args.eval:
                cm.eval_step(x)
                if world > 1:
                    dist.barrier()
                loss_text = ""
            else:
                loss = cm.train_step(x, y)
                loss_text = f"  loss {loss:.4f}"
            dt = time.perf_counter() - t0 + (setup_s if step == start else 0.0)
            times.append(dt)
            if step == start:
                emit(_plan_line(cm))
            emit(f"step {step + 1}/{total}{loss_text}  {dt:.2f} s  {_rate(batch, dt)} images/s")
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if len(times) > 1:
        emit(f"mean: {_rate(batch * (len(times) - 1), sum(times[1:]))} images/s over steps "
             f"{start + 2}..{total} (first step excluded: planning and warm-up)")
    else:
        emit(f"mean: {_rate(batch, times[0])} images/s over step {total} (the only step: includes planning "
             "and warm-up)")

    if ckpt is not None and not args.eval:
        cm.save_checkpoint(ckpt)
        if rank == 0:
            plan = _current_plan(cm)
            if plan is not None:
                if not isinstance(plan.model.get("source"), dict):  # so `nowdl run DIR/plan.json` works too
                    plan.model["source"] = {"spec": src.spec, "args": json.loads(src.model_args or "{}")}
                plan.save(ckpt / PLAN_FILE)
            _write_json(ckpt / RUN_STATE, {"format": _RUN_FORMAT, "step": total, "model": src.spec,
                                            "batch_size": batch, "seed": args.seed, "data": args.data})
        if world > 1:
            dist.barrier()
        emit(f"saved checkpoint at step {total} to {ckpt}")
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
