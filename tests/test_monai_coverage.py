"""Coverage over third-party models: the MONAI networks of tests/helpers/monai_zoo.py.

For every network (issue #9, part 2):

* ``nowdl.compile(m, gpus=4, stages=4).plan(x)`` plans 4 stages and leaves the model's weights
  and buffers as they were;
* in eval mode, running the plan's stages one after another (``cm(x)``) gives ``m(x)`` (1e-5);
* ``python -m nowdl plan monai.networks.nets:NAME --model-args JSON ...`` exits 0 and writes a
  plan whose stages, loaded back with ``nowdl.compile(m, plan=...)``, also give ``m(x)``. These
  commands run one at a time in a background thread while the in-process tests run.

A subset (TRAIN) trains 3 Adam steps in float64 on 4 gloo ranks and matches one process that
runs the same micro-batches to 1e-9: the loss of every step and every entry of the state dict,
under the model's own keys (BatchNorm running statistics and ``num_batches_tracked`` included;
there is one copy of each stage). Fully convolutional networks train on 2 pipeline stages that
are each cut into 2 tiles; the others on a 4-stage pipeline (ResNet: a tiled stem, then two
pipeline stages). Networks that cannot run on tiles must say so: pinning tiles raises an error
naming the node and why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed import run_workers
from helpers.monai_zoo import NETS, Net, build, by_id
from helpers.reference import train_reference
from torch import nn
from torch.utils._pytree import tree_structure

import nowdl

STEPS = 3
LR = 1e-2
CLI_TIMEOUT_S = 300


def _input(net: Net, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(net.shape, generator=torch.Generator().manual_seed(0), dtype=dtype)


def _first(out: Any) -> torch.Tensor:
    """The first tensor of a model's output (MONAI nets return a tensor, some a list)."""
    while isinstance(out, (list, tuple)):
        out = out[0]
    assert isinstance(out, torch.Tensor), type(out)
    return out


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


