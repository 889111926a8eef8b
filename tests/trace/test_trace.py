"""Tracing: fx first, torch.export fallback, validation against eager, clear errors."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import nowdl
from nowdl.errors import TraceError
from nowdl.trace.tracer import fingerprint, trace


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.head(y.mean(dim=(2, 3)))


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.c(x)
        return self.c(x) * 2


class PyRandom(nn.Module):
    """Calls Python's RNG: any tracer bakes a constant, so the graph differs from eager."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(x) * random.random()


class ShapeBranch(nn.Module):
    """fx cannot trace a branch on a shape; torch.export can (it specialises on the shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 8:
            return self.c(x) + 1
        return self.c(x)


def test_fx_trace_matches_eager_and_keeps_mode() -> None:
    m = Small().train()
    t = trace(m, (torch.randn(2, 3, 16, 16),))
    assert t.tracer == "fx"
    assert m.training, "tracing must restore the model's train/eval mode"
    x = torch.randn(2, 3, 16, 16)
    m.eval()
    t.gm.eval()
    assert torch.allclose(m(x), t.gm(x))


def test_fingerprint_stable_and_sensitive() -> None:
    a = trace(Small(), (torch.randn(1, 3, 8, 8),))
    b = trace(Small(), (torch.randn(1, 3, 8, 8),))
    assert a.fingerprint == b.fingerprint  # weights differ, structure does not
    other = Small()
    other.head = nn.Linear(8, 5)
    c = trace(other, (torch.randn(1, 3, 8, 8),))
    assert c.fingerprint != a.fingerprint
    assert fingerprint(a.gm) == a.fingerprint


def test_leaf_modules_keep_submodule_opaque() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Conv2d(3, 3, 1)
            self.b = nn.Conv2d(3, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(x)

    t = trace(Net(), (torch.randn(1, 3, 8, 8),), leaf_modules=[Block])
    targets = [n.target for n in t.gm.graph.nodes if n.op == "call_module"]
    assert targets == ["block"]


def test_fallback_to_export_when_fx_fails() -> None:
    t = trace(ShapeBranch(), (torch.randn(1, 3, 16, 16),))
    assert t.tracer == "export"


def test_untraceable_model_names_line_and_fix() -> None:
    with pytest.raises(TraceError) as e:
        trace(Branchy(), (torch.randn(1, 3, 16, 16),))
    msg = str(e.value)
    assert "Branchy" in msg and "test_trace.py" in msg and "if x.sum() > 0" in msg
    assert "leaf_modules" in msg


def test_graph_that_computes_something_else_is_refused() -> None:
    with pytest.raises(TraceError, match="computes something else"):
        trace(PyRandom(), (torch.randn(1, 3, 16, 16),))


@pytest.mark.parametrize(
    ("x", "needle"),
    [
        (torch.randn(1, 3, 16), "rank 3"),
        (torch.randn(1, 3, 16, 16, dtype=torch.float64), "float64"),
        (torch.randint(0, 3, (1, 3, 16, 16)), "floating point"),
        (torch.randn(1, 5, 16, 16), "5 channels"),
    ],
)
def test_bad_example_inputs(x: torch.Tensor, needle: str) -> None:
    with pytest.raises(TraceError, match=needle):
        trace(Small(), (x,))


def test_unbatched_input_is_refused_though_the_conv_takes_it() -> None:
    # Conv2d runs a rank-3 tensor as one unbatched image: the graph traces, the input feeds the
    # first conv directly, so the rank is still refused (the batch dimension would be wrong)
    for tracer in ("fx", "export"):
        with pytest.raises(TraceError, match="rank 3"):
            trace(Small(), (torch.randn(3, 16, 16),), tracer=tracer)


class TwoImages(nn.Module):
    """A registration net: two 1-channel images concatenated before a 2-channel conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)

    def forward(self, moving: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(torch.cat([moving, fixed], dim=1)))


