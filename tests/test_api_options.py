"""compile()'s settings: every bad one fails at compile() time with the argument, its value and the
fix on the first line; PlannerOptions reaches the planner; planning loads no runtime module."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import nowdl
from nowdl.options import PlannerOptions, RuntimeOptions

ROOT = Path(__file__).resolve().parents[1]


def _model() -> nn.Module:
    return nowdl.models.unet(1, 2, depth=2, base_width=4)


def _boom(ps: Any) -> torch.optim.Optimizer:
    raise ValueError("no lr given")


COMPILE_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("mode", {"mode": "guess"}, "mode='guess' is not one of auto, estimate, measure: 'estimate'"),
    ("device", {"device": "gpu"}, "device='gpu' is not a torch device: pass e.g. 'cuda'"),
    ("device type", {"device": 3.5}, "device=3.5 is not a torch device"),
    ("device_spec name", {"device_spec": "tpu9"}, "device_spec='tpu9' is neither a built-in spec nor a file: pass one of"),
    ("device_spec missing file", {"device_spec": Path("nope.json")}, "device_spec='nope.json' is neither"),
    ("device_spec type", {"device_spec": 3}, "device_spec=3 is not a name, a JSON path or a DeviceSpec"),
    ("cache", {"cache": 3}, "cache=3 is not a bool or a folder: pass True"),
    ("progress", {"progress": "yes"}, "progress='yes' is not a bool: pass True or False"),
    ("optimizer name", {"optimizer": "lbfgs"}, "optimizer='lbfgs' is not one of adam, adamw, sgd, momentum: pass"),
    ("optimizer type", {"optimizer": 3}, "optimizer=3 is neither a name nor a callable: pass one of"),
    ("optimizer factory result", {"optimizer": lambda ps: 3}, "the optimizer factory returned int, not a torch.optim.Optimizer"),
    ("optimizer factory fails", {"optimizer": _boom}, "the optimizer factory failed on a probe parameter: ValueError"),
    ("loss_fn", {"loss_fn": "mse"}, "loss_fn='mse' is not callable: pass loss_fn(output, target)"),
    ("precision", {"precision": "fp8"}, "precision='fp8' is not one of fp32, bf16, fp16: 'bf16'"),
    ("activation_checkpointing word", {"activation_checkpointing": "all"},
     "activation_checkpointing='all' is neither a bool nor a list of stage indices: pass True"),
    ("activation_checkpointing negative", {"activation_checkpointing": [0, -1]},
     "activation_checkpointing=[0, -1] is neither"),
    ("halo_fusion", {"halo_fusion": "always"}, "halo_fusion must be 'auto', 'off' or an integer N >= 2"),
    ("timeout_s zero", {"timeout_s": 0}, "timeout_s must be positive seconds, got 0: pass e.g. timeout_s=300"),
    ("timeout_s bool", {"timeout_s": True}, "timeout_s must be positive seconds, got True"),
    ("backend", {"backend": "tcp"}, "backend='tcp' is not one of "),
    ("backend per device", {"backend": "cpu:gloo,cuda:tcp"}, "backend='cpu:gloo,cuda:tcp' is not one of"),
    ("backend per device, which the launch layer refuses", {"backend": "cpu:gloo,cuda:nccl"},
     "backend='cpu:gloo,cuda:nccl' is not one of nccl, gloo, mpi"),
    ("planner", {"planner": {"time_limit": 5}}, "planner={'time_limit': 5} is not a PlannerOptions: pass e.g."),
]


@pytest.mark.parametrize(("what", "kwargs", "needle"), COMPILE_CASES, ids=[c[0] for c in COMPILE_CASES])
@pytest.mark.parametrize("plan", [False, True], ids=["gpus", "plan file"])
def test_bad_runtime_setting_fails_at_compile(what: str, kwargs: dict[str, Any], needle: str, plan: bool,
                                              tmp_path: Path) -> None:
    where: dict[str, Any] = {"gpus": 2}
    if plan:  # a plan file skips the PlanRequest; the runtime settings are checked all the same
        (tmp_path / "plan.json").write_text("{}")
        where = {"plan": tmp_path / "plan.json"}
    with pytest.raises(nowdl.NowdlError) as e:
        nowdl.compile(_model(), **where, **kwargs)
    first = str(e.value).splitlines()[0]
    assert needle in first, (what, first)


PLANNER_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("time_limit zero", {"time_limit": 0}, "time_limit must be positive seconds, got 0: pass e.g. PlannerOptions(time_limit=60)"),
    ("time_limit nan", {"time_limit": float("nan")}, "time_limit must be positive seconds, got nan"),
    ("time_limit text", {"time_limit": "30"}, "time_limit must be positive seconds, got '30'"),
    ("mip_gap", {"mip_gap": 1.5}, "mip_gap must be a relative gap in [0, 1), got 1.5: pass e.g. PlannerOptions(mip_gap=0.01)"),
    ("mip_gap negative", {"mip_gap": -0.1}, "mip_gap must be a relative gap in [0, 1), got -0.1"),
    ("leaf_modules one type", {"leaf_modules": nn.Conv2d}, "is not a list of nn.Module types or qualified names: pass"),
    ("leaf_modules one name", {"leaf_modules": "enc.0"}, "leaf_modules='enc.0' is not a list"),
    ("leaf_modules junk", {"leaf_modules": [nn.Conv2d, 3]}, "leaf_modules=[<class 'torch.nn.modules.conv.Conv2d'>, 3] is not"),
    ("leaf_modules not a module", {"leaf_modules": [int]}, "is not a list of nn.Module types"),
    ("tracer", {"tracer": "jit"}, "tracer='jit' is not one of auto, fx, export: 'fx'"),
]


@pytest.mark.parametrize(("what", "kwargs", "needle"), PLANNER_CASES, ids=[c[0] for c in PLANNER_CASES])
def test_bad_planner_option(what: str, kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(nowdl.NowdlError) as e:
        PlannerOptions(**kwargs)
    assert needle in str(e.value).splitlines()[0], (what, str(e.value))


def test_good_settings_are_kept_and_frozen(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text("{}")  # only its existence is checked at compile time
    cm = nowdl.compile(_model(), gpus=2, mode="estimate", device="cpu", device_spec=spec, cache=tmp_path,
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), loss_fn=nn.MSELoss(),
                       precision="bf16", activation_checkpointing=range(2), halo_fusion="3", timeout_s=5,
                       backend="gloo", progress=False)
    o = cm.options
    assert (o.device_spec, o.cache, o.halo_fusion, o.timeout_s, o.backend) == (spec, tmp_path, 3, 5, "gloo")
    assert o.activation_checkpointing == (0, 1) and cm.activation_checkpointing == [0, 1]
    assert cm.precision == "bf16" and isinstance(cm.loss_fn, nn.MSELoss) and cm.optimizer_kind == "momentum"
    assert isinstance(cm.optimizer, torch.optim.SGD)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.precision = "fp16"  # type: ignore[misc]
    cm.precision = "fp16"  # the compiled model's setters check again
    assert cm.options.precision == "fp16"
    with pytest.raises(nowdl.NowdlError, match="precision='fp8' is not one of"):
        cm.precision = "fp8"
    with pytest.raises(nowdl.NowdlError, match=r"activation_checkpointing=\(True, 2\)"):
        RuntimeOptions(activation_checkpointing=(True, 2))  # bools are not stage indices
    assert RuntimeOptions(device_spec=" H100 ").device_spec == " H100 "  # names as get_device_spec reads them


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x))


def test_planner_options_reach_the_planner() -> None:
    model = nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), _Block(), nn.Conv2d(1, 1, 1))
    opts = PlannerOptions(time_limit=7, mip_gap=0, leaf_modules=[_Block], tracer="fx")
    cm = nowdl.compile(model, gpus=2, mode="estimate", cache=False, progress=False, planner=opts)
    assert cm.request is not None and (cm.request.time_limit, cm.request.mip_gap) == (7, 0)
    assert cm.planner is opts and opts.leaf_modules == (_Block,)
    t = cm.trace(torch.randn(1, 1, 8, 8))
    assert t.tracer == "fx"
    assert [n.target for n in t.gm.graph.nodes if n.op == "call_module"] == ["0", "1", "2"]  # _Block kept whole


def test_compile_signature_is_typed() -> None:
    """No parameter of nowdl.compile is typed Any; the planner knobs live in PlannerOptions."""
    params = inspect.signature(nowdl.compile).parameters
    assert not [n for n, p in params.items() if "Any" in str(p.annotation)]
    assert not {"time_limit", "mip_gap", "leaf_modules", "tracer"} & set(params)
    assert "planner" in params and len(params) <= 32  # recompute, offload, global_batch, tiles_per_gpu (issue 29)


_LIGHT = """
import json, sys, torch
import nowdl
cm = nowdl.compile(nowdl.models.unet(3, 2, depth=2, base_width=8), gpus=2, mode="estimate", cache=False,
                   progress=False, planner=nowdl.PlannerOptions(time_limit=10))
plan = cm.plan(torch.empty(1, 3, 64, 64, device="meta"))
heavy = ("nowdl.runtime", "matplotlib", "torch.distributed.checkpoint")
print(json.dumps({"ranks": len(plan.ranks),
                  "loaded": sorted(m for m in sys.modules if m == "nowdl.runtime" or m.startswith(heavy))}))
"""


def test_planning_loads_no_runtime_module() -> None:
    """``import nowdl`` and ``compile(...).plan(x)`` load no runtime module, no matplotlib and no
    torch.distributed.checkpoint (they load on the first train, eval or run)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _LIGHT], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"ranks": 2, "loaded": []}, got
