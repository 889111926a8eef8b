"""The nowdl command line: profile | plan | show | codegen | run | predict | calibrate | report | export."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import NoReturn

import torch

from nowdl.cli.export import add_export_parser, codegen_command
from nowdl.cli.inputs import example_inputs
from nowdl.cli.levers import add_lever_arguments, format_levers, lever_kwargs
from nowdl.errors import NowdlError, ReportedError, error_text
from nowdl.models.resolve import resolve_model
from nowdl.plan.allocator import format_allocator
from nowdl.profiler.table import print_profile
from nowdl.units import parse_bytes, parse_parts

__all__ = ["main", "resolve_model"]

_EPILOG_MODEL = (
    "MODEL is a built-in name (see `nowdl models`) or 'package.module:callable' "
    "called with --model-args, e.g. monai.networks.nets:UNet --model-args "
    "'{\"spatial_dims\": 2, \"in_channels\": 1, \"out_channels\": 2, \"channels\": [16, 32, 64], \"strides\": [2, 2]}'"
)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="built-in model name or package.module:callable")
    p.add_argument("--model-args", metavar="JSON", help="keyword arguments for the model, as a JSON object")
    p.add_argument("--input", metavar="SHAPE", action="append",
                   help="the whole input of one micro-batch, batch first: NxCxHxW, e.g. 1x3x2048x2048 (default: "
                   "the built-in model's); give it once per forward() argument for a model that takes several")
    p.add_argument("--mode", choices=("auto", "estimate", "measure"), default="auto",
                   help="estimate: shapes/FLOPs on meta tensors, times from --device-spec (nothing allocated); "
                   "measure: real tensors node by node; auto: measure on CUDA, else estimate (default)")
    p.add_argument("--device", help="device for --mode measure (default: cuda if available, else cpu)")
    p.add_argument("--device-spec", help="v100, a100, h100, h200, cpu or a JSON file (default: h100 when estimating)")
    p.add_argument("--optimizer", default="adam", choices=("sgd", "momentum", "adam", "adamw"),
                   help="optimizer whose state memory is counted (default: adam)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the profile cache")
    p.add_argument("-v", "--verbose", action="store_true", help="log what nowdl does")


def _parser() -> argparse.ArgumentParser:
    from nowdl import __version__

    ap = _Parser(prog="nowdl", description="Plan pipeline, spatial and data parallelism for CNNs on very large images.")
    ap.add_argument("--version", action="version", version=f"nowdl {__version__} (torch {torch.__version__})")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.add_parser("models", help="list the built-in models and their default inputs",
                   description="List the built-in model names MODEL accepts, with their default input shapes.")

    pp = sub.add_parser("plan", help="plan MODEL for N GPUs and print the plan", epilog=_EPILOG_MODEL,
                        description="Trace, profile and partition MODEL; print the plan (and save it with --out).")
    _add_model_args(pp)
    pp.add_argument("--gpus", type=int, required=True, help="total number of GPUs (ranks)")
    pp.add_argument("--balance", choices=("memory", "compute"), default="memory",
                    help="minimise the largest per-GPU peak memory (default) or the slowest stage's time")
    pp.add_argument("--gpu-memory", metavar="SIZE", help="per-GPU memory cap, e.g. 80GiB (default: the device spec's memory)")
    pp.add_argument("--stages", type=int, help="pin the number of pipeline stages")
    pp.add_argument("--micro-batches", type=int, help="pin micro-batches per step")
    pp.add_argument("--batch-size", type=int, help="the GLOBAL batch per step; the planner splits it into micro-batches "
                    "x replicas x dp x samples per micro-batch (default: --input is one micro-batch and the plan "
                    "says which global batch it chose)")
    pp.add_argument("--tiles-per-gpu", default="auto", metavar="auto|N",
                    help="tiles each GPU of a spatial stage runs one after another (auto: the planner chooses; "
                    "1: never)")
    pp.add_argument("--schedule", choices=("1f1b", "gpipe", "zb"),
                    help="pin the pipeline schedule (default 1f1b; zb: zero bubble, ZB-H1)")
    pp.add_argument("--spatial-parts", type=parse_parts, metavar="P[,P2..]",
                    help="pin the spatial parts P of each spatial stage (4), or of each in order (4,2)")
    pp.add_argument("--halo-fusion", default="auto", metavar="auto|off|N",
                    help="fuse runs of convs/pools into one deeper halo exchange: where the cost model says it "
                         "is faster (auto, default), never (off), or up to N per exchange")
    pp.add_argument("--spatial-stages", type=int, help="pin how many leading stages are spatial (UNets: mirrored at the end too)")
    pp.add_argument("--slice", choices=("vertical", "horizontal", "square", "depth", "cube"), help="tile shape (default square)")
    pp.add_argument("--replicas", type=int, choices=(1, 2), help="2: GEMS-MASTER mirrored second replica")
    pp.add_argument("--dp", type=int, help="pin the data-parallel degree")
    pp.add_argument("--nodes", type=int, help="cluster nodes; nodes x --gpus-per-node must equal --gpus "
                    "(default: the device spec's node, e.g. 8-GPU DGX H100 nodes for h100, when it divides --gpus)")
    pp.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the device spec's node, else all on one)")
    pp.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                    help="plan for mixed-precision training: activations and sent tensors at that width (autocast), "
                         "weights, gradients and optimizer state in float32 (default fp32)")
    pp.add_argument("--inference", action="store_true", help="plan a forward-only run (no gradients, optimizer or saved activations)")
    pp.add_argument("--time-limit", type=float, default=None, help="seconds planning may take end to end; the MILP, for graphs too wide for the exact DP, "
                    "improves the anytime split with what tracing and profiling leave (default: no MILP, the anytime split)")
    pp.add_argument("--exact", action="store_true", help="prove the split with the MILP (within --mip-gap; "
                    "--time-limit or 600 s)")
    pp.add_argument("--mip-gap", type=float, default=0.01, help="the MILP stops once its split is proven within "
                    "this relative gap of the optimum; the plan records the gap reached (default 0.01; 0: exact)")
    add_lever_arguments(pp, plan=True)
    pp.add_argument("--out", metavar="FILE", help="save the plan JSON here")
    pp.add_argument("--json", action="store_true", help="print the plan JSON instead of the table")
    pp.add_argument("--plot", metavar="FILE", help="also draw the plan (memory per rank, schedule, stage graph) "
                    "into FILE (.png, .svg or .pdf; needs pip install 'nowdl[plot]')")

    pc = sub.add_parser("codegen", help="write each stage of a saved plan as Python", epilog=_EPILOG_MODEL,
                        description="Rebuild the plan's model, cut it into the plan's stages and write "
                        "stage_<i>.py (and README.txt: which rank runs which file) into --out.")
    pc.add_argument("plan", metavar="PLAN.json")
    pc.add_argument("--out", metavar="DIR", required=True, help="folder for stage_<i>.py and README.txt")
    pc.add_argument("--model", metavar="MODEL", help="the plan's model (default: the one `nowdl plan` recorded in it)")
    pc.add_argument("--model-args", metavar="JSON", help="keyword arguments for --model, as a JSON object")

    pr = sub.add_parser("profile", help="print per-node costs of MODEL", epilog=_EPILOG_MODEL,
                        description="Trace and profile MODEL on one micro-batch; print the costliest nodes.")
    _add_model_args(pr)
    pr.add_argument("--top", type=int, default=20, help="how many nodes to print (0: all; default 20)")
    pr.add_argument("--sort", default="time", choices=("time", "flops", "act", "saved", "params", "out", "order"),
                    help="sort key (default time = fwd + bwd)")
    pr.add_argument("--out", metavar="FILE", help="save the profile JSON here")

    from nowdl.cli.runspec import add_run_arguments

    prun = sub.add_parser("run", help="train (or evaluate) MODEL on synthetic, image-folder, large-image or Dataset data",
                          epilog=_EPILOG_MODEL + ". Launch with torchrun --nproc-per-node N -m nowdl run ...",
                          description="Plan (or load a plan), then train or run inference for --steps steps on "
                          "every rank of the job; rank 0 prints the loss and images/s of each step.")
    add_run_arguments(prun)
    from nowdl.cli.predict import add_predict_parser

    add_predict_parser(sub)

    ps = sub.add_parser("show", help="print a saved plan", description="Validate and print a saved plan JSON file.")
    ps.add_argument("plan", metavar="PLAN.json")
    ps.add_argument("--nodes", action="store_true", help="list every stage's nodes")
    ps.add_argument("--schedule", action="store_true",
                    help="after the plan, draw its pipeline schedule (ranks x time steps)")
    ps.add_argument("--plot", metavar="FILE", help="draw the plan (memory per rank, schedule, stage graph) into "
                    "FILE (.png, .svg or .pdf; needs pip install 'nowdl[plot]'); see docs/pictures.md")

    pk = sub.add_parser("calibrate", help="measure links and compute here; write a device spec JSON",
                        description="Measure point-to-point latency and bandwidth and the all-reduce between "
                        "--ranks local processes (or the ranks of a torchrun job), and per-op compute rates on "
                        "this device; write a device spec for --device-spec FILE (docs/calibrate.md).")
    pk.add_argument("--out", metavar="FILE", default="device-spec.json", help="where to write (default device-spec.json)")
    pk.add_argument("--ranks", type=int, default=2, help="local processes to spawn (default 2; ignored under torchrun)")
    pk.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with that many CUDA devices, else gloo")
    pk.add_argument("--threads", type=int, help="CPU threads for the compute measurement (default 1, as torchrun gives a rank)")
    pk.add_argument("--repeats", type=int, help="timed repeats per measurement (default: 7 links / 3 ops with --quick)")
    pk.add_argument("--quick", action="store_true", help="fewer sizes, smaller ops (about 15 s on 2 CPU cores)")
    pk.add_argument("-v", "--verbose", action="store_true", help="log what nowdl does")

    pg = sub.add_parser("report", help="summarise (and draw) the metrics log of `nowdl run --log-dir DIR`",
                        description="Read DIR/metrics.jsonl; print steps, images/s, loss and measured against "
                        "predicted peak memory per rank.")
    pg.add_argument("dir", metavar="DIR", help="the --log-dir of a `nowdl run`")
    pg.add_argument("--plot", metavar="FILE", help="draw loss per step and peak memory per rank into FILE "
                    "(.png, .svg or .pdf; needs pip install 'nowdl[plot]')")
    add_export_parser(sub)
    return ap


def _job() -> tuple[int, int]:
    """This process's rank and world size as its launcher describes them ((0, 1) when alone or unreadable)."""
    from nowdl.runtime.launch.group import launch_env

    with contextlib.suppress(NowdlError):
        env = launch_env()
        return env.rank, env.world_size
    return 0, 1


