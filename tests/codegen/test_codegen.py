"""Stage code generation: chained StageModules equal the model (outputs, train/eval, gradients),
parameter ownership, routing metadata against the plan, written sources and the CLI."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch import nn

import nowdl
from nowdl.cli.commands import main
from nowdl.codegen import StageModule, build_stages, chain_stages, stage_source, write_sources
from nowdl.errors import NowdlError

KS = (2, 3, 4)


def _small_unet() -> nn.Module:
    return nowdl.models.unet(in_channels=1, out_channels=2, depth=2, base_width=4)


def _monai_unet() -> nn.Module:
    monai = pytest.importorskip("monai")
    m: nn.Module = monai.networks.nets.UNet(spatial_dims=2, in_channels=1, out_channels=2,
                                            channels=(8, 16, 32), strides=(2, 2), num_res_units=1)
    return m


def _resnet() -> nn.Module:
    return nowdl.models.resnet(depth=20, version=1, in_channels=1, width=4)


MODELS: dict[str, Callable[[], nn.Module]] = {"unet": _small_unet, "monai_unet": _monai_unet, "resnet": _resnet}
_CACHE: dict[tuple[str, int], tuple[nn.Module, fx.GraphModule, nowdl.Plan, list[StageModule]]] = {}


def _setup(name: str, k: int) -> tuple[nn.Module, fx.GraphModule, nowdl.Plan, list[StageModule]]:
    if (name, k) not in _CACHE:
        torch.manual_seed(0)
        model = MODELS[name]()
        x = torch.empty(2, 1, 32, 32, device="meta")
        cm = nowdl.compile(model, gpus=k, stages=k, dp=1, replicas=1, spatial_parts=1, micro_batches=2,
                           mode="estimate", cache=False, progress=False)
        plan = cm.plan(x)
        gm = cm.trace(x).gm
        _CACHE[name, k] = (model, gm, plan, build_stages(gm, plan))
    return _CACHE[name, k]


def _chain(stages: list[StageModule], x: torch.Tensor) -> list[torch.Tensor]:
    values: dict[str, torch.Tensor] = {"x": x}
    for s in stages:
        values.update(s.run(values))
    return [values[v] for v in stages[-1].outputs]


CASES = [(name, k) for name in MODELS for k in KS]


@pytest.mark.parametrize(("name", "k"), CASES)
def test_chained_stages_equal_model(name: str, k: int) -> None:
    model, _, plan, stages = _setup(name, k)
    assert len(stages) == k == len(plan.stages)
    x = torch.randn(2, 1, 32, 32, generator=torch.Generator().manual_seed(1))
    for train in (False, True):
        model.train(train)
        for s in stages:
            s.module.train(train)
        torch.manual_seed(5)
        ref = model(x)
        torch.manual_seed(5)
        got = _chain(stages, x)
        assert len(got) == 1
        assert torch.equal(got[0], ref), f"{name} K={k} train={train}"
    # gradients through the chained stages, compared by original names (autograd may sum a
    # value's gradients from its users in another order: float rounding, hence the tolerance)
    model.train()
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    (model(x) * w).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    (_chain(stages, x)[0] * w).sum().backward()
    seen = 0
    for s in stages:
        for local, p in s.module.named_parameters():
            orig = s.param_names[local]
            assert p.grad is not None, f"{orig} got no gradient in stage {s.index}"
            torch.testing.assert_close(p.grad, want[orig], rtol=1e-5, atol=1e-5, msg=f"grad of {orig}")
            seen += 1
    assert seen == len(want)


@pytest.mark.parametrize(("name", "k"), CASES)
def test_params_owned_once_and_shared_not_copied(name: str, k: int) -> None:
    model, _, _, stages = _setup(name, k)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    owners: dict[str, list[int]] = {}
    for s in stages:
        local = {**dict(s.module.named_parameters()), **dict(s.module.named_buffers())}
        assert set(local) == set(s.param_names)
        for lname, orig in s.param_names.items():
            owners.setdefault(orig, []).append(s.index)
            assert local[lname] is state[orig], f"stage {s.index} copied {orig}"
    assert set(owners) == set(model.state_dict()), "every parameter and buffer in some stage"
    assert all(len(v) == 1 for v in owners.values()), {k_: v for k_, v in owners.items() if len(v) > 1}
    if name == "resnet":
        assert any(o.endswith("running_mean") for o in owners) and any(o.endswith("num_batches_tracked") for o in owners)


@pytest.mark.parametrize(("name", "k"), CASES)
def test_routing_agrees_with_plan(name: str, k: int) -> None:
    _, gm, plan, stages = _setup(name, k)
    placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    sent = {(v, s.index): s.consumers[v] for s in stages[:-1] for v in s.outputs}
    planned = {(t.producer, t.from_stage): t.to_stages for t in plan.tensors if t.producer not in placeholders}
    assert sent == planned
    for t in plan.tensors:
        if t.producer in placeholders:  # model inputs come from the data loader, never sent
            for j in t.to_stages:
                assert stages[j].producers[t.producer] == -1
    for s in stages:
        assert list(s.producers) == s.inputs and list(s.consumers) == s.outputs
        for v, p in s.producers.items():
            if p == -1:
                assert v in placeholders
            else:
                assert p < s.index and v in stages[p].outputs and s.index in stages[p].consumers[v]
    assert stages[-1].consumers == {v: [k] for v in stages[-1].outputs}
    assert "x" in stages[0].inputs


def test_long_skips_sent_directly() -> None:
    long = []
    for name in ("unet", "monai_unet"):
        for k in (3, 4):
            stages = _setup(name, k)[3]
            long += [(name, k, v) for s in stages[:-1] for v, cs in s.consumers.items() if max(cs) > s.index + 1]
    assert long, "UNets split in 3-4 stages have skips that jump a stage"


class _TwoHeads(nn.Module):
    """Returns a dict whose 'aux' value is made early: the last stage passes it through."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)
        self.c = nn.Conv2d(4, 4, 3, padding=1)
        self.d = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.a(x))
        y = self.d(torch.relu(self.c(torch.relu(self.b(h)))))
        return {"main": y + x, "aux": h}


