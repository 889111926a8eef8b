"""Which MONAI networks nowdl plans, runs, trains exactly and tiles: writes docs/models.md.

Runs, for every network of ``tests/helpers/monai_zoo.py`` (the list tests/test_monai_coverage.py
checks), what that test runs, and records the outcome instead of asserting it:

* plan: ``nowdl.compile(m, gpus=4, stages=4, cache=False).plan(x)`` (wall time of the call:
  trace, profile and search), the tracer that gave a faithful graph and its node count;
* stages = model: the largest absolute difference between ``cm(x)`` (the plan's stages run in
  turn) and ``m(x)`` in eval mode;
* CLI: ``python -m nowdl plan monai.networks.nets:NAME --model-args JSON --input ... --gpus 4
  --stages 4`` (one at a time, in a background thread) and its exit status;
* tiles: whether the whole network plans on 2 tiles (``gpus=2, stages=1, spatial_parts=2``,
  vertical strips in 2D, depth slabs in 3D), else the node the planner names and why;
* trains: every case of ``TRAIN`` in the test, and every other network that plans (2 pipeline
  stages of 2 tiles each when it tiles whole, else 4 pipeline stages): 3 Adam steps in float64
  on 4 gloo ranks against one process, with the largest differences of the losses and of the
  state dict.

    .venv/bin/python benchmarks/monai_models.py [--out docs/models.md] [--only UNet2d,...] [--no-train]

About 15 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_monai_coverage as cov  # noqa: E402
from helpers import monai_zoo  # noqa: E402
from results import HELP as RESULTS_HELP  # noqa: E402
from results import recorded  # noqa: E402

import nowdl  # noqa: E402


@dataclass
class Row:
    net: monai_zoo.Net
    tracer: str = ""
    nodes: int = 0
    plan_s: float = 0.0
    plan_error: str = ""
    plan_changes: str = ""
    stage_diff: float | None = None
    stage_error: str = ""
    cli: str = ""
    tiles: str = ""
    plan8: str = ""  # gpus=8, stages=8: wall time and what was chosen


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _why_untileable(e: BaseException) -> str:
    m = re.search(r"Node '([^']+)'[^:]*: (.*?)(?:\. Drop a pinned| \(it ends|$)", str(e))
    return f"no: `{m.group(1)}`: {m.group(2).rstrip('.')}" if m else f"no: {_first_line(e)}"


def plan8(net: monai_zoo.Net, x: torch.Tensor) -> str:
    """The 8-stage column: wall time end to end, the configuration and the split's solver."""
    t0 = time.perf_counter()
    try:
        p8 = nowdl.compile(monai_zoo.build(net), gpus=8, stages=8, progress=False, cache=False).plan(x)
        c, sv = p8.config, p8.solver
        g = float(sv.get("gap") or 0)
        gap = f", gap {100 * g:.1f}%" if sv.get("status") != "optimal" or g > 0 else ""
        shape = f"{c['stages']} stage{'s' if c['stages'] > 1 else ''}" + (
            f" x dp {c['dp']}" if c.get("dp", 1) > 1 else "") + (" MASTER" if c.get("replicas", 1) == 2 else "")
        return f"{time.perf_counter() - t0:.1f} s: {shape}, {sv.get('name')} {sv.get('status')}{gap}"
    except Exception as e:
        return f"FAILS: {_first_line(e)}"


def survey(net: monai_zoo.Net) -> Row:
    row = Row(net)
    torch.manual_seed(0)
    m = monai_zoo.build(net)
    x = cov._input(net)
    cm = nowdl.compile(m, gpus=4, stages=4, progress=False, cache=False)
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    t0 = time.perf_counter()
    try:
        plan = cm.plan(x)
    except Exception as e:
        row.plan_error = _first_line(e)
        return row
    row.plan_s = time.perf_counter() - t0
    changed = [k for k, v in m.state_dict().items() if not torch.equal(v, before[k])]
    if changed:
        row.plan_changes = f"planning changed {len(changed)} entries of the model's state ({changed[0]})"
    row.tracer = str(plan.model.get("tracer", "?"))
    row.nodes = int(plan.model.get("nodes", 0))
    m.eval()
    try:
        with torch.no_grad():
            got, want = cov._tensors(cm(x)), cov._tensors(m(x))
        row.stage_diff = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
    except Exception as e:
        row.stage_error = _first_line(e)
    row.plan8 = plan8(net, x)
    tiles = nowdl.compile(monai_zoo.build(net), gpus=2, stages=1, spatial_parts=2,
                          slice="depth" if net.dims == 3 else "vertical", progress=False, cache=False)
    try:
        tiles.plan(torch.empty(net.shape, device="meta"))
        row.tiles = "yes"
    except Exception as e:
        row.tiles = _why_untileable(e)
    return row


