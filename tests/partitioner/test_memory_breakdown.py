"""The plan's memory breakdown adds up to each stage's predicted peak (pipeline, MASTER, spatial)."""

from __future__ import annotations

import pytest
import torch

import nowdl
from nowdl.partitioner.costs.memory_breakdown import MEMORY_KEYS


@pytest.mark.parametrize(
    "kw",
    [dict(gpus=4, stages=4), dict(gpus=4, stages=4, replicas=2, dp=1),
     dict(gpus=6, stages=2, spatial_parts=[4, 2], dp=1, replicas=1),
     dict(gpus=4, stages=4, micro_batches=8, schedule="zb", dp=1, replicas=1)],
    ids=["pipeline", "master", "spatial", "zb"],
)
def test_breakdown_sums_to_peak(kw: dict[str, object]) -> None:
    model = nowdl.models.unet(depth=2, base_width=8)
    plan = nowdl.compile(model, balance="memory", mode="estimate", **kw).plan(  # type: ignore[arg-type]
        torch.empty(1, 3, 64, 64, device="meta"))
    for s in plan.stages:
        q = s.predicted
        assert set(MEMORY_KEYS) <= set(q)
        static = q["weight_bytes"] + q["grad_bytes"] + q["optim_bytes"]
        assert static == pytest.approx(q["static_bytes"])
        held = (q["inflight"] * q["saved_bytes"] + q["recv_held"] * q["recv_bytes"]
                + q["send_held"] * q["send_bytes"])
        total = static + held + q["workspace_bytes"] + q["wait_bytes"]
        assert 0 <= q["freed_bytes"] <= q["saved_bytes"] + q["workspace_bytes"]
        assert total - q["freed_bytes"] == pytest.approx(q["peak_bytes"], rel=1e-9)
    assert plan.predicted["peak_bytes"] == max(r.predicted_peak_bytes for r in plan.ranks)
    if kw.get("replicas", 1) == 1 and not kw.get("spatial_parts"):  # 1F1B/zb over 4 stages: long skips wait
        assert any(s.predicted["wait_bytes"] > 0 for s in plan.stages)
    again = nowdl.Plan.from_json(plan.to_json())
    assert again.stages[0].predicted["saved_bytes"] == plan.stages[0].predicted["saved_bytes"]


def test_held_buffers_by_hand() -> None:
    """[Note: held buffers]: what a stage holds at its peak, counted by hand."""
    from nowdl.partitioner.costs.held_tensors import held_buffers

    # 1F1B, K=2, M=4, last stage (F0 B0 F1 B1 ...): 1 in flight + F1's input posted during B0;
    # output gradients: B3's buffer posted during B2 (cool-down), and the pool keeps both
    assert held_buffers("1f1b", 4, 1) == (2.0, 2.0)
    # 1F1B, K=2, M=4, stage 0 (F0 F1 B0 F2 ...): 2 in flight + F2's input posted during B0
    assert held_buffers("1f1b", 4, 2) == (3.0, 2.0)
    # 1F1B with M <= K - s runs all forwards first: like GPipe
    assert held_buffers("1f1b", 2, 2) == (2.0, 2.0)
    # GPipe: all M in flight; B1's output gradients posted during B0
    assert held_buffers("gpipe", 4, 4) == (4.0, 2.0)
    # one micro-batch: nothing is posted ahead
    assert held_buffers("gpipe", 1, 1) == (1.0, 1.0)


def test_held_factors_in_a_tiny_plan() -> None:
    """The stage memory of a 3-node chain split in two, with the runtime's factors, by hand."""
    from nowdl.partitioner.costs.held_tensors import held_buffers
    from nowdl.partitioner.costs.problem import NodeVectors, Problem, StageSpec, evaluate

    # a -> b -> c; b's output (out=10 bytes) crosses from stage 0 to stage 1
    vec = NodeVectors(act=[100.0, 50.0, 30.0], time=[1.0, 1.0, 1.0], workspace=[0.0, 7.0, 3.0],
                      out=[0.0, 10.0, 0.0])
    specs = []
    for n in (2, 1):  # 1F1B, K=2, M=4: inflight 2 and 1
        r, s = held_buffers("1f1b", 4, n)
        specs.append(StageSpec(inflight=n, recv_held=r, send_held=s))
    problem = Problem(names=["a", "b", "c"], edges=[(0, 1), (1, 2)], static=[5.0, 6.0, 7.0],
                      variants={"plain": vec}, stages=specs)
    mem, _ = evaluate(problem, [0, 0, 1])
    # stage 0: static 11 + 2 x saved 150 + 2 x sent 10 (gradient buffers) + workspace 7
    # stage 1: static 7 + 1 x saved 30 + 2 x received 10 + workspace 3
    assert mem == [11 + 300 + 20 + 7, 7 + 30 + 20 + 3]
    # without the factors every boundary tensor is held inflight times (the older model)
    old = Problem(names=["a", "b", "c"], edges=[(0, 1), (1, 2)], static=[5.0, 6.0, 7.0],
                  variants={"plain": vec}, stages=[StageSpec(inflight=2), StageSpec(inflight=1)])
    assert evaluate(old, [0, 0, 1])[0] == [11 + 300 + 20 + 7, 7 + 30 + 10 + 3]


