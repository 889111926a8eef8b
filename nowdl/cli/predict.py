"""``nowdl predict``: predict whole slides and volumes with a trained model, into OME-Zarr, TIFF or NIfTI.

Launched like ``nowdl run`` (one process, ``--nproc N`` ranks forked here, or every rank of a torchrun /
srun / mpirun job)::

    nowdl predict unet --nproc 2 --checkpoint ck/ --data openslide:slide.svs --out pred.zarr
    torchrun --nproc-per-node 4 -m nowdl predict unet --checkpoint ck/ --data openslide:slide.svs --out pred.zarr

MODEL is a built-in, ``package.module:callable`` with ``--model-args``, or an inference plan
JSON (``nowdl plan ... --inference``; the model is rebuilt from the plan's recorded source and
the plan run as it is; a training plan is refused). ``--checkpoint``
is a nowdl checkpoint folder (any plan of the model; read by name) or a state_dict file.
Rank 0 makes an inference plan for the window shape (``nowdl.runtime.predict.runner.plan_for``)
and broadcasts it; each rank reads only its tile of each window, and the ranks of the last stage write
their share of it. Rank 0 prints a progress bar on a terminal and one summary line; errors are
one paragraph and exit status 2, with nothing left under OUT (see docs/predict.md). The pixels are
normalised as the model was trained: ``--normalize``, else what the ``nowdl run`` checkpoint records.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from nowdl.errors import NowdlError
from nowdl.runtime.launch.local import add_nproc_argument

__all__ = ["add_predict_parser", "predict_main"]


def add_predict_parser(sub: Any) -> None:
    """Register ``nowdl predict`` on the subparsers ``sub``."""
    p = sub.add_parser("predict", help="predict whole slides and volumes into OME-Zarr, TIFF or NIfTI",
                       description="Predict every image of --data with MODEL's weights from --checkpoint, in "
                       "windows whose centres are exact, and write --out. Launch with torchrun (or srun, mpirun) "
                       "for several ranks.")
    p.add_argument("model", metavar="MODEL|PLAN.json", help="built-in model name, package.module:callable, or an inference plan JSON")
    p.add_argument("--model-args", metavar="JSON", help="keyword arguments for the model, as a JSON object")
    p.add_argument("--checkpoint", required=True, metavar="DIR|FILE",
                   help="a nowdl checkpoint folder (any plan of this model) or a state_dict file")
    p.add_argument("--data", required=True, metavar="SOURCE",
                   help="tiff:PATH, zarr:PATH[:ARRAY], h5:PATH:DATASET, openslide:PATH, nifti:PATH or geotiff:PATH "
                   "(a file or a folder of them)")
    p.add_argument("--out", required=True, metavar="OUT",
                   help="OUT.zarr (OME-Zarr), OUT.tif (pyramidal TIFF; a Cloud-Optimized GeoTIFF from geotiff:), "
                   "OUT.nii.gz (NIfTI), or a folder for several images")
    p.add_argument("--output", choices=("logits", "probabilities", "argmax"), default="logits",
                   help="what to write per pixel (default logits)")
    p.add_argument("--normalize", metavar="mean=M,..,std=S,..",
                   help="per-band normalisation the model was trained with (default: the one the --checkpoint "
                   "of nowdl run records, else none)")
    p.add_argument("--level", type=int, help="pyramid level of a tiff: or openslide: source (0 = full size)")
    p.add_argument("--window", metavar="SIZE", help="window per spatial dim, e.g. 2048 or 1024x1024 (default: the "
                   "plan's input, else the whole image up to 2048 per dim in 2D, 128 in 3D)")
    p.add_argument("--format", choices=("zarr", "tif", "nii.gz"), help="output format when --out is a folder")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32", help="autocast of the forward")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT (once the new one is complete)")
    p.add_argument("--stages", type=int, help="pin the pipeline stages of the plan")
    p.add_argument("--spatial-parts", type=int, help="pin the tiles of the spatial stages")
    p.add_argument("--slice", choices=("vertical", "horizontal", "square", "depth", "cube"), help="pin the tile shape")
    p.add_argument("--device-spec", help="v100, a100, h100, h200, cpu or a JSON file (default h100)")
    p.add_argument("--gpu-memory", help="memory cap per rank for the plan, e.g. 80GiB")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits for another (default 300)")
    p.add_argument("--seed", type=int, default=0, help="seed before building the model (default 0)")
    add_nproc_argument(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log what nowdl does")


def _spec(data: str, level: int | None) -> str:
    if level is None:
        return data
    kind = data.partition(":")[0]
    if kind not in ("tiff", "openslide"):
        raise NowdlError(f"--level {level} applies to tiff: and openslide: sources, not {data}")
    if ":level=" in data:
        raise NowdlError(f"--data {data} already names a level: drop --level or the :level= suffix")
    return f"{data}:level={level}"


def _window(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        dims = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise NowdlError(f"--window {text}: give positive pixel counts, e.g. 2048 or 1024x1024")
    return dims


def _build(args: argparse.Namespace, world: int) -> Any:
    """The compiled model with its weights loaded (collective: the checkpoint read)."""
    import nowdl
    from nowdl.models.resolve import resolve_model
    from nowdl.plan.plan import Plan
    from nowdl.plan.purpose import require_inference
    from nowdl.runtime.predict.weights import load_weights
    from nowdl.units import parse_bytes

    plan_path = args.model if args.model.lower().endswith(".json") else None
    spec, margs = args.model, args.model_args
    if plan_path is not None:
        plan = Plan.load(plan_path)
        require_inference(plan, f"the plan {plan_path}")  # before the weights are read
        src = plan.model.get("source")
        if not isinstance(src, dict) or not isinstance(src.get("spec"), str):
            raise NowdlError(f"{plan_path} does not record how to build its model: re-plan with `nowdl plan MODEL ... "
                             "--out PLAN.json`, or give MODEL by name")
        spec, margs = str(src["spec"]), json.dumps(src.get("args") or {})
        if plan.config.get("gpus") != world:
            raise NowdlError(f"the plan {plan_path} needs {plan.config.get('gpus')} ranks but this job has {world}: "
                             f"launch with torchrun --nproc-per-node {plan.config.get('gpus')}")
    torch.manual_seed(args.seed)
    model, _, _ = resolve_model(spec, margs)
    load_weights(model, args.checkpoint)
    model.eval()
    if plan_path is not None:
        return nowdl.compile(model, plan=plan_path, precision=args.precision, progress=False, timeout_s=args.timeout)
    cap = parse_bytes(args.gpu_memory) if args.gpu_memory else None
    return nowdl.compile(model, gpus=world, stages=args.stages, spatial_parts=args.spatial_parts, slice=args.slice,
                         micro_batches=1, replicas=1, dp=1, mode="estimate", device_spec=args.device_spec, optimizer="sgd",
                         gpu_memory=cap, precision=args.precision, progress=False, timeout_s=args.timeout)


def predict_main(args: argparse.Namespace) -> int:
    """Run ``nowdl predict``; returns 0 (errors raise: the CLI prints them and exits 2)."""
    from nowdl.runtime.launch.failure import open_channel
    from nowdl.runtime.launch.group import init_distributed, launch_env
    from nowdl.runtime.launch.lost import report_failure

    env = launch_env()
    if env.world_size > 1:
        init_distributed(timeout_s=args.timeout)
    # the job's failure channel, as `nowdl run` has it: the first error is printed once, and a rank
    # that dies is named by the survivors ([Note: lost ranks] in runtime/launch/failure.py)
    channel = open_channel(env.rank, env.world_size, timeout_s=args.timeout,
                           report=lambda m: print(f"nowdl predict: error: {m}", file=sys.stderr, flush=True))
    try:
        _predict(args, env.rank, env.world_size)
    except Exception as e:
        instead = report_failure(e, env.rank, env.world_size, channel)
        if instead is None:
            raise
        raise instead from e
    finally:
        if channel is not None:
            channel.close()
    if env.world_size > 1:
        torch.distributed.destroy_process_group()
    return 0


def _predict(args: argparse.Namespace, rank: int, world: int) -> None:
    from pathlib import Path

    from nowdl.progress import Progress
    from nowdl.runtime.predict.writers import check_out

    spec = _spec(args.data, args.level)
    window = _window(args.window)
    check_out(Path(args.out), args.overwrite)  # before the weights are read
    normalize = _normalize(args)
    cm = _build(args, world)
    bar = Progress("predicting", enabled=rank == 0, unit="window", min_total=2)
    try:
        summary = cm.predict(spec, args.out, output=args.output, window=window, overwrite=args.overwrite,
                             format=args.format, on_window=bar.update, normalize=normalize)
    finally:
        bar.close()
    if rank == 0:
        for note in summary.notes:
            print(note)
        print(summary.line())
        print(f"wrote {args.out}")
        sys.stdout.flush()


def _normalize(args: argparse.Namespace) -> Any:
    """``--normalize`` (parsed), else the normalisation the ``nowdl run`` checkpoint records, else None."""
    from pathlib import Path

    from nowdl.runtime.data.pixels import Normalize, parse_normalize
    from nowdl.runtime.training.checkpoint import find_checkpoint

    given = parse_normalize(args.normalize)
    if given == "auto":
        raise NowdlError("nowdl predict --normalize auto: predict normalises as the model was trained; give the "
                         "mean=...,std=... that nowdl run printed, or a --checkpoint of nowdl run, which records it")
    if given is not None or not Path(args.checkpoint).is_dir():
        return given
    record = find_checkpoint(args.checkpoint)
    run = record.get("run") if record is not None else None
    if isinstance(run, dict) and run.get("normalize") is not None:
        return Normalize.from_json(run["normalize"], f"--checkpoint {args.checkpoint}")
    return None
