"""In-place writes made out-of-place (nowdl.trace.functional): every kind, data flow kept, views refused."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import nowdl
from nowdl.codegen import build_stages
from nowdl.trace.functional import functionalize, inplace_write
from nowdl.trace.tracer import trace


class Writes(nn.Module):
    """One of each kind of in-place write, each on a value that a later node also reads."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.act = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.conv(x)
        b = self.act(a)           # module with inplace=True: a is b afterwards
        c = self.conv2(b)
        c += a                    # fx records operator.add (fx Proxy has no __iadd__)
        d = F.relu(c, inplace=True)
        d.mul_(0.5)               # method ending in "_"
        e = torch.sigmoid_(self.conv2(d))  # torch function ending in "_"
        return e + a + c          # a and c were written: later readers see the writes


def _writers(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if inplace_write(gm, n) is not None and
            inplace_write(gm, n).written.op != "get_attr"]  # type: ignore[union-attr]


def test_fx_graph_made_functional_and_equal() -> None:
    torch.manual_seed(0)
    m = Writes().eval()
    x = torch.randn(2, 2, 8, 8)
    t = trace(m, (x,))
    assert t.tracer == "fx"
    assert _writers(t.gm) == [], "no in-place write is left"
    assert m.act.inplace, "the model's own module is left as it was"
    with torch.no_grad():
        assert torch.allclose(t.gm(x), m(x), atol=1e-6)


def test_every_kind_is_found() -> None:
    gm = fx.symbolic_trace(Writes())
    found = _writers(gm)
    assert found == ["act", "relu", "mul_", "sigmoid_"], found
    done = functionalize(gm, (torch.randn(1, 2, 8, 8),))
    assert len(done) == 4


def test_setitem_node_made_out_of_place() -> None:
    """fx cannot record ``x[i] = v`` from Python, but a graph built by hand (or another tracer) can."""
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.mul, (x, 2.0))
    g.call_function(operator.setitem, (y, (slice(None), 0), 5.0))
    g.output(g.call_function(torch.add, (y, x)))
    gm = fx.GraphModule(nn.Module(), g)
    inp = torch.randn(2, 3)
    ref = inp * 2.0
    ref[:, 0] = 5.0
    assert functionalize(gm, (inp,)) == ["setitem"]
    assert torch.allclose(gm(inp), ref + inp)


def test_stages_cut_at_every_write_train_like_the_model() -> None:
    """Each stage gets leaf inputs that require grad (as the runtime's received tensors do); an
    in-place write on such a leaf would raise, and a value written after it was sent would differ."""
    torch.manual_seed(0)
    m = Writes()
    x = torch.randn(2, 2, 8, 8)
    cm = nowdl.compile(m, gpus=4, stages=4, progress=False, cache=False)
    plan = cm.plan(x)
    stages = build_stages(cm.trace(x).gm, plan)
    values: dict[str, torch.Tensor] = {"x": x}
    for st in stages:
        leaves = {k: (v.detach().requires_grad_(True) if k != "x" else v) for k, v in values.items()}
        values.update(st.run(leaves))
    out = values[stages[-1].outputs[0]]
    assert torch.allclose(out, m(x), atol=1e-6)


class ViewWrite(nn.Module):
    """Writes through views whose base and sibling views are read afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.conv(x)
        v = a[:, :2]
        w = a[:, 2:]
        v.mul_(2)                 # writes into a's memory
        s = w * 1.0               # a sibling view, read after the write (unchanged by it)
        t = a.transpose(2, 3)
        t[..., 0].add_(3)         # a write through two views
        return a * 2 + v.sum() + s.mean()


def test_write_through_views_becomes_a_written_copy() -> None:
    torch.manual_seed(0)
    m = ViewWrite()
    x = torch.randn(2, 2, 4, 4)
    gm = fx.symbolic_trace(m)
    done = functionalize(gm, (x,))
    assert len(done) == 2
    assert _writers(gm) == []
    assert torch.allclose(gm(x), m(x))
    xg = x.clone().requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    gm(xg).sum().backward()
    m(xr).sum().backward()
    assert torch.allclose(xg.grad, xr.grad)  # type: ignore[arg-type]


def test_slice_assignment_in_an_exported_model() -> None:
    class SliceSet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            e = self.conv(x)
            e[:, 0] = 0.0         # fx cannot trace this; export records select + fill_
            return e * 2

    m = SliceSet()
    x = torch.randn(1, 2, 8, 8)
    t = trace(m, (x,))
    assert t.tracer == "export"
    with torch.no_grad():
        assert torch.allclose(t.gm(x), m(x))


def test_export_graph_inplace_aten_ops_functional() -> None:
    class Exported(nn.Module):
        """fx cannot trace the shape branch; export records aten.relu_ and aten.add_."""

        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 4, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] > 4:
                x = x * 2
            a = self.conv(x)
            b = F.relu(a, inplace=True)
            b += 1
            return a + b

    m = Exported()
    x = torch.randn(1, 2, 8, 8)
    t = trace(m, (x,))
    assert t.tracer == "export"
    mutable = [n for n in t.gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
               and n.target._schema.is_mutable]
    assert mutable == []
    with torch.no_grad():
        assert torch.allclose(t.gm(x), m(x))


def test_functionalize_leaves_the_models_state_alone() -> None:
    class BnNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Conv2d(1, 2, 3)
            self.bn = nn.BatchNorm2d(2)
            self.a = nn.ReLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(self.bn(self.c(x)))

    m = BnNet()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    gm = fx.symbolic_trace(m)
    assert functionalize(gm, (torch.randn(2, 1, 8, 8),)) == ["a"]
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