def _rank() -> int:
    return _job()[0]


_QUIET_EXIT_S = 3.0  # seconds a rank other than 0 waits before exiting on an error every rank hit alike


class _Parser(argparse.ArgumentParser):
    """argparse with errors in nowdl's form: one line, on rank 0 only, exit 2."""

    def error(self, message: str) -> NoReturn:
        if _rank() == 0:
            print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        _let_rank0_speak()
        sys.exit(2)


def _say_error(command: str, e: BaseException, verbose: bool) -> None:
    """Print ``e`` as one paragraph (rank 0 only): the message first, details with -v."""
    if _rank() != 0:
        return
    print(f"nowdl {command}: error: {error_text(e)}", file=sys.stderr)
    if verbose:
        detail = getattr(e, "detail", "") or "".join(traceback.format_exception(e))
        print(detail, file=sys.stderr)


def _let_rank0_speak() -> None:
    """On ranks other than 0 of a launched job, wait a moment before exiting with an error that
    every rank hit alike (a bad option), so the launcher does not kill rank 0 before it prints."""
    rank, world = _job()
    if rank != 0 and world > 1:
        time.sleep(_QUIET_EXIT_S)


#: the modules each command's ranks import anyway, imported once before ``--nproc`` forks them
_RANK_MODULES = {"run": ("nowdl.cli.run", "nowdl.runtime.training.trainer", "nowdl.runtime.pipeline", "nowdl.compiled"),
                 "predict": ("nowdl.runtime.predict.runner", "nowdl.runtime.predict.writers", "nowdl.compiled")}