def _assert_same_outputs(got: Any, want: Any, what: str) -> None:
    # the same structure too: a torch.export graph's split stages once returned a 1-tuple
    # where the model returns a tensor
    assert tree_structure(got) == tree_structure(want), (
        f"{what}: returns {tree_structure(got)} where the model returns {tree_structure(want)}")
    g, w = _tensors(got), _tensors(want)
    assert len(g) == len(w), f"{what}: {len(g)} output tensors instead of {len(w)}"
    for i, (a, b) in enumerate(zip(g, w, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"{what}, output {i}: {m}")


# ---- the list itself -------------------------------------------------------------------------------

_NORMS = {"batch": nn.modules.batchnorm._BatchNorm, "instance": nn.modules.instancenorm._InstanceNorm,
          "group": nn.GroupNorm, "layer": nn.LayerNorm}


def test_the_list_covers_what_the_issue_asks() -> None:
    assert len({n.id for n in NETS}) == len(NETS) >= 15
    assert {n.dims for n in NETS} == {2, 3}
    assert {"batch", "instance", "group", "layer"} <= {k for n in NETS for k in n.norms}
    trained = {p.values[0].net for p in TRAIN}
    assert len(trained) >= 6 and {"batch", "instance", "group"} <= {k for t in trained for k in by_id(t).norms}
    assert not [t for t in trained if by_id(t).random_in_training], "random training cannot match one process"
    assert not [t for t in trained if by_id(t).no_float64], "the training check runs in float64"
    for n in NETS:  # the norms each entry claims are the norm layers the built net has
        m = build(n)
        found = {k for k, t in _NORMS.items() if any(isinstance(x, t) for x in m.modules())}
        assert found == set(n.norms), (n.id, sorted(found))


# ---- the CLI, in the background ------------------------------------------------------------------


@dataclass
class _CliResult:
    returncode: int
    stdout: str
    stderr: str
    plan: Path


def _cli_argv(net: Net, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nowdl", "plan", f"monai.networks.nets:{net.cls}", "--model-args", net.model_args(),
            "--input", net.input_arg(), *extra]


def _time_limit(net: Net) -> float:
    """What these tests give plan(): the wide nets' MILP stops early (the stages must still
    equal the model; how fast they plan is benchmarks/monai_models.py's job)."""
    return 8.0 if net.id in _SLOW_PLAN else 30.0


def _plan_argv(net: Net, out: Path) -> list[str]:
    return _cli_argv(net, "--gpus", "4", "--stages", "4", "--no-cache", "--out", str(out),
                     "--time-limit", str(_time_limit(net)))[3:]  # without `python -m nowdl`


class _CliRuns:
    """``nowdl plan`` of each selected network, one after another in ONE background process
    (``helpers/cli_batch.py``: the command line's ``main`` per net, one import of torch and MONAI
    for all), started at once; each test waits for its net's answer."""

    def __init__(self, nets: list[Net], root: Path) -> None:
        self._futures: dict[str, Future[_CliResult]] = {n.id: Future() for n in nets}
        self._plans = {n.id: root / n.id / "plan.json" for n in nets}
        for path in self._plans.values():
            path.parent.mkdir(parents=True, exist_ok=True)
        self._log = root / "cli_batch.stderr"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        with self._log.open("w") as log:
            self._proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "helpers" / "cli_batch.py")],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        assert self._proc.stdin is not None
        self._proc.stdin.write("".join(json.dumps({"id": n.id, "argv": _plan_argv(n, self._plans[n.id])}) + "\n"
                                       for n in nets))
        self._proc.stdin.close()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            r = json.loads(line)
            self._futures[r["id"]].set_result(_CliResult(r["rc"], r["stdout"], r["stderr"], self._plans[r["id"]]))
        self._proc.wait()
        for f in self._futures.values():
            if not f.done():
                f.set_exception(RuntimeError(f"the nowdl plan batch exited {self._proc.returncode} before this net:\n"
                                             f"{self._log.read_text()[-3000:]}"))

    def result(self, net: Net) -> _CliResult:
        return self._futures[net.id].result(timeout=len(self._futures) * CLI_TIMEOUT_S)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._reader.join(timeout=10)


@pytest.fixture(scope="module")
def cli_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_CliRuns]:
    wanted = {item.callspec.params["net"].id for item in request.session.items
              if getattr(item, "originalname", "") == "test_cli_plan" and hasattr(item, "callspec")}
    runs = _CliRuns([n for n in NETS if n.id in wanted], tmp_path_factory.mktemp("cli"))
    yield runs
    runs.close()


# ---- (a) plans, (b) stages equal the model, (c) the CLI --------------------------------------------


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


#: nets whose plan takes over 15 s here (export traces of 300-700 nodes; the search dominates)
_SLOW_PLAN = {"SwinUNETR2d", "UNETR2d", "FlexibleUNet2d", "EfficientNetBN2d"}
_NET_PARAMS = [pytest.param(n, id=n.id, marks=[pytest.mark.slow] if n.id in _SLOW_PLAN else []) for n in NETS]


@pytest.mark.parametrize("net", _NET_PARAMS)
def test_plans_and_stages_equal_the_model(net: Net, cli_runs: _CliRuns) -> None:
    torch.manual_seed(0)
    m = build(net)
    x = _input(net)
    before = _state(m)
    cm = nowdl.compile(m, gpus=4, stages=4, progress=False,
                       planner=nowdl.PlannerOptions(time_limit=_time_limit(net)))
    plan = cm.plan(x)
    assert len(plan.stages) == 4 and all(s.nodes for s in plan.stages), [len(s.nodes) for s in plan.stages]
    after = _state(m)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"planning changed the model's state: {changed[:5]}"
    m.eval()
    with torch.no_grad():
        want = m(x)
        got = cm(x)
    _assert_same_outputs(got, want, f"{net.id}: the plan's stages run in turn")


