"""What a run leaves for use without nowdl: ``nowdl export`` (a checkpoint's weights as a plain
PyTorch state_dict) and ``nowdl codegen`` (a plan's stages as Python sources).

``nowdl export CKPT_DIR --out weights.pt``: the checkpoint (any plan, any number of ranks: its
tensors are stored under the model's own names, docs/checkpoints.md) is read in this one process. The model is rebuilt from what the
checkpoint records (``nowdl run``'s model and ``--model-args``; ``--model`` / ``--model-args``
override or supply them), the weights are loaded into it with ``strict=True`` (a checkpoint of
another model is refused, naming the keys), and its ``state_dict()`` (the model's key order)
is saved with ``torch.save``: ``model.load_state_dict(torch.load("weights.pt"))`` then works
on the plain model. The file is written under a temporary name and renamed when complete; an
existing ``--out`` is refused unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from nowdl.errors import NowdlError

__all__ = ["add_export_parser", "export_command", "checkpoint_state_dict", "codegen_command"]


def add_export_parser(sub: Any) -> None:
    """Register ``nowdl export`` on the sub-command parser ``sub``."""
    p = sub.add_parser("export", help="write a checkpoint's weights as a plain state_dict (.pt)",
                       description="Read the latest checkpoint in CKPT_DIR (saved by any plan) and write the "
                       "model's weights, under its own parameter names, as a torch.save'd state_dict that "
                       "loads into the plain model with strict=True.")
    p.add_argument("checkpoint", metavar="CKPT_DIR", help="a --checkpoint folder of nowdl run (or cm.save_checkpoint)")
    p.add_argument("--out", metavar="FILE", required=True, help="where to write the state_dict (e.g. weights.pt)")
    p.add_argument("--model", metavar="MODEL", help="the model (default: the one the checkpoint records)")
    p.add_argument("--model-args", metavar="JSON", help="keyword arguments for --model, as a JSON object")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("-v", "--verbose", action="store_true", help="log what nowdl does")


def _model_source(record: dict[str, Any], model: str | None, model_args: str | None) -> tuple[str, str | None]:
    got = record.get("run")
    run: dict[str, Any] = got if isinstance(got, dict) else {}
    src = (record.get("plan") or {}).get("model", {}).get("source")
    spec = model or run.get("model") or (src.get("spec") if isinstance(src, dict) else None)
    if not spec:
        raise NowdlError(f"checkpoint {record.get('dir')} does not record its model: give --model MODEL "
                         "(and --model-args JSON) to rebuild it")
    if model_args is None and model is None:
        args = run.get("model_args") if "model_args" in run else (src.get("args") if isinstance(src, dict) else None)
        model_args = json.dumps(args) if args else None
    return str(spec), model_args


def checkpoint_state_dict(directory: str | os.PathLike[str], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the latest checkpoint in ``directory`` loaded into ``model`` (strict):
    ``model.state_dict()``.

    Raises:
        CheckpointError: no checkpoint there, or it is damaged.
        NowdlError: the checkpoint holds another model's weights (names the keys).
    """
    from nowdl.runtime.predict.weights import load_checkpoint_weights
    from nowdl.runtime.training.checkpoint import CheckpointError, open_checkpoint

    ck = open_checkpoint(directory)
    if ck is None:
        raise CheckpointError(f"no checkpoint in {directory}: give a --checkpoint folder of nowdl run that holds one")
    load_checkpoint_weights(model, ck)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def export_command(args: argparse.Namespace) -> int:
    """``nowdl export``: returns the exit status (errors are raised as NowdlError)."""
    from nowdl.models.resolve import resolve_model
    from nowdl.runtime.training.checkpoint import find_checkpoint

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise NowdlError(f"--out {out} already exists: choose another file or pass --overwrite")
    if not out.parent.is_dir():
        raise NowdlError(f"--out {out}: the folder {out.parent} does not exist: create it first")
    record = find_checkpoint(args.checkpoint)
    if record is None:
        raise NowdlError(f"no checkpoint in {args.checkpoint}: give a --checkpoint folder of nowdl run that holds one")
    spec, margs = _model_source(record, args.model, args.model_args)
    model, _, name = resolve_model(spec, margs)
    sd = checkpoint_state_dict(args.checkpoint, model)
    tmp = out.with_name(f".{out.name}.partial")
    try:
        torch.save(sd, tmp)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise NowdlError(f"cannot write {out}: {e.strerror or e}: free space or choose another --out") from None
    n = sum(v.numel() for v in sd.values())
    print(f"saved {out}: {len(sd)} tensors ({n:,} values) of {name} from {record['dir']} (step {record['step']}); "
          f"load with model.load_state_dict(torch.load({str(out)!r}))")
    return 0


def codegen_command(args: argparse.Namespace) -> int:
    """`nowdl codegen`: rebuild the plan's model, check it is the planned one, write the stages."""
    import nowdl
    from nowdl.codegen import build_stages, write_sources
    from nowdl.models.resolve import resolve_model
    from nowdl.trace.tracer import trace

    plan = nowdl.Plan.load(args.plan)
    spec, margs = args.model, args.model_args
    if spec is None:
        src = plan.model.get("source")
        if not isinstance(src, dict) or not isinstance(src.get("spec"), str):
            raise NowdlError(f"{args.plan} does not record how to build its model ({plan.model.get('name', '?')}): "
                             "pass --model MODEL [--model-args JSON], the same as given to `nowdl plan`")
        spec, margs = src["spec"], json.dumps(src.get("args") or {})
    elif margs is None:
        src = plan.model.get("source")
        if isinstance(src, dict) and src.get("spec") == spec:
            margs = json.dumps(src.get("args") or {})
    model, _, _ = resolve_model(spec, margs)
    xs = tuple(torch.empty(shape, device="meta") for shape in plan.model["inputs"])
    traced = trace(model, xs, tracer=str(plan.model.get("tracer", "auto")))
    plan.check_model(traced.fingerprint)
    paths = write_sources(build_stages(traced.gm, plan), plan, args.out)
    print(*paths, sep="\n")
    return 0
