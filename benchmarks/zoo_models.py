"""Which model-zoo networks nowdl plans, trains exactly, tiles whole and predicts exactly: a table.

Runs, for every network of ``tests/helpers/zoo.py`` (the list tests/test_zoo_coverage.py checks;
smp, torchvision and timm, random weights), and records the outcome instead of asserting it:

* plans: ``nowdl.compile(m, gpus=2, stages=2).plan(x)`` (wall time: trace, profile, search),
  the tracer and node count, and ``cm(x)`` against ``m(x)`` in eval mode;
* trains exact: the test's training case (2 SGD steps in float64 on 2 gloo ranks against one
  process running the same micro-batches), largest differences of the losses and the state dict;
* fully tiled: whether the whole net plans on 2 tiles (``stages=1, spatial_parts=2``, cut as its
  training case cuts them, else vertically), else the node the planner names;
* predicts exact: ``cm.predict`` of a 128x128 zarr image (one window: these encoders read
  hundreds of pixels of context, so streamed windows need more than a thousand) on 1 process
  against the model's whole-image forward in eval mode (dense nets), and on 2 tiles for the nets
  that tile whole; ``eval_step`` against the model for the classifier.

    .venv/bin/python benchmarks/zoo_models.py [--only smp-Unet-resnet34,...] [--no-train] [--results]

About 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_zoo_coverage as cov  # noqa: E402
from helpers import zoo  # noqa: E402
from helpers.distributed import run_workers  # noqa: E402
from helpers.zoo_train import WORLD, TrainResult, run_cases  # noqa: E402
from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402

import nowdl  # noqa: E402


def _first_line(e: BaseException) -> str:
    """The error in one line; a worker's: the last line of its traceback (the exception)."""
    lines = str(e).strip().splitlines() or [""]
    if type(e).__name__ == "WorkerError":
        raised = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception): ", ln)]
        if raised:
            return raised[-1][:200]
    return f"{type(e).__name__}: {lines[0][:160]}"


def plans(net: zoo.ZooNet) -> str:
    m = zoo.build(net)
    x = cov._input(net)
    t0 = time.perf_counter()
    try:
        p = nowdl.compile(m, gpus=2, stages=2, progress=False, cache=False,
                          planner=nowdl.PlannerOptions(time_limit=10)).plan(x)
        secs = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            cm = nowdl.compile(m, plan=p.save(f"{tmp}/plan.json"), progress=False)
            m.eval()
            with torch.no_grad():
                d = float((zoo.first_tensor(cm(x)) - zoo.first_tensor(m(x))).abs().max())
    except Exception as e:
        return f"FAILS: {_first_line(e)}"
    return f"yes: {secs:.1f} s, {p.model.get('tracer')}, {p.model.get('nodes')} nodes; stages = model ({d:.0e})"


def _slice(net: zoo.ZooNet) -> str:
    """The slice the net's training case cuts (vertical where it trains on pipeline stages)."""
    case = next(p.values[0] for p in cov.TRAIN if p.values[0].net == net.id)
    return str(case.cfg.get("slice", "vertical"))


def tiles(net: zoo.ZooNet) -> str:
    cm = nowdl.compile(zoo.build(net), gpus=2, stages=1, spatial_parts=2, slice=_slice(net), progress=False,
                       cache=False)
    try:
        cm.plan(torch.empty(net.shape, device="meta"))
        return "yes"
    except nowdl.TileHaloError as e:  # its first sentence: the node, its halo and the tile
        return f"no: {str(e).split('. ')[0]}"
    except Exception as e:
        m = re.search(r"Node '([^']+)'[^:]*: (.*?)(?:\. Drop a pinned|$)", str(e))
        return f"no: `{m.group(1)}`: {m.group(2)}" if m else f"no: {_first_line(e)}"


def _predict(rank: int, world: int, net_id: str, source: str, out: str, pins: dict[str, object]) -> str:
    cm = nowdl.compile(zoo.build(zoo.by_id(net_id)).eval(), gpus=world, progress=False, cache=False, **pins)
    return cm.predict(source, out).line()