@pytest.mark.parametrize("net", _NET_PARAMS)
def test_cli_plan(net: Net, cli_runs: _CliRuns) -> None:
    res = cli_runs.result(net)
    assert res.returncode == 0, f"nowdl plan exited {res.returncode}:\n{res.stderr[-3000:]}"
    assert res.plan.exists() and f"saved {res.plan}" in res.stdout
    torch.manual_seed(0)
    m = build(net)
    x = _input(net)
    cm = nowdl.compile(m, plan=res.plan, progress=False)  # the model the plan records: checked by fingerprint
    assert len(cm.plan(x).stages) == 4
    m.eval()
    with torch.no_grad():
        _assert_same_outputs(cm(x), m(x), f"{net.id}: the CLI plan's stages")


# ---- nets that cannot run on tiles say why ---------------------------------------------------------

UNTILEABLE = [  # (net, node named, why): the trained nets that are not fully convolutional, and MedNeXt
    ("MedNeXt2d", "pad", "pad is not an op nowdl knows how to run on tiles"),
    ("ResNet2d", "avgpool", "AdaptiveAvgPool2d needs the whole image"),
    ("DenseNet2d", "class_layers_pool", "AdaptiveAvgPool2d needs the whole image"),
    ("UNETR2d", "flatten", "aten.flatten is not an op nowdl knows how to run on tiles"),
]


@pytest.mark.parametrize(("net_id", "node", "why"), UNTILEABLE)
def test_pinned_tiles_on_an_untileable_net_name_the_node(net_id: str, node: str, why: str) -> None:
    net = by_id(net_id)
    torch.manual_seed(0)
    cm = nowdl.compile(build(net), gpus=2, stages=1, spatial_parts=2, slice="depth" if net.dims == 3 else "vertical",
                       progress=False, cache=False)
    with pytest.raises(nowdl.NowdlError) as e:
        cm.plan(torch.empty(net.shape, device="meta"))
    text = str(e.value)
    assert f"Node '{node}'" in text and why in text, text