def verdict(case: cov.Train, res: cov.TrainResult | str) -> str:
    if isinstance(res, str):
        return f"FAILS: {res.strip().splitlines()[-1][:200]}"
    random = monai_zoo.by_id(case.net).random_in_training
    dl = max(abs(a - b) for a, b in zip(res.losses, res.ref_losses, strict=True))
    same_keys = list(res.sd) == list(res.ref_sd)
    dp = max((float((res.sd[k] - v).abs().max()) for k, v in res.ref_sd.items()
              if k in res.sd and v.numel() and v.is_floating_point()), default=0.0)
    ints = [k for k, v in res.ref_sd.items() if k in res.sd and not v.is_floating_point() and not torch.equal(res.sd[k], v)]
    ok = same_keys and all(a == res.losses for a in res.rank_losses) and all(
        abs(a - b) <= 1e-9 * abs(b) + 1e-12 for a, b in zip(res.losses, res.ref_losses, strict=True)) and all(
        torch.allclose(res.sd[k].double(), v.double(), rtol=1e-9, atol=1e-9) for k, v in res.ref_sd.items())
    parts = [p for p, _ in res.layout]
    if all(p == 1 for p in parts):
        how = f"{len(parts)}-stage pipeline"
    else:
        how = f"{len(parts)} stages on " + " + ".join(f"{p} tiles" if p > 1 else "1 rank" for p in parts)
    slice_ = f", {case.cfg['slice']}" if "slice" in case.cfg and any(p > 1 for p in parts) else ""
    head = f"not comparable ({random})" if random else ("yes" if ok else "NO")
    return (f"{head}: {how}{slice_}, {case.cfg['schedule']}, {case.total} micro-batches, "
            f"{cov.WORLD} ranks; max Δloss {dl:.0e}, max Δweights/statistics {dp:.0e}"
            + (f"; {len(ints)} integer buffers differ ({ints[0]}: {int(res.sd[ints[0]])} vs {int(res.ref_sd[ints[0]])})"
               if ints else "")
            + ("" if same_keys else "; state dict keys differ"))


def _args(net: monai_zoo.Net) -> str:
    keep = {k: v for k, v in net.kwargs.items() if k not in ("in_channels", "out_channels", "spatial_dims")}
    text = ", ".join(f"{k}={v}" for k, v in keep.items())
    return text.replace("|", "\\|")


def summary(rows: list[Row], trained: dict[str, list[str]]) -> str:
    planned = [r for r in rows if not r.plan_error]
    clean = [r for r in planned if not r.plan_changes]
    equal = [r for r in planned if r.stage_diff is not None and r.stage_diff <= 1e-5]
    cli = [r for r in rows if r.cli == "exit 0"]
    exact = [n for n, texts in trained.items() if any(t.startswith("yes") for t in texts)]
    ran = [n for n, texts in trained.items() if not all(t.startswith("not run") for t in texts)]
    tiles = [r for r in rows if r.tiles == "yes"]
    return (f"**Summary**: of {len(rows)} networks, {len(planned)} plan in 4 stages ({len(clean)} without changing "
            f"the model's state), {len(equal)} run their stages equal to the model, {len(cli)} plan from the "
            f"CLI, {len(exact)} of the {len(ran)} trained match one process exactly, and {len(tiles)} run "
            "on tiles whole.")