def _plan(model: nn.Module, k: int, x: torch.Tensor) -> tuple[fx.GraphModule, nowdl.Plan]:
    cm = nowdl.compile(model, gpus=k, stages=k, dp=1, replicas=1, spatial_parts=1, micro_batches=2,
                       mode="estimate", cache=False, progress=False)
    return cm.trace(x).gm, cm.plan(x)


def _force_cut(gm: fx.GraphModule, plan: nowdl.Plan, last_of_stage0: str) -> None:
    """Move the cut of a 2-stage plan to just after ``last_of_stage0`` (graph order), so a test
    does not depend on where the planner's cost model happens to put it."""
    names = [n.name for n in gm.graph.nodes]
    cut = names.index(last_of_stage0) + 1
    plan.stages[0].nodes, plan.stages[1].nodes = names[:cut], names[cut:]


def test_dict_output_flattened_and_passed_through() -> None:
    torch.manual_seed(0)
    model = _TwoHeads().eval()
    x = torch.randn(2, 1, 16, 16)
    gm, plan = _plan(model, 2, x)
    _force_cut(gm, plan, "relu")  # h = relu(a(x)) is made in stage 0, returned by stage 1
    stages = build_stages(gm, plan)
    last = stages[-1]
    assert len(last.outputs) == 2
    h_name = last.outputs[1]
    assert h_name in last.inputs and last.producers[h_name] == 0
    assert stages[0].consumers[h_name] == [1]
    got = _chain(stages, x)
    ref = model(x)
    assert torch.equal(got[0], ref["main"]) and torch.equal(got[1], ref["aux"])
    assert isinstance(stages[0].module(x), tuple)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.mid = nn.ModuleList(nn.Conv2d(2, 2, 3, padding=1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        for m in self.mid:
            x = torch.relu(m(x))
        return self.conv(x)


def test_weights_tied_across_stages_refused() -> None:
    x = torch.randn(1, 2, 16, 16)
    gm, plan = _plan(_Tied(), 2, x)
    _force_cut(gm, plan, "relu_1")  # conv in stage 0, conv_1 (same weight) in stage 1
    where = plan.node_stage()
    assert where["conv"] == 0 and where["conv_1"] == 1
    with pytest.raises(NowdlError, match=r"'conv\.weight'.*stage 0.*stage 1.*not support"):
        build_stages(gm, plan)


@pytest.mark.parametrize("name", ["unet", "monai_unet"])
def test_chain_stages_is_the_model_in_one_process(name: str) -> None:
    model, gm, plan, _ = _setup(name, 3)
    model.eval()
    x = torch.randn(2, 1, 32, 32)
    chain = chain_stages(gm, plan)
    assert [s.index for s in chain.stages] == [0, 1, 2] and chain.data == ["x"]
    assert torch.equal(chain(x), model(x))
    with pytest.raises(NowdlError, match=r"take 1 model input\(s\) \(x\) but got 2"):
        chain(x, x)


def test_sources_compile_and_readme(tmp_path: Path) -> None:
    _, _, plan, stages = _setup("monai_unet", 3)
    keep = tmp_path / "other.txt"
    keep.write_text("mine")
    paths = write_sources(stages, plan, tmp_path)
    assert [p.name for p in paths] == ["stage_0.py", "stage_1.py", "stage_2.py", "README.txt"]
    for s, p in zip(stages, paths, strict=False):
        text = p.read_text()
        assert text == stage_source(s, plan)
        compile(text, str(p), "exec")
        ns: dict[str, object] = {}
        exec(compile(text, str(p), "exec"), ns)  # noqa: S102 - our own generated file
        assert ns["INPUTS"] == s.inputs and ns["OUTPUTS"] == s.outputs and ns["PARAM_NAMES"] == s.param_names
        assert "parameter map" in text and f"Stage{s.index}" in text
    readme = paths[-1].read_text()
    assert "stage_2.py" in readme and "rank" in readme
    assert keep.read_text() == "mine"
    assert not list(tmp_path.glob("*.tmp"))


_UNET_ARGS = '{"in_channels": 1, "out_channels": 2, "depth": 2, "base_width": 4}'


def test_cli_codegen(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = tmp_path / "p.json"
    assert main(["plan", "unet", "--model-args", _UNET_ARGS, "--input", "1x1x32x32", "--gpus", "3", "--stages", "3",
                 "--dp", "1", "--replicas", "1", "--mode", "estimate", "--no-cache", "--out", str(plan_path)]) == 0
    assert json.loads(plan_path.read_text())["model"]["source"] == {"spec": "unet", "args": json.loads(_UNET_ARGS)}
    capsys.readouterr()
    out = tmp_path / "gen"
    assert main(["codegen", str(plan_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / f) for f in ("stage_0.py", "stage_1.py", "stage_2.py", "README.txt")]
    for i in range(3):
        text = (out / f"stage_{i}.py").read_text()
        compile(text, f"stage_{i}.py", "exec")
        assert "parameter map" in text and "PARAM_NAMES" in text and ".weight" in text

    # a plan that does not say how to build its model: --model is needed
    d = json.loads(plan_path.read_text())
    del d["model"]["source"]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(d))
    assert main(["codegen", str(bare), "--out", str(tmp_path / "g2")]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and err.count("\n") <= 2
    assert not (tmp_path / "g2").exists()
    assert main(["codegen", str(bare), "--out", str(tmp_path / "g2"), "--model", "unet", "--model-args", _UNET_ARGS]) == 0
    assert (tmp_path / "g2" / "stage_2.py").exists()
    capsys.readouterr()
    # another model than the plan's: refused by fingerprint
    assert main(["codegen", str(bare), "--out", str(tmp_path / "g3"), "--model", "unet",
                 "--model-args", '{"in_channels": 1, "depth": 2, "base_width": 8}']) == 2
    assert "another model" in capsys.readouterr().err


class _ReadsSizeEarly(nn.Module):
    """Reads sizes at the start and uses them at the end, as MONAI's squeeze-and-excitation blocks
    do (``b, c = x.shape[:2]`` ... ``.view(b, c)``): Python ints, not tensors, cross the cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[0], x.size(1)
        h = torch.relu(self.a(x))
        return self.b(h).view(n, -1) * (c + 1)


class _ReadsValueEarly(_ReadsSizeEarly):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.sum().item()
        h = torch.relu(self.a(x))
        return self.b(h) * s


def test_sizes_crossing_stages_become_constants_of_the_plan() -> None:
    torch.manual_seed(0)
    model = _ReadsSizeEarly()
    x = torch.randn(2, 1, 8, 8)
    gm, plan = _plan(model, 2, x)
    _force_cut(gm, plan, "relu")
    ints = [n.name for n in gm.graph.nodes if n.op != "placeholder" and plan.node_stage()[n.name] == 0
            and any(plan.node_stage()[u.name] == 1 for u in n.users) and n.name != "relu"]
    assert ints, "the cut must leave sizes made in stage 0 for stage 1"
    stages = build_stages(gm, plan)
    assert stages[1].inputs == ["relu"] and stages[0].outputs == ["relu"]  # only the tensor travels
    assert torch.equal(_chain(stages, x)[0], model(x))


def test_a_data_dependent_value_crossing_stages_is_refused() -> None:
    x = torch.randn(2, 1, 8, 8)
    cm = nowdl.compile(_ReadsValueEarly(), gpus=2, stages=2, dp=1, replicas=1, spatial_parts=1, micro_batches=2,
                       mode="measure", cache=False, progress=False)  # estimate mode cannot profile .item()
    gm, plan = cm.trace(x).gm, cm.plan(x)
    _force_cut(gm, plan, "relu")
    with pytest.raises(NowdlError, match=r"node 'item' .*depends on the tensors' data.*share a stage"):
        build_stages(gm, plan)


def test_last_stage_rebuilds_the_models_output_structure() -> None:
    from nowdl.codegen.stage import fill_outputs

    torch.manual_seed(0)
    model = _TwoHeads().eval()
    x = torch.randn(2, 1, 16, 16)
    gm, plan = _plan(model, 2, x)
    stages = build_stages(gm, plan)
    out = fill_outputs(stages[-1].output_tree, _chain(stages, x))
    ref = model(x)
    assert isinstance(out, dict) and list(out) == list(ref)
    assert all(torch.equal(out[k], ref[k]) for k in ref)