def test_cli_refuses_pinned_tiles_in_one_paragraph_and_writes_nothing(tmp_path: Path) -> None:
    net = by_id("MedNeXt2d")
    out = tmp_path / "never.json"
    p = subprocess.run(_cli_argv(net, "--gpus", "2", "--stages", "1", "--spatial-parts", "2", "--no-cache",
                                 "--out", str(out)),
                       capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    err = p.stderr.strip()
    assert p.returncode == 2, p.stderr
    assert err.startswith("nowdl plan: error:") and "\n" not in err, err
    assert "Node 'pad'" in err and "Drop a pinned setting" in err, err
    assert not out.exists()


# ---- exact training in float64 ----------------------------------------------------------------------
#
# Every selected case runs in ONE pool of WORLD gloo processes, one case after another (spawning
# and importing torch and MONAI in 4 processes costs more than most cases). After each case the
# ranks agree whether it passed on all of them; after a failure the remaining cases are not run
# and their tests fail naming the case that failed first (messages of a failed case may still
# be in flight).

WORLD = 4


@dataclass(frozen=True)
class Train:
    net: str
    cfg: dict[str, Any]

    @property
    def total(self) -> int:
        return int(self.cfg["micro_batches"])


_ONE = {"dp": 1, "replicas": 1, "micro_batches": 2, "schedule": "1f1b"}
#: two pipeline stages, each on 2 tiles: encoder tiles send their skips to decoder tiles
_TILED = {"stages": 2, "spatial_parts": 2, "spatial_stages": 1, **_ONE}
_PIPE4 = {"stages": 4, "spatial_parts": 1, **_ONE}

TRAIN = [
    pytest.param(Train("UNet2d", {**_TILED, "slice": "vertical"}), id="UNet2d-instance-tiles"),
    pytest.param(Train("BasicUNet2d", {**_TILED, "slice": "horizontal"}), id="BasicUNet2d-instance-export-tiles"),
    pytest.param(Train("AttentionUnet2d", {**_TILED, "slice": "square"}), id="AttentionUnet2d-batch-tiles"),
    pytest.param(Train("SegResNet3d", {**_TILED, "slice": "depth"}), id="SegResNet3d-group-tiles"),
    pytest.param(Train("MedNeXt2d", _PIPE4), id="MedNeXt2d-group-pipeline"),
    pytest.param(Train("ResNet2d", {"stages": 3, "spatial_parts": 2, "spatial_stages": 1, "slice": "square", **_ONE}),
                 id="ResNet2d-batch-tiled-stem"),
    pytest.param(Train("UNETR2d", _PIPE4), id="UNETR2d-instance-layer-export-pipeline"),
    pytest.param(Train("DynUNet2d", {**_PIPE4, "schedule": "gpipe"}), id="DynUNet2d-instance-pipeline",
                 marks=pytest.mark.slow),
    pytest.param(Train("SegResNetDS3d", {**_TILED, "slice": "depth"}), id="SegResNetDS3d-batch-export-tiles",
                 marks=pytest.mark.slow),
    pytest.param(Train("DenseNet2d", _PIPE4), id="DenseNet2d-batch-pipeline", marks=pytest.mark.slow),
    pytest.param(Train("SENet2d", _PIPE4), id="SENet2d-batch-pipeline-sizes-cross-stages", marks=pytest.mark.slow),
    # its unused deep-supervision heads are dropped from the graph (nowdl.trace.deadcode), so it tiles whole
    pytest.param(Train("BasicUNetPlusPlus2d", {**_TILED, "slice": "vertical"}),
                 id="BasicUNetPlusPlus2d-instance-export-dead-heads-tiles", marks=pytest.mark.slow),
]


def _make(net_id: str) -> nn.Module:
    torch.manual_seed(0)
    return build(by_id(net_id)).double()


def _out_shape(net_id: str) -> tuple[int, ...]:
    with torch.no_grad():
        return tuple(_first(_make(net_id).eval()(_input(by_id(net_id), torch.float64))).shape)


def _data(net_id: str, out_shape: tuple[int, ...], total: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    net = by_id(net_id)
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(total, *net.shape[1:], generator=g, dtype=torch.float64)
    if net.output == "image":
        return x, torch.randn(total, *out_shape[1:], generator=g, dtype=torch.float64)
    return x, torch.randint(0, out_shape[1], (total,), generator=g)


class _Loss(nn.Module):
    """MSE (image outputs) or cross-entropy (logits) of the model's first output tensor: some nets
    return a list (BasicUNetPlusPlus), which the pipeline's last stage returns flattened."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fn = nn.MSELoss() if kind == "image" else nn.CrossEntropyLoss()

    def forward(self, out: Any, target: torch.Tensor) -> torch.Tensor:
        return self.fn(_first(out), target)  # type: ignore[no-any-return]


def _loss(net_id: str) -> nn.Module:
    return _Loss(by_id(net_id).output)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)


_Ran = tuple[list[float], dict[str, torch.Tensor], list[tuple[int, list[int]]]]


def _train_one(world: int, case: Train, out_shape: tuple[int, ...]) -> _Ran:
    cm = nowdl.compile(_make(case.net), gpus=world, mode="estimate", optimizer=_adam, loss_fn=_loss(case.net),
                       cache=False, progress=False, timeout_s=60, **case.cfg)
    losses = [cm.train_step(*_data(case.net, out_shape, case.total, step)) for step in range(STEPS)]
    plan = cm._trainer.plan
    assert plan is not None
    return losses, cm.state_dict(), [(s.parts, list(s.grid)) for s in plan.stages]


def _train_worker(rank: int, world: int, cases: list[tuple[str, Train, tuple[int, ...]]]) -> dict[str, _Ran | str]:
    import traceback

    import torch.distributed as dist

    out: dict[str, _Ran | str] = {}
    first_failure = ""
    for cid, case, out_shape in cases:
        if first_failure:
            out[cid] = f"not run: case {first_failure} failed before it"
            continue
        failed = torch.zeros(1)
        try:
            out[cid] = _train_one(world, case, out_shape)
        except Exception:
            out[cid] = f"rank {rank}: " + traceback.format_exc()
            print(f"case {cid} failed on {out[cid]}", file=sys.stderr, flush=True)  # shown even if a peer hangs
            failed += 1
        try:
            dist.all_reduce(failed)  # every rank learns whether any rank failed
        except RuntimeError:  # a peer timed out and gloo closed the connection: stop here
            failed += 1
        if failed.item():
            first_failure = cid
            if not isinstance(out[cid], str):
                out[cid] = "another rank failed (see its traceback in that rank's result)"
    return out


@dataclass
class TrainResult:
    losses: list[float]  # rank 0's
    ref_losses: list[float]
    sd: dict[str, torch.Tensor]  # cm.state_dict() after the last step
    ref_sd: dict[str, torch.Tensor]
    layout: list[tuple[int, list[int]]]  # (parts, grid) of each stage
    rank_losses: list[list[float]]  # every rank's


def run_cases(cases: dict[str, Train]) -> dict[str, TrainResult | str]:
    """Train every case in one pool of WORLD processes and in one process (the reference).

    Returns a TrainResult per case, or the error text of the ranks where it failed."""
    todo = [(cid, case, _out_shape(case.net)) for cid, case in cases.items()]
    per_rank = run_workers(_train_worker, WORLD, todo, timeout_s=240 + 90 * len(todo))
    results: dict[str, TrainResult | str] = {}
    for cid, case, out_shape in todo:
        got = [r[cid] for r in per_rank]
        errors = [g for g in got if isinstance(g, str)]
        if errors:
            results[cid] = "\n".join(dict.fromkeys(errors))
            continue
        model = _make(case.net)
        ref_losses, ref_sd = train_reference(model, _adam(model.parameters()), _loss(case.net),
                                             lambda step, c=case, o=out_shape: _data(c.net, o, c.total, step),
                                             case.total, STEPS)
        losses, sd, layout = got[0]  # type: ignore[misc]
        results[cid] = TrainResult(losses, ref_losses, sd, ref_sd, layout, [g[0] for g in got])  # type: ignore[index]
    return results


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest) -> dict[str, TrainResult | str]:
    wanted = {item.callspec.id for item in request.session.items
              if getattr(item, "originalname", "") == "test_trains_exactly_in_float64" and hasattr(item, "callspec")}
    return run_cases({str(p.id): p.values[0] for p in TRAIN if p.id in wanted})


@pytest.mark.parametrize("case", TRAIN)
def test_trains_exactly_in_float64(case: Train, trained: dict[str, TrainResult | str],
                                   request: pytest.FixtureRequest) -> None:
    res = trained[request.node.callspec.id]
    if isinstance(res, str):
        pytest.fail(res, pytrace=False)
    for r, other in enumerate(res.rank_losses):
        assert other == res.losses, f"rank {r} reports another loss"
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(res.ref_losses), rtol=1e-9, atol=1e-12)
    assert list(res.sd) == list(res.ref_sd), set(res.sd) ^ set(res.ref_sd)
    for k, ref in res.ref_sd.items():  # weights, running statistics and num_batches_tracked
        torch.testing.assert_close(res.sd[k], ref, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")
    assert len(res.layout) == case.cfg["stages"]
    if case.cfg.get("spatial_parts", 1) > 1:
        assert res.layout[0][0] == case.cfg["spatial_parts"], f"stage 0 is not tiled: {res.layout}"