def test_backward_grad_bytes_by_hand() -> None:
    """Gradients alive during each node's backward, for x -> conv -> relu -> add(conv, relu) -> out."""
    from nowdl.partitioner.costs.held_tensors import backward_grad_bytes

    ops = ["placeholder", "call_module", "call_function", "call_function", "output"]
    out = [12, 40, 40, 40, 0]
    edges = [(0, 1), (1, 2), (1, 3), (2, 3), (3, 4)]
    # conv: its output's gradient only (x gets none); relu: output + conv's; add: output + conv's +
    # relu's; integer outputs get no gradient
    assert backward_grad_bytes(ops, out, [True] * 5, edges) == [0.0, 40.0, 80.0, 120.0, 0.0]
    assert backward_grad_bytes(ops, out, [True, True, False, True, True], edges) == [0.0, 40.0, 0.0, 80.0, 0.0]


def test_backward_grad_bytes_cat_is_views() -> None:
    """A cat's input gradients are views of its output's: only that gradient counts."""
    from nowdl.partitioner.costs.held_tensors import backward_grad_bytes

    ops = ["placeholder", "call_module", "call_module", "call_function", "output"]
    out = [12, 40, 40, 80, 0]
    edges = [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4)]
    targets = ["x", "torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv2d", "torch.cat", "output"]
    assert backward_grad_bytes(ops, out, [True] * 5, edges) == [0.0, 40.0, 40.0, 160.0, 0.0]
    assert backward_grad_bytes(ops, out, [True] * 5, edges, targets) == [0.0, 40.0, 40.0, 80.0, 0.0]


def test_cat_is_recognised_in_both_tracers_profiles() -> None:
    """The profiler's name for a cat, from fx (torch.cat) and from torch.export (aten.cat), is one
    of VIEW_GRAD_TARGETS, so a cat's backward is charged its output's gradient only either way."""
    import torch

    from nowdl.partitioner.costs.held_tensors import VIEW_GRAD_TARGETS
    from nowdl.profiler import profile
    from nowdl.trace.tracer import trace

    class Cat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Conv2d(2, 2, 3, padding=1)
            self.b = torch.nn.Conv2d(2, 2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.a(x), self.b(x)], dim=1)

    x = torch.randn(1, 2, 8, 8)
    for tracer in ("fx", "export"):
        t = trace(Cat(), (x,), tracer=tracer)
        prof = profile(t.gm, (x,), mode="estimate", device_spec="h100", cache=False, progress=False)
        cats = [n.target for n in prof.nodes if "cat" in n.target.split(".")[-1]]
        assert cats and all(c in VIEW_GRAD_TARGETS for c in cats), (tracer, cats)


def test_freed_by_the_peak_by_hand() -> None:
    """[Note: freed by the peak] on a 4-node chain in one stage: saved 100, 50, 30, 20 bytes,
    workspaces 0, 200, 10, 40: the peak is at node b (150 saved so far + 200), not 200 + 200."""
    from nowdl.partitioner.config.candidate import Candidate
    from nowdl.partitioner.costs.costmodel import Costs
    from nowdl.partitioner.costs.memory_breakdown import stage_memory
    from nowdl.profiler.cost import NodeCost, Profile

    acts, wss = [100, 50, 30, 20], [0, 200, 10, 40]
    nodes = [NodeCost(name=n, op="call_module", target="m", act_bytes=a, workspace_bytes=w)  # out_bytes 0:
             for n, a, w in zip("abcd", acts, wss, strict=True)]                          # no gradient transients
    prof = Profile(nodes=nodes, edges=[("a", "b"), ("b", "c"), ("c", "d")], source="estimate", device="cpu")
    cand = Candidate(stages=1, micro_batches=2, schedule="gpipe", replicas=1, dp=1, parts=1, front=0, back=0,
                     slice="square")
    (mem,) = stage_memory(Costs(profile=prof, rules={}, link_bw=1e9, mem_cap=None), cand, [0, 0, 0, 0])
    assert (mem["saved_bytes"], mem["workspace_bytes"]) == (200, 200)
    assert mem["freed_bytes"] == 200 + 200 - (150 + 200)


