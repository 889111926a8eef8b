"""Tests of nowdl.profiler: bytes, FLOPs, attribution, both modes, cache, errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from helpers.profiler_models import SmallNet, TinyUNet
from torch import nn

from nowdl.errors import ProfileError
from nowdl.profiler import (
    BUILTIN_SPECS,
    DeviceSpec,
    NodeCost,
    Profile,
    count_flops,
    get_device_spec,
    profile,
)
from nowdl.profiler.cache import graph_digest

F32 = 4
BYTE_FIELDS = ("out_bytes", "out_shape", "out_dtype", "saved_bytes", "act_bytes", "self_saved",
               "param_bytes", "buffer_bytes", "grad_bytes", "optim_bytes", "flops")


def _both(model: nn.Module, *inputs: torch.Tensor, **kw: object) -> tuple[Profile, Profile]:
    gm = torch.fx.symbolic_trace(model)
    est = profile(gm, inputs, mode="estimate", cache=False, progress=False, **kw)  # type: ignore[arg-type]
    meas = profile(gm, inputs, mode="measure", device="cpu", cache=False, progress=False,
                   repeats=1, warmup=1, **kw)  # type: ignore[arg-type]
    return est, meas


def _assert_same_bytes(a: Profile, b: Profile) -> None:
    assert [n.name for n in a.nodes] == [n.name for n in b.nodes]
    for x, y in zip(a.nodes, b.nodes, strict=True):
        for f in BYTE_FIELDS:
            assert getattr(x, f) == getattr(y, f), (x.name, f, getattr(x, f), getattr(y, f))
    assert a.edges == b.edges


def _one(op: nn.Module, x: torch.Tensor, mode: str = "estimate") -> NodeCost:
    """Profile a single module called on x (input not requiring grad), return its node."""
    gm = torch.fx.symbolic_trace(nn.Sequential(op))
    p = profile(gm, (x,), mode=mode, device="cpu" if mode == "measure" else None, cache=False,
                progress=False, repeats=1, warmup=0)
    (node,) = [n for n in p.nodes if n.op == "call_module"]
    return node


@pytest.mark.parametrize("model,shape", [(SmallNet, (2, 3, 32, 32)),
                                         (TinyUNet, (2, 1, 32, 32))])
def test_estimate_bytes_equal_measure(model: type[nn.Module], shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    est, meas = _both(model(), torch.randn(shape))
    _assert_same_bytes(est, meas)
    assert est.source == "estimate" and est.device == "estimate:h100"
    assert meas.source == "measure" and meas.device == "cpu"
    assert meas.totals()["fwd_s"] > 0 and meas.totals()["bwd_s"] > 0
    assert est.totals()["fwd_s"] > 0 and est.totals()["bwd_s"] > 0


def test_graph_order_edges_and_static_nodes() -> None:
    gm = torch.fx.symbolic_trace(TinyUNet())
    x = torch.randn(1, 1, 32, 32)
    p = profile(gm, (x,), cache=False, progress=False, optimizer="sgd", fingerprint="fp")
    names = [n.name for n in gm.graph.nodes]
    assert [n.name for n in p.nodes] == names
    assert p.edges == [(i.name, n.name) for n in gm.graph.nodes for i in n.all_input_nodes]
    ph, out = p.nodes[0], p.nodes[-1]
    assert ph.op == "placeholder" and ph.out_bytes == x.numel() * F32 and ph.fwd_s == 0
    assert ph.out_shape == (1, 1, 32, 32)
    assert out.op == "output" and out.time_s == 0 and out.out_bytes == 0
    assert p.input_shapes == [[1, 1, 32, 32]] and p.fingerprint == "fp"
    assert p.optimizer == "sgd" and p.dtype == "float32" and p.wall_s > 0
    n_params = sum(t.numel() for t in gm.parameters()) * F32
    assert p.totals()["param_bytes"] == n_params == p.totals()["grad_bytes"]
    assert p.totals()["optim_bytes"] == 0
    cat = next(n for n in p.nodes if n.target == "torch.cat")
    # cat saves nothing itself; the conv after it saves its output, charged to the cat
    assert cat.saved_bytes == 0 and not cat.self_saved and cat.act_bytes == cat.out_bytes
    assert Profile.from_json(p.to_json()).nodes == p.nodes


def test_act_bytes_each_storage_once() -> None:
    """Sum of act_bytes == bytes of the distinct saved storages (inplace ReLU included)."""
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(SmallNet())
    p = profile(gm, (torch.randn(2, 3, 32, 32),), cache=False, progress=False)
    conv, bn, relu, pool, fc = (p[k] for k in ("conv", "bn", "relu", "pool", "fc"))
    x_bytes = 2 * 3 * 32 * 32 * F32
    feat = 2 * 8 * 32 * 32 * F32
    assert p["x"].act_bytes == x_bytes  # conv saves x: charged to the placeholder
    assert conv.act_bytes == feat  # bn saves conv's output
    # bn's output is saved by the in-place relu (and by pool): charged once, to bn, with stats
    assert bn.act_bytes == feat + 2 * 8 * F32 and relu.act_bytes == 0 and relu.self_saved
    # pool saves its input (bn's storage) and int64 indices; fc saves the flattened pool output
    assert pool.saved_bytes == feat + 2 * 8 * 16 * 16 * 8
    assert pool.act_bytes == 2 * 8 * 16 * 16 * 8 + 2 * 8 * 16 * 16 * F32
    assert fc.saved_bytes == 2 * 8 * 16 * 16 * F32 and fc.act_bytes == 0
    assert p.totals()["act_bytes"] == x_bytes + 2 * feat + 64 + 2 * 8 * 16 * 16 * (8 + F32)


@pytest.mark.parametrize("mode", ["estimate", "measure"])
def test_conv_hand_formulas(mode: str) -> None:
    n, cin, cout, h, k, g, s = 2, 4, 6, 17, 3, 2, 2
    conv = nn.Conv2d(cin, cout, k, stride=s, groups=g, bias=True)
    x = torch.randn(n, cin, h, h)
    c = _one(conv, x, mode)
    ho = (h - k) // s + 1
    assert c.out_shape == (n, cout, ho, ho)
    assert c.flops == 2 * n * cout * ho * ho * (cin // g) * k * k  # bias not counted
    assert c.saved_bytes == x.numel() * F32  # conv saves its input (weight is a parameter)
    assert c.param_bytes == (cout * cin // g * k * k + cout) * F32 == c.grad_bytes
    assert c.optim_bytes == 2 * c.grad_bytes  # adam
    assert c.out_bytes == n * cout * ho * ho * F32


@pytest.mark.parametrize("mode", ["estimate", "measure"])
def test_linear_relu_pool_hand_formulas(mode: str) -> None:
    x = torch.randn(5, 7)
    lin = _one(nn.Linear(7, 3), x, mode)
    assert lin.flops == 2 * 5 * 7 * 3 and lin.saved_bytes == x.numel() * F32
    y = torch.randn(2, 3, 8, 8, requires_grad=True)  # else nothing needs grad: nothing saved
    relu = _one(nn.ReLU(), y, mode)
    assert relu.flops == y.numel() and relu.saved_bytes == y.numel() * F32 and relu.self_saved
    assert relu.act_bytes == y.numel() * F32
    pool = _one(nn.MaxPool2d(2), y, mode)
    assert pool.flops == (y.numel() // 4) * 4
    assert pool.saved_bytes == y.numel() * F32 + (y.numel() // 4) * 8  # input + int64 indices
    avg = _one(nn.AvgPool2d(2), y, mode)
    assert avg.flops == y.numel() and avg.saved_bytes == y.numel() * F32  # saves its input


@pytest.mark.parametrize("mode", ["estimate", "measure"])
def test_batchnorm_hand_formulas(mode: str) -> None:
    x = torch.randn(4, 3, 8, 8)
    bn = nn.BatchNorm2d(3)
    c = _one(bn, x, mode)
    assert c.flops == 8 * x.numel()  # training: 8 per element
    assert c.saved_bytes == x.numel() * F32 + 2 * 3 * F32  # input + mean and invstd
    assert c.param_bytes == 2 * 3 * F32 and c.buffer_bytes == (2 * 3) * F32 + 8
    assert not c.self_saved
    assert torch.equal(bn.running_mean, torch.zeros(3)) and int(bn.num_batches_tracked) == 0
    bn.eval()
    e = _one(bn, x, mode)
    assert e.flops == 2 * x.numel()  # eval: scale + shift


def test_estimate_accepts_meta_inputs() -> None:
    gm = torch.fx.symbolic_trace(SmallNet())
    real = profile(gm, (torch.randn(2, 3, 32, 32),), cache=False, progress=False)
    meta = profile(gm, (torch.empty(2, 3, 32, 32, device="meta"),), cache=False, progress=False)
    _assert_same_bytes(real, meta)


def test_count_flops() -> None:
    conv = nn.Conv2d(3, 4, 3)
    x = torch.randn(1, 3, 10, 10)
    assert count_flops(conv, x) == 2 * 4 * 8 * 8 * 3 * 9
    assert count_flops(torch.relu, x) == x.numel()


def test_shared_parameter_charged_once_and_optimizers() -> None:
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(torch.relu(self.conv(x)))

    gm = torch.fx.symbolic_trace(Shared())
    x = torch.randn(1, 2, 8, 8)
    for opt, states in (("sgd", 0), ("momentum", 1), ("adam", 2), ("AdamW", 2)):
        p = profile(gm, (x,), cache=False, progress=False, optimizer=opt)
        first, second = [n for n in p.nodes if n.op == "call_module"]
        assert first.param_bytes == (2 * 2 * 9 + 2) * F32 and second.param_bytes == 0
        assert first.optim_bytes == states * first.grad_bytes


def test_workspace_of_transient_intermediates() -> None:
    class Chain(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x * 2) + 1

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.chain = Chain()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.chain(x)

    class Leafy(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, Chain) or super().is_leaf_module(m, qualname)

    root = Outer()
    gm = torch.fx.GraphModule(root, Leafy().trace(root))
    x = torch.randn(4, 256, requires_grad=True)
    for mode in ("estimate", "measure"):
        p = profile(gm, (x,), mode=mode, device="cpu" if mode == "measure" else None,
                    cache=False, progress=False, repeats=1, warmup=0)
        # forward: x*2 and sin(x*2) are transient next to the output -> at least one tensor
        assert p["chain"].workspace_bytes >= x.numel() * F32, mode


def test_measure_leaves_model_untouched() -> None:
    torch.manual_seed(0)
    model = SmallNet()
    gm = torch.fx.symbolic_trace(model)
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    x = torch.randn(2, 3, 32, 32)
    rng = torch.get_rng_state()
    profile(gm, (x,), mode="measure", device="cpu", cache=False,
            progress=False, repeats=2, warmup=1)
    after = gm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in gm.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_cache_roundtrip_corrupt_and_atomic(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                            ) -> None:
    gm = torch.fx.symbolic_trace(SmallNet())
    x = torch.randn(1, 3, 32, 32)
    p1 = profile(gm, (x,), cache=tmp_path, progress=False, fingerprint="a")
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and not list(tmp_path.glob(".*tmp"))
    p2 = profile(gm, (x,), cache=tmp_path, progress=False, fingerprint="a")
    assert p2.to_dict() == p1.to_dict()  # wall_s equal too: served from the cache
    profile(gm, (x,), cache=tmp_path, progress=False, fingerprint="a", optimizer="sgd")
    profile(gm, (x,), cache=tmp_path, progress=False, fingerprint="b")
    assert len(list(tmp_path.glob("*.json"))) == 3
    files[0].write_text('{"format": "nowdl.profile", "nodes": [')
    with caplog.at_level(logging.WARNING, logger="nowdl.profiler.cache"):
        p3 = profile(gm, (x,), cache=tmp_path, progress=False, fingerprint="a")
    assert "corrupt" in caplog.text
    assert [n.saved_bytes for n in p3.nodes] == [n.saved_bytes for n in p1.nodes]
    json.loads(files[0].read_text())  # rewritten whole


def test_cache_env_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOWDL_CACHE_DIR", str(tmp_path / "c"))
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.ReLU()))
    profile(gm, (torch.randn(2, 2),), progress=False)
    assert len(list((tmp_path / "c").glob("*.json"))) == 1


def test_graph_digest_distinguishes_models() -> None:
    a = torch.fx.symbolic_trace(nn.Sequential(nn.Conv2d(1, 2, 3)))
    b = torch.fx.symbolic_trace(nn.Sequential(nn.Conv2d(1, 3, 3)))
    assert graph_digest(a) != graph_digest(b)


def test_bad_arguments() -> None:
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.ReLU()))
    x = torch.randn(2, 2)
    with pytest.raises(ProfileError, match="estimate"):
        profile(gm, (x,), mode="guess", cache=False)
    with pytest.raises(ProfileError, match="momentum"):
        profile(gm, (x,), optimizer="lbfgs", cache=False)
    with pytest.raises(ValueError, match="h100"):
        profile(gm, (x,), device_spec="tpu9", cache=False)


def test_failing_node_names_node() -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    gm = torch.fx.symbolic_trace(Bad())
    for mode in ("estimate", "measure"):
        with pytest.raises(ProfileError, match=r"fc.*torch\.nn\.modules\.linear\.Linear") as ei:
            profile(gm, (torch.randn(2, 5),), mode=mode, device="cpu" if mode == "measure"
                    else None, cache=False, progress=False)
        assert "RuntimeError" in str(ei.value) and "[2, 5]" in str(ei.value).replace("2x5", "[2, 5]")


def test_device_specs(tmp_path: Path) -> None:
    assert {"v100", "a100", "h100", "h200"} <= set(BUILTIN_SPECS)
    h100 = get_device_spec("H100")
    assert get_device_spec(None) is h100
    assert h100.flops_for(torch.bfloat16) == h100.bf16_flops
    assert h100.flops_for("float32") == h100.fp32_flops
    assert h100.flops_for(torch.float32, tf32=True) == h100.tf32_flops
    assert DeviceSpec.from_json(h100.to_json()) == h100
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**h100.to_dict(), "name": "mine", "mem_bw": 1e12}))
    assert get_device_spec(path).mem_bw == 1e12
    assert get_device_spec(str(path)).name == "mine"
    path.write_text(json.dumps({**h100.to_dict(), "mem_bw": -1}))
    with pytest.raises(ValueError, match="mem_bw"):
        get_device_spec(path)
    path.write_text(json.dumps({**h100.to_dict(), "bogus": 1}))
    with pytest.raises(ValueError, match="bogus"):
        get_device_spec(path)
    with pytest.raises(ValueError, match="a100"):
        get_device_spec("tpu")
    cpu = get_device_spec("cpu", cache_dir=tmp_path)
    assert cpu.fp32_flops > 0 and cpu.mem_bw > 0
    assert list(tmp_path.glob("cpu-spec-*.json"))
    assert get_device_spec("cpu", cache_dir=tmp_path) == cpu


def test_estimate_uses_spec() -> None:
    gm = torch.fx.symbolic_trace(SmallNet())
    x = torch.randn(2, 3, 32, 32)
    v100 = profile(gm, (x,), device_spec="v100", cache=False, progress=False)
    h200 = profile(gm, (x,), device_spec="h200", cache=False, progress=False)
    assert v100.device == "estimate:v100"
    assert v100.totals()["fwd_s"] > h200.totals()["fwd_s"] > 0
    conv = v100["conv"]
    spec = BUILTIN_SPECS["v100"]
    assert conv.fwd_s >= conv.flops / spec.fp32_flops


def test_monai_unet_both_modes() -> None:
    nets = pytest.importorskip("monai.networks.nets")
    torch.manual_seed(0)
    model = nets.UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(8, 16, 32),
                      strides=(2, 2))
    est, meas = _both(model, torch.randn(2, 1, 32, 32))
    _assert_same_bytes(est, meas)
    assert est.totals()["act_bytes"] > 0


def test_train_mode_batchnorm_and_dropout() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.ReLU())
    est, meas = _both(model.train(), torch.randn(2, 1, 16, 16))
    _assert_same_bytes(est, meas)
    drop = est["_2"]
    # the mask: float on CPU (input * noise), bool with CUDA's fused native_dropout
    assert drop.saved_bytes == 4 * 2 * 14 * 14 * F32 and drop.act_bytes == drop.saved_bytes


def test_functional_params_and_inplace_ops() -> None:
    """get_attr parameters, ``x += y`` and ``relu_`` methods: same bytes in both modes."""

    class Func(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 2, 3, 3))
            self.register_buffer("scale", torch.ones(1, 4, 1, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.nn.functional.conv2d(x, self.w, padding=1)
            z = y * self.scale
            z += y
            return z.relu_().sigmoid()

    torch.manual_seed(0)
    est, meas = _both(Func(), torch.randn(2, 2, 8, 8))
    _assert_same_bytes(est, meas)
    w = est["w"]
    assert w.op == "get_attr" and w.param_bytes == 4 * 2 * 9 * F32 == w.grad_bytes
    assert est["scale"].buffer_bytes == 4 * F32 and est["scale"].grad_bytes == 0
    feat = 2 * 4 * 8 * 8 * F32
    assert est["conv2d"].saved_bytes == 2 * 2 * 8 * 8 * F32  # input only: weight is static
    # fx records ``z += y`` as add; relu_ runs in place on add's storage and saves it
    # (charged to add); mul by a buffer saves only the buffer; sigmoid saves its output
    assert est["relu_"].self_saved and est["relu_"].act_bytes == 0
    assert est["mul"].saved_bytes == 0
    assert est["add"].act_bytes == feat and est["sigmoid"].act_bytes == feat
    assert est.totals()["act_bytes"] == 2 * 2 * 8 * 8 * F32 + 2 * feat