class FromLatent(nn.Module):
    """A generator: a latent vector, a linear layer, a reshape, then transposed convs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4 * 8 * 8)
        self.up = nn.ConvTranspose2d(4, 1, 4, stride=2, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.up(self.fc(z).view(-1, 4, 8, 8))


@pytest.mark.parametrize(
    ("model", "inputs"),
    [
        (TwoImages(), (torch.randn(1, 1, 16, 16), torch.randn(1, 1, 16, 16))),
        (FromLatent(), (torch.randn(2, 16),)),
    ],
    ids=["two-images", "from-latent"],
)
def test_input_that_reaches_the_first_conv_reshaped_is_accepted(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    # the first input's channels/rank differ from the first conv's, yet the model runs: no
    # refusal (MONAI's VoxelMorph and Generator were refused before), and the plan is exact
    cm = nowdl.compile(model, gpus=2, stages=2, progress=False)
    plan = cm.plan(*inputs)
    assert len(plan.stages) == 2
    model.eval()
    with torch.no_grad():
        assert torch.equal(cm(*inputs), model(*inputs))


def test_wrong_number_of_inputs_names_the_arguments() -> None:
    with pytest.raises(TraceError, match=r"TwoImages.forward takes 2 inputs \(moving, fixed\), 1 given"):
        trace(TwoImages(), (torch.randn(1, 1, 16, 16),))
    with pytest.raises(TraceError, match=r"Small.forward takes at most 1 input \(x\), 2 given"):
        trace(Small(), (torch.randn(1, 3, 16, 16), torch.randn(1, 3, 16, 16)))


class FloatGrid(nn.Module):
    """Keeps a float32 grid as a plain attribute (``.double()`` leaves it), as MONAI's GlobalNet
    does, and loops over the input's shape (fx cannot trace that)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)
        self.grid = torch.ones(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for side in x.shape[2:]:
            assert side == 8
        return self.conv(x) @ self.grid


def test_model_that_fails_by_itself_is_named_as_the_cause(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(TraceError) as e:
        trace(FloatGrid().double(), (torch.randn(1, 1, 8, 8, dtype=torch.float64),))
    first = str(e.value).splitlines()[0]
    assert first.startswith("FloatGrid fails on the example input [[1, 1, 8, 8]] when run as is, without nowdl: RuntimeError"), first
    assert "test_trace.py" in first and "self.grid" in first
    assert "fake_tensor" not in capfd.readouterr().err  # torch's own log of the failing op stays quiet


class SizeGate(nn.Module):
    """Refuses images over 256 pixels a side (as HoVerNet's fast mode refuses all but 256x256)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 256:
            raise ValueError("at most 256 pixels a side")
        return self.conv(x)


def test_input_size_the_model_refuses_is_named_not_blamed_on_tracing() -> None:
    # runs at the small size the check tries, raises at the example's: fx cannot trace the
    # branch, torch.export meets the raise; the error is the model's, not "cannot trace"
    with pytest.raises(TraceError) as e:
        trace(SizeGate(), (torch.empty(1, 1, 1024, 1024, device="meta"),))
    first = str(e.value).splitlines()[0]
    assert first.startswith("SizeGate refuses the example input [[1, 1, 1024, 1024]]: ValueError: at most 256 "
                            "pixels a side at "), first
    assert "cannot trace" not in first and "test_trace.py" in first


class DeepSupervision(nn.Module):
    """Returns an auxiliary head's output beside the main one in training only, as MONAI's
    DynUNet(deep_supervision=True) does."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Conv2d(4, 2, 1)
        self.aux = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.a(x)))
        if self.training:
            return torch.stack([self.head(h), self.aux(h)], dim=1)
        return self.head(h)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_forward_that_branches_on_training_is_traced_as_training_runs_it(tracer: str, mode: str) -> None:
    model = DeepSupervision()
    model.train(mode == "train")  # the mode the user left it in does not decide the graph
    x = torch.randn(2, 1, 8, 8)
    t = trace(model, (x,), tracer=tracer)
    assert "in eval mode" in t.train_only and model.training == (mode == "train")
    model.train()
    t.gm.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(x)
        for k, v in before.items():  # the graph runs the model's own modules: same statistics
            model.state_dict()[k].copy_(v)
        assert torch.allclose(t.gm(x), want)


def test_large_input_validated_on_shrunk_copy() -> None:
    t = trace(Small(), (torch.empty(1, 3, 4096, 4096, device="meta"),))
    assert t.validated_on[0][2] <= 256


class SkipIfTensor(nn.Module):
    """fx sees a Proxy, not a Tensor, skips the concatenation and traces a graph that crashes at
    the channel check (MONAI's BasicUNet does this); torch.export traces it right."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        skip = self.a(x)
        if isinstance(skip, torch.Tensor):
            y = torch.cat([y, skip], dim=1)
        return self.b(y)


def test_fx_graph_that_crashes_falls_back_to_export() -> None:
    m = SkipIfTensor()
    x = torch.randn(1, 3, 16, 16)
    t = trace(m, (x,))
    assert t.tracer == "export"
    m.eval()
    t.gm.eval()
    with torch.no_grad():
        assert torch.allclose(t.gm(x), m(x))


def test_both_tracers_fail_names_module_and_line_detail_apart() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 3, 1)
            self.inner = Branchy()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(self.stem(x))

    with pytest.raises(TraceError) as e:
        trace(Outer(), (torch.randn(1, 3, 16, 16),))
    msg = str(e.value)
    assert "\n" not in msg, "one paragraph"
    assert "module 'inner' (Branchy)" in msg and "if x.sum() > 0" in msg and "leaf_modules" in msg
    assert "Traceback" in e.value.detail, "the full tracebacks are kept for -v"


def test_export_of_an_input_too_large_to_allocate_is_checked_small() -> None:
    """A 16384^2 meta input of a model only torch.export traces: exported on fake tensors at that
    size (no memory), checked by value through an export at a small size with the same nodes."""
    t = trace(ShapeBranch(), (torch.empty(1, 3, 16384, 16384, device="meta"),))
    assert t.tracer == "export"
    assert max(t.validated_on[0][2:]) <= 512
    out = [n for n in t.gm.graph.nodes if n.op == "output"][0]
    assert tuple(out.args[0][0].meta["val"].shape) == (1, 4, 16384, 16384)


def test_export_of_a_large_real_input_is_checked_small() -> None:
    """A real 1x3x1024x1024 example of a model only torch.export traces: exported at that size
    and checked by value at a small one (the model and the graph ran four times at 1024^2 before:
    9.7 of the 11.1 s of tracing MONAI's BasicUNet++ at 512^2)."""
    m = SkipIfTensor()
    x = torch.randn(1, 3, 1024, 1024)
    t = trace(m, (x,))
    assert t.tracer == "export"
    assert max(t.validated_on[0][2:]) <= 512
    with torch.no_grad():
        assert torch.allclose(t.gm.eval()(x), m.eval()(x))


class FixedSize(SkipIfTensor):
    """Runs at one input size only (as UNETR's fixed img_size): the check falls back to it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != 600:
            raise ValueError("this model takes 600x600 images")
        return super().forward(x)


def test_export_of_a_model_that_runs_at_one_size_is_checked_there() -> None:
    t = trace(FixedSize(), (torch.randn(1, 3, 600, 600),))
    assert t.tracer == "export"
    assert t.validated_on[0] == (1, 3, 600, 600)