def test_tiled_max_pool_charges_no_indices() -> None:
    """A tiled max pool saves its input window and recomputes (runtime/spatial/window_op.py): its
    tiled activation is its output tile, without the int64 indices the plain pool saves."""
    from torch import nn

    from nowdl.partitioner.costs.costmodel import Costs, _tiled_vectors
    from nowdl.partitioner.spatial.tileable import spatial_rules

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1))
    cm = nowdl.compile(model, gpus=2, mode="estimate", progress=False, cache=False)
    x = torch.empty(1, 3, 64, 64, device="meta")
    t, prof = cm.trace(x), cm.profile(x)
    costs = Costs(profile=prof, rules=spatial_rules(t.gm, prof.out_ranks()), link_bw=1e11, mem_cap=None)
    vec = _tiled_vectors(costs, 2, "square")
    i = next(j for j, n in enumerate(prof.nodes) if "MaxPool" in n.target)
    pool = prof.nodes[i]
    assert pool.act_bytes == pytest.approx(3 * pool.out_bytes)  # plain: output (float32) + indices (int64)
    assert vec.act[i] == pytest.approx(pool.out_bytes / 2)
    relu = prof.nodes[i - 1]
    assert vec.act[i - 1] == pytest.approx(relu.act_bytes / 2)  # other nodes as before


def test_fused_runs_raise_the_predicted_peak_by_their_window() -> None:
    """[Note: fused workspace]: a fused halo run's first op holds its window's gradient and its
    input gradient over the window; the plan charges it, consistently in stages and ranks."""
    from nowdl.partitioner.costs.costmodel import dtype_bytes, grad_workspace
    from nowdl.partitioner.search.halo_fusion import fused_workspace
    from nowdl.partitioner.spatial.tileable import halo_elements

    def plan(fusion: str) -> tuple[nowdl.Plan, nowdl.CompiledModel]:
        cm = nowdl.compile(nowdl.models.unet(1, 2, depth=2, base_width=8), gpus=2, stages=1, spatial_parts=2,
                           slice="square", micro_batches=2, dp=1, replicas=1, mode="estimate", halo_fusion=fusion,
                           progress=False, cache=False)
        return cm.plan(torch.empty(1, 1, 256, 256, device="meta")), cm

    off, _ = plan("off")
    fused, cm = plan("auto")
    st, st0 = fused.stages[0], off.stages[0]
    assert st.fused and not st0.fused
    x = torch.empty(1, 1, 256, 256, device="meta")
    gm, prof = cm.trace(x).gm, cm.profile(x)
    ws = fused_workspace(gm, [(s.nodes, s.parts, s.grid) for s in fused.stages], [s.fused for s in fused.stages], prof)
    assert set(ws) == {c[0] for c in st.fused}
    grads = dict(zip((n.name for n in prof.nodes), grad_workspace(prof), strict=True))
    for c in st.fused:  # by hand: gradients / P + the window (tile + deep halo) + the halo again
        src = next(iter(u for u, v in prof.edges if v == c[0]))
        shape = prof[src].out_shape
        assert shape is not None
        assert ws[c[0]] > grads[c[0]] / 2 + prof[src].out_bytes / 2
        halo = (ws[c[0]] - grads[c[0]] / 2 - prof[src].out_bytes / 2) / 2
        assert halo == pytest.approx(halo_elements(shape, st.grid, _deep(gm, c, shape, st.grid))
                                     * dtype_bytes(prof[src].out_dtype))
    q, q0 = st.predicted, st0.predicted
    assert q["workspace_bytes"] == pytest.approx(max([q0["workspace_bytes"], *ws.values()]))
    assert q["workspace_bytes"] > q0["workspace_bytes"]
    delta = (q["workspace_bytes"] - q0["workspace_bytes"]) - (q["freed_bytes"] - q0["freed_bytes"])
    assert q["peak_bytes"] == pytest.approx(q0["peak_bytes"] + delta)
    assert q["fused_bytes"] == pytest.approx(q["workspace_bytes"] - q0["workspace_bytes"]) and q0["fused_bytes"] == 0
    assert q["peak_bytes"] > q0["peak_bytes"]
    assert [r.predicted_peak_bytes for r in fused.ranks] == pytest.approx([q["peak_bytes"]] * 2)
    assert fused.predicted["peak_bytes"] == pytest.approx(q["peak_bytes"])


def _deep(gm: torch.fx.GraphModule, chain: list[str], shape: list[int], grid: list[int]) -> tuple[int, ...]:
    from nowdl.geometry import chain_geometry

    mods = dict(gm.named_modules())
    nodes = {n.name: n for n in gm.graph.nodes}
    geo = chain_geometry([mods[str(nodes[c].target)] for c in chain], shape[2:], grid)
    return tuple(max(lo, hi) for lo, hi in geo["halo"])