def _launch_here(args: argparse.Namespace, argv: Sequence[str], exit_now: bool) -> int:
    """``--nproc N``: import what the ranks need once, then fork them ([Note: local launcher])."""
    from nowdl.runtime.launch.local import fork_ranks, preload, without_nproc

    preload((*_RANK_MODULES.get(args.command, ()), "torch.distributed"), args.model)
    return fork_ranks(int(args.nproc), functools.partial(main, without_nproc(argv)), exit_now=exit_now)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `nowdl` console script; returns the exit status (2 on any error). A rank
    of a launched job exits here, skipping finalization (runtime/launch/group_exit.py)."""
    rc = _main(argv)
    if argv is None and _job()[1] > 1:
        from nowdl.runtime.launch.group_exit import exit_rank

        exit_rank(rc)
    return rc


def _main(argv: Sequence[str] | None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 2
    verbose = bool(getattr(args, "verbose", False))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format=f"nowdl[rank {_rank()}]: %(name)s: %(message)s")
    logging.captureWarnings(_rank() != 0)  # other ranks' Python warnings say which rank printed them
    try:
        if getattr(args, "nproc", None) is not None:  # [Note: local launcher]
            return _launch_here(args, sys.argv[1:] if argv is None else argv, exit_now=argv is None)
        rc = _run(args)
        sys.stdout.flush()  # inside the try: a closed pipe shows here, not at exit
        return rc
    except BrokenPipeError:  # `nowdl show PLAN | head`: the reader took what it wanted
        with contextlib.suppress(OSError, ValueError, AttributeError):  # stdout may be no file (tests)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's last flush goes nowhere
        return 0
    except ReportedError:  # printed once for the whole job (runtime/launch/failure.py)
        return 2
    except KeyboardInterrupt:  # before `nowdl run`'s steps (StopSignal handles them), or any other command
        if _rank() == 0:
            end = " before a step finished: nothing saved; run the same command to start again" if args.command == "run" else ""
            print(f"nowdl {args.command}: interrupted{end}", file=sys.stderr, flush=True)
        return 130
    except Exception as e:
        _say_error(args.command, e, verbose)
        _let_rank0_speak()
        return 2


def _run(args: argparse.Namespace) -> int:
    import nowdl

    if args.command == "show":
        plan = nowdl.Plan.load(args.plan)
        if args.plot:
            from nowdl.cli.pictures import check_plot

            check_plot(args.plot)
        print(plan)
        print(format_levers(plan) or "levers: none (no stage recomputes or offloads)")
        if alloc := format_allocator(plan):  # [Note: allocator reserve]
            print(alloc)
        from nowdl.plan.purpose import format_whole_image_ops

        if whole := format_whole_image_ops(plan):
            print(whole)
        if args.nodes:
            for s in plan.stages:
                print(f"stage {s.index}: {' '.join(s.nodes)}")
        from nowdl.partitioner.costs.traffic import format_node_map

        print(format_node_map(plan))
        if args.schedule:
            from nowdl.schedule import format_plan_schedule

            print()
            print(format_plan_schedule(plan))
        if args.plot:
            from nowdl.cli.pictures import draw_plan

            draw_plan(plan, args.plot)
        return 0
    if args.command == "report":
        from nowdl.cli.pictures import report_command

        return report_command(args.dir, args.plot)
    if args.command == "models":
        from nowdl.models import DEFAULT_INPUTS, MODELS

        for name in sorted(MODELS):
            shape = DEFAULT_INPUTS.get(name)
            doc = (MODELS[name].__doc__ or "").strip().splitlines()
            print(f"{name:<12} input {'x'.join(map(str, shape)) if shape else '-':<16} {doc[0] if doc else ''}")
        print("or any 'package.module:callable' returning an nn.Module, e.g. monai.networks.nets:UNet "
              "with --model-args JSON")
        return 0
    if args.command == "codegen":
        return codegen_command(args)
    if args.command == "export":
        from nowdl.cli.export import export_command

        return export_command(args)
    if args.command == "run":
        from nowdl.cli.run import run_main

        return run_main(args)
    if args.command == "predict":
        from nowdl.cli.predict import predict_main

        return predict_main(args)
    if args.command == "calibrate":
        from nowdl.profiler.calibrate.command import calibrate_command
        from nowdl.runtime.launch.group import init_distributed, launch_env

        in_job = launch_env().world_size > 1  # under torchrun: measure the job's own links
        if in_job:
            init_distributed()
        try:
            return calibrate_command(args.out, ranks=args.ranks, backend=args.backend, threads=args.threads,
                                     repeats=args.repeats, quick=args.quick)
        finally:
            if in_job:
                torch.distributed.destroy_process_group()
    model, default, name = resolve_model(args.model, args.model_args)
    cache = not args.no_cache
    if args.command == "profile":
        x = example_inputs(args.input, default, "measure" if args.mode == "measure" else "estimate", model)
        prof = nowdl.profile(model, *x, mode=args.mode, device=args.device, device_spec=args.device_spec,
                             optimizer=args.optimizer, cache=cache)
        print_profile(prof, args.top, args.sort)
        if args.out:
            with open(args.out, "w") as f:
                f.write(prof.to_json())
        return 0
    if args.plot:
        from nowdl.cli.pictures import check_plot

        check_plot(args.plot)
    x = example_inputs(args.input, default, "measure" if args.mode == "measure" else "estimate", model)
    cap = parse_bytes(args.gpu_memory) if args.gpu_memory else None
    cm = nowdl.compile(model, gpus=args.gpus, balance=args.balance, stages=args.stages,
                       micro_batches=args.micro_batches, schedule=args.schedule, replicas=args.replicas,
                       dp=args.dp, spatial_parts=args.spatial_parts, spatial_stages=args.spatial_stages,
                       slice=args.slice, gpu_memory=cap, mode=args.mode, device=args.device,
                       device_spec=args.device_spec, optimizer=args.optimizer, cache=cache, halo_fusion=args.halo_fusion,
                       precision=args.precision, nodes=args.nodes, gpus_per_node=args.gpus_per_node, **lever_kwargs(args),
                       global_batch=args.batch_size, tiles_per_gpu=args.tiles_per_gpu,
                       planner=nowdl.PlannerOptions(time_limit=args.time_limit, mip_gap=args.mip_gap, exact=args.exact, norm_schedule=args.norm_schedule))
    plan = cm.plan(*x, train=not args.inference)
    plan.model["name"] = name
    plan.model["source"] = {"spec": args.model, "args": json.loads(args.model_args or "{}")}
    if args.out:
        plan.save(args.out)
    print(plan.to_json() if args.json else "\n".join(t for t in (str(plan), format_levers(plan), format_allocator(plan)) if t))
    if args.out and not args.json:
        print(f"saved {args.out}")
    if args.plot:
        from nowdl.cli.pictures import draw_plan

        draw_plan(plan, args.plot, quiet=args.json)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