def predicts(net: zoo.ZooNet, tiled: bool) -> str:
    if net.output == "classes":
        m = zoo.build(net).eval()
        x = cov._input(net)
        got = nowdl.compile(m, gpus=1, progress=False, cache=False, mode="estimate").eval_step(x)
        with torch.no_grad():
            return f"eval_step: {float((got - m(x)).abs().max()):.0e}"
    import zarr

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        img = np.random.default_rng(3).random((3, 128, 128)).astype(np.float32)
        zarr.save_array(f"{tmp}/in.zarr", img)
        with torch.no_grad():
            ref = zoo.first_tensor(zoo.build(net).eval()(torch.from_numpy(img)[None]))[0].numpy()
        runs = [("1 process", 1, {})]
        if tiled:
            runs.append(("2 tiles", WORLD, {"stages": 1, "spatial_parts": 2, "slice": _slice(net), "micro_batches": 1,
                                            "replicas": 1, "dp": 1}))
        for i, (what, world, pins) in enumerate(runs):
            try:
                line = run_workers(_predict, world, net.id, f"zarr:{tmp}/in.zarr", f"{tmp}/o{i}.zarr", pins,
                                   timeout_s=600)[0]
                got = np.asarray(zarr.open_array(f"{tmp}/o{i}.zarr/0")[:])
                exact = "exact" if "exact" in line else "windowed"
                out.append(f"{what}: {float(np.abs(got - ref).max()):.0e} ({exact})")
            except Exception as e:
                out.append(f"{what}: FAILS {_first_line(e)}")
    return "; ".join(out)


def trained(ids: set[str]) -> dict[str, str]:
    # the training alone: this script checks tiling and prediction itself
    cases = {str(p.id): dataclasses.replace(p.values[0], checks=(), predict=False) for p in cov.TRAIN
             if p.values[0].net in ids}
    got = run_cases(cases)
    out: dict[str, str] = {}
    for cid, res in got.items():
        net = cases[cid].net
        if isinstance(res, str):
            out[net] = f"FAILS: {res.strip().splitlines()[-1][:160]}"
            continue
        assert isinstance(res, TrainResult)
        dl = max(abs(a - b) for a, b in zip(res.losses, res.ref_losses, strict=True))
        how = " + ".join(f"{p} tiles" if p > 1 else "1 rank" for p, _ in res.layout)
        ok = dl <= 1e-9 * max(abs(v) for v in res.ref_losses) and not res.off and not res.keys
        out[net] = (f"{'yes' if ok else 'NO'}: {how}; Δloss {dl:.0e}, Δweights {res.max_dw:.0e}; "
                    f"eval_step Δ {res.pred_diff:.0e}")
    return out


def main() -> int:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--only", help="comma-separated net ids")
    ap.add_argument("--no-train", action="store_true")
    args = ap.parse_args()
    nets = [n for n in zoo.NETS if not args.only or n.id in args.only.split(",")]
    rows = []
    for net in nets:
        row = [plans(net), tiles(net)]
        row.append(predicts(net, row[1] == "yes"))
        print(f"{net.id}: {' | '.join(row)}", file=sys.stderr, flush=True)
        rows.append(row)
    train = {} if args.no_train else trained({n.id for n in nets})
    print("| network | plans (2 stages) | trains exact (float64, 2 ranks) | fully tiled (2 tiles) | predicts exact |")
    print("|---|---|---|---|---|")
    for net, (plan, tile, pred) in zip(nets, rows, strict=True):
        print(f"| {net.id} | {plan} | {train.get(net.id, 'not run')} | {tile} | {pred} |")
    print()
    print(f"torch {torch.__version__}; nets with random weights; inputs: "
          + ", ".join(sorted({'x'.join(map(str, n.shape)) for n in nets})))
    return 0


if __name__ == "__main__":
    with recorded("zoo_models", "--results" in sys.argv):
        sys.exit(main())