def markdown(rows: list[Row], trained: dict[str, list[str]], versions: str) -> str:
    out = [
        "# MONAI networks",
        "",
        "What nowdl does with the networks of `monai.networks.nets`, at small widths. Generated by",
        "`benchmarks/monai_models.py` from what it ran (" + versions + ", 2 CPU cores); the same",
        "list is checked by `tests/test_monai_coverage.py` (list: `tests/helpers/monai_zoo.py`).",
        "",
        "* **plan**: `nowdl.compile(m, gpus=4, stages=4).plan(x)` in estimate mode: the tracer that",
        "  gave a graph equal to the model (fx first, else torch.export), its node count, and the",
        "  wall time of the call (trace + profile + configuration search and ILP); the test also",
        "  requires planning to leave the model's weights and buffers as they were.",
        "* **8 stages**: `nowdl.compile(m, gpus=8, stages=8).plan(x)` (the search still chooses",
        "  micro-batches and MASTER): wall time end to end, what it chose, and the chosen split's",
        "  solver and status (`ideals optimal`: the exact DP over the DAG's ideals; `highs`: the MILP,",
        "  for splits whose long-skip gradient waits the DP cannot charge: `optimal` once proven",
        "  within the default `mip_gap` of 1%, with the gap proven when not 0. Graphs with too many",
        "  ideals get the anytime split (docs/planner.md): the best of the `beam`, `sese` (regions",
        "  contracted) and `coarse` ideal DPs walked downhill by the local search (`+local`), no MILP",
        "  unless a time limit or `exact=True` asks for it; `feasible` with its gap against the",
        "  assignment LP's lower bound, a weak bound on these graphs: the split is usually much closer).",
        "* **stages = model**: the plan's stages run one after another (`cm(x)`) against `m(x)` in",
        "  eval mode, largest absolute difference (the test requires 1e-5).",
        "* **CLI**: `nowdl plan monai.networks.nets:NAME --model-args '<args>' --input SHAPE --gpus 4",
        "  --stages 4`, exit status.",
        "* **trains exactly**: 3 Adam steps (lr 1e-2) in float64 on 4 gloo ranks against one",
        "  process running the same micro-batches with gradient accumulation: \"yes\" when the",
        "  losses and every state-dict entry (running statistics and `num_batches_tracked`",
        "  included) match to 1e-9. Networks that tile whole train on 2 pipeline stages of 2 tiles",
        "  each, the others on a 4-stage pipeline; \"(tested)\" marks the cases",
        "  `tests/test_monai_coverage.py` runs.",
        "* **tiles**: whether the whole network plans on 2 image tiles (vertical strips in 2D, depth",
        "  slabs in 3D); otherwise the node the planner names, and why. A network that cannot be",
        "  tiled whole may still run a tiled stem (ResNet below) when its first layers can.",
        "",
        summary(rows, trained),
        "",
        "| network | args (in/out channels and spatial_dims left out) | input | norms | tracer | nodes | "
        "plan | 8 stages | stages = model | CLI | trains exactly (float64) | tiles |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = r.net
        if r.plan_error:
            plan, stages = f"FAILS: {r.plan_error}", "—"
        else:
            plan = f"{r.plan_s:.1f} s" + (f"; NO: {r.plan_changes}" if r.plan_changes else "")
            stages = f"FAILS: {r.stage_error}" if r.stage_error else (
                f"yes ({r.stage_diff:.0e})" if r.stage_diff is not None and r.stage_diff <= 1e-5 else
                f"NO ({r.stage_diff:.0e})")
        tr = "<br>".join(trained.get(n.id, [])) or "—"
        out.append(f"| {n.cls} {n.dims}D | {_args(n)} | {n.input_arg()} | {', '.join(n.norms) or 'none'} | "
                   f"{r.tracer or '—'} | {r.nodes or '—'} | {plan} | {r.plan8 or '—'} | {stages} | {r.cli} | {tr} | "
                   f"{r.tiles or '—'} |")
    out += [
        "",
        "## Notes",
        "",
        "* Networks whose training draws random numbers (EfficientNet's stochastic depth in",
        "  EfficientNetBN and FlexibleUNet, rate fixed at 0.2 by their constructors) train, but each",
        "  rank draws its own masks, as with Dropout, so they cannot match one process.",
        "* FlexibleUNet on a 4-stage 1F1B pipeline once stopped in 2 of 5 runs of this script, a rank",
        "  waiting 60 s for a tensor from another stage (`PeerError: ... did not answer within 60 s`),",
        "  while the CLI plans ran beside the 4 training processes on the 2 cores. Its stochastic-depth",
        "  masks are now placed with the op that uses them (no longer sent between stages), and 8 of 8",
        "  runs of its 4-stage training alone on the machine finished (26-35 s each). The CLI plans",
        "  now finish before the training starts. It is not among the tested cases.",
        "* The tiles column gives the node the planner names when it refuses to put the whole",
        "  network on tiles; other nodes further on may need the whole image too.",
    ]
    out += ["", "## Not in the list", ""]
    for name, why in monai_zoo.LEFT_OUT.items():
        out.append(f"* **{name}**: {why}.")
    out += ["", "## Outside MONAI", "", *OUTSIDE, ""]
    return "\n".join(out)


#: Networks of other libraries tried by hand (not run by this script: their packages are not
#: among the pinned test dependencies).
OUTSIDE = [
    "* **nnU-Net's `Generic_UNet`** (nnunet 1.7.1, `pip install --no-deps nnunet`; its inference",
    "  helpers' imports, batchgenerators and scipy, stubbed), 3D, 3 poolings, InstanceNorm,",
    "  LeakyReLU in place, strided-conv pooling and transposed-conv upsampling, at width 8 on 32³",
    "  (2026-11-25): traced by fx (51 nodes; 53 with deep supervision), plans in 4 stages in",
    "  1.2 s with stages equal to the model (0.0 difference, deep supervision's tuple too), plans",
    "  whole on 2 tiles; 3 Adam steps in float64 on 4 gloo ranks match one process on a 4-stage",
    "  pipeline (Δloss 0, Δweights 0) and on 2 stages of 2 depth slabs each (Δloss 3e-15, Δweights",
    "  3e-10).",
    "* **segmentation_models_pytorch, torchvision and timm** (`pip install 'nowdl[zoo]'`): smp's UNet, UNet++,",
    "  FPN and DeepLabV3+ on a ResNet-34 and on a timm ConvNeXt encoder, torchvision's FCN and DeepLabV3",
    '  (ResNet-50) and a timm ResNet-18 classifier, with random weights: plans, exact float64 training,',
    '  whole-net tiling and prediction in `docs/results/zoo_models.md` (`benchmarks/zoo_models.py`, tested by',
    "  `tests/test_zoo_coverage.py`). Sizes read off a tile are the whole image's and average pooling is",
    "  reduced over the tiles, so smp's UNet, FPN and DeepLabV3+ and torchvision's FCN run whole on tiles",
    "  (docs/spatial.md). A BatchNorm that sees one value per channel at batch 1 (DeepLabV3's ASPP",
    '  pooling branch) is named, and training plans take micro-batches of 2 samples or more for it.',
]


def remake_plan8(path: Path, nets: list[monai_zoo.Net]) -> None:
    """Replace the '8 stages' cell of each net's row of the table in ``path``."""
    lines = path.read_text().splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("| network |"))
    col = [c.strip() for c in lines[head].split("|")].index("8 stages")
    for net in nets:
        label = f"| {net.cls} {net.dims}D | {_args(net)} |"
        i = next((j for j, ln in enumerate(lines) if ln.startswith(label)), None)
        if i is None:
            print(f"{net.id}: no row in {path}", file=sys.stderr)
            continue
        cells = lines[i].split("|")
        cells[col] = f" {plan8(net, cov._input(net))} "
        lines[i] = "|".join(cells)
        print(f"{net.id}: 8 stages {cells[col].strip()}", file=sys.stderr, flush=True)
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", action="store_true", help=RESULTS_HELP)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "models.md"))
    ap.add_argument("--only", help="comma-separated net ids")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--plan8-only", action="store_true",
                    help="re-make only the '8 stages' column of the existing --out table (in place)")
    args = ap.parse_args()
    nets = [n for n in monai_zoo.NETS if not args.only or n.id in args.only.split(",")]
    if args.plan8_only:
        remake_plan8(Path(args.out), nets)
        return
    import tempfile

    rows = []
    for net in nets:  # first, alone on the machine: the plan timings
        row = survey(net)
        print(f"{net.id}: plan {row.plan_error or f'{row.plan_s:.1f}s'} 8 stages {row.plan8} stages "
              f"{row.stage_error or row.stage_diff} tiles {row.tiles}", file=sys.stderr, flush=True)
        rows.append(row)
    with tempfile.TemporaryDirectory() as tmp:
        runs = cov._CliRuns(nets, Path(tmp))
        try:
            for row in rows:
                res = runs.result(row.net)
                row.cli = "exit 0" if res.returncode == 0 else (
                    f"exit {res.returncode}: {(res.stderr.strip().splitlines() or [''])[-1][:200]}")
        finally:
            runs.close()
    trained: dict[str, list[str]] = {}
    if not args.no_train:
        cases = {str(p.id): p.values[0] for p in cov.TRAIN if p.values[0].net in {n.id for n in nets}}
        tested = set(cases)
        for row in rows:  # every other net that plans: on tiles if it tiles whole, else a 4-stage pipeline
            if row.net.no_float64:
                trained[row.net.id] = [f"not run: {row.net.no_float64}"]
            elif not row.plan_error and row.net.id not in {c.net for c in cases.values()}:
                cfg = ({**cov._TILED, "slice": "depth" if row.net.dims == 3 else "vertical"} if row.tiles == "yes"
                       else cov._PIPE4)
                cases[row.net.id] = cov.Train(row.net.id, cfg)
        results: dict[str, cov.TrainResult | str] = {}
        todo = dict(cases)
        while todo:  # after a failing case the pool stops: run what it left in a new pool
            try:
                got = cov.run_cases(todo)
            except Exception:  # the pool itself broke: one pool per case
                got = {}
                for cid, case in todo.items():
                    try:
                        got.update(cov.run_cases({cid: case}))
                    except Exception as e:
                        got[cid] = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
            results.update({k: v for k, v in got.items() if not (isinstance(v, str) and v.startswith("not run"))})
            todo = {k: c for k, c in todo.items() if k not in results}
        for cid, case in cases.items():
            text = verdict(case, results[cid]) + (" (tested)" if cid in tested else "")
            print(f"train {cid}: {text}", file=sys.stderr, flush=True)
            trained.setdefault(case.net, []).append(text)
    import monai

    versions = f"torch {torch.__version__.split('+')[0]}, MONAI {monai.__version__}"
    Path(args.out).write_text(markdown(rows, trained, versions))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    with recorded("monai_models", "--results" in sys.argv):
        main()
