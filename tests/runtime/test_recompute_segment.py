"""A recomputed segment ([Note: recompute segment] in runtime/pipeline/segment.py) trains exactly
what one process trains: 3 Adam steps on 2 gloo processes, float64, every parameter and buffer
(running statistics and ``num_batches_tracked`` included) within 1e-9; and it drops only the
segment's saved tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.distributed import run_workers
from helpers.reference import train_reference
from torch import nn

import nowdl
from nowdl.errors import PlanError
from nowdl.runtime.pipeline.recompute import Recompute
from nowdl.runtime.pipeline.segment import SegmentRun, segment_names

STEPS = 3
LR = 1e-2
SEED = 7
CFG = {"stages": 2, "spatial_parts": 1, "dp": 1, "replicas": 1, "micro_batches": 2, "schedule": "gpipe"}


class Net(nn.Module):
    """BatchNorm conv blocks, then a head with dropout (when ``p`` > 0) between two linears."""

    def __init__(self, p: float) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

        self.body = nn.Sequential(block(2, 4), block(4, 4), nn.MaxPool2d(2), block(4, 8), block(8, 8))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(p), nn.Linear(8 * 8 * 8, 32), nn.Tanh(), nn.Dropout(p),
                                  nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _make(p: float) -> nn.Module:
    torch.manual_seed(0)
    return Net(p).double()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    total = CFG["micro_batches"]
    return torch.randn(total, 2, 16, 16, generator=g, dtype=torch.float64), torch.randint(0, 3, (total,), generator=g)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR)


def _segment(nodes: list[str], upto: str) -> list[int]:
    """[0, stop): the stage's nodes up to and including the first whose name contains ``upto``;
    [2, stop) for ``"+" + upto`` (a segment after the stage's first nodes: the runtime's
    node-by-node path)."""
    start = 2 if upto.startswith("+") else 0
    stop = next(i for i, n in enumerate(nodes) if upto.lstrip("+") in n) + 1
    assert start < stop < len(nodes), (upto, nodes)  # a segment, not the whole stage
    return [start, stop]


_Run = tuple[list[float], dict[str, torch.Tensor], list[int]]


def _worker(rank: int, world: int, p: float, stage: int, upto: str | float, precision: str = "fp32"
            ) -> tuple[_Run, _Run]:
    """The run with the segment, and its twin: the same plan without recompute, in the same processes."""
    return _train(rank, world, p, stage, upto, precision), _train(rank, world, p, stage, None, precision)


def _train(rank: int, world: int, p: float, stage: int, upto: str | float | None, precision: str = "fp32") -> _Run:
    """``upto``: the node name the segment ends at, or the cap under which the planner chooses it;
    ``precision`` other than fp32: a float32 model under that autocast (it casts float32 only)."""
    cap = {"recompute": "auto", "gpu_memory": upto} if isinstance(upto, float) else {"recompute": "off"}
    model = _make(p) if precision == "fp32" else _make(p).float()

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _data(step)
        return (x, y) if precision == "fp32" else (x.float(), y)

    cm = nowdl.compile(model, gpus=world, mode="estimate", optimizer=_adam, loss_fn=nn.CrossEntropyLoss(),
                       cache=False, progress=False, timeout_s=90, offload="off", precision=precision, **cap, **CFG)
    x0, y0 = data(0)
    plan = cm.plan(x0[:1], target=y0[:1])
    st = plan.stages[stage]
    if isinstance(upto, str):
        st.recompute, st.recompute_segment = True, _segment(st.nodes, upto)
    plan.validate()
    torch.manual_seed(SEED)
    losses = [cm.train_step(*data(step)) for step in range(STEPS)]
    segments = cm._trainer.engine.runner.segments
    assert segments.keys() == ({stage} if rank in st.ranks and upto else set())
    if stage in segments:  # a prefix runs as two generated modules, another segment node by node
        assert (segments[stage].split is None) == (isinstance(upto, str) and upto.startswith("+"))
    return losses, cm.state_dict(), st.recompute_segment


def _planned_cap() -> float:
    """A cap between the solvers' peak without recompute and with every stage recomputed whole."""
    def bound(**kw: Any) -> float:
        cm = nowdl.compile(_make(0.0), gpus=2, mode="estimate", cache=False, progress=False, offload="off", **kw, **CFG)
        plan = cm.plan(_data(0)[0][:1])
        return max(s.predicted["peak_bytes"] + s.predicted["freed_bytes"] for s in plan.stages)

    p0, p1 = bound(recompute="off"), bound(recompute="on")
    assert p1 < p0
    return (p0 + p1) / 2


@pytest.mark.parametrize(("p", "stage", "upto"), [(0.0, 0, "body_1_1"), (0.3, 1, "head_4"), (0.0, 1, None),
                                                 (0.0, 0, "+body_1_1")],
                         ids=["batchnorm-stage0", "dropout-stage1", "planner-chosen", "batchnorm-middle"])
def test_segment_trains_exactly_as_one_process(p: float, stage: int, upto: str | None) -> None:
    """Stage 0's first BatchNorm blocks (their running statistics update once), stage 1's head up
    to its second dropout (the recompute draws the forward's masks), or the prefix of stage 1 the
    planner chooses under a cap ("auto"). Each rank draws its own random numbers, so the dropout
    run equals its twin without recompute (as in test_recompute_exact.py), not one process; the
    others equal both."""
    results = run_workers(_worker, 2, p, stage, upto if upto is not None else _planned_cap(), timeout_s=400)
    (losses, sd, seg), (twin_losses, twin_sd, _) = results[0]
    assert results[1][0][0] == losses and len(seg) == 2 and seg[1] > 1, seg
    assert twin_losses == losses
    for k, want in twin_sd.items():
        torch.testing.assert_close(sd[k], want, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")
    if p > 0:
        return
    model = _make(p)
    torch.manual_seed(SEED)
    ref_losses, ref_sd = train_reference(model, _adam(model.parameters()), nn.CrossEntropyLoss(), _data,
                                         CFG["micro_batches"], STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-9, atol=1e-12)
    assert list(sd) == list(ref_sd)
    for k, want in ref_sd.items():
        torch.testing.assert_close(sd[k], want, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")


def test_segment_under_bf16_equals_the_same_plan_without_recompute() -> None:
    """Under bf16 autocast the segment's recompute runs in the same autocast: losses and every state
    entry equal the same plan without recompute (bf16 is not compared with one float process)."""
    (losses, sd, seg), (twin_losses, twin_sd, _) = run_workers(_worker, 2, 0.0, 0, "body_1_1", "bf16",
                                                               timeout_s=400)[0]
    assert len(seg) == 2 and losses == twin_losses
    for k, want in twin_sd.items():
        torch.testing.assert_close(sd[k], want, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")


def _saved(gm: torch.fx.GraphModule, x: torch.Tensor, segment: SegmentRun | None, whole: bool
           ) -> tuple[int, dict[str, torch.Tensor]]:
    """Slots a forward under :class:`Recompute` leaves to the recompute, and the gradients after backward."""
    gm.zero_grad()
    rc = Recompute({0}, torch.device("cpu"))
    x = x.clone().requires_grad_(True)
    if whole:
        out = rc.forward((0, 0, 0), gm, lambda: gm(x))
    elif segment is not None:
        out = rc.forward((0, 0, 0), segment.owner, lambda: gm(x), lambda hooks, replay: segment([x], hooks, replay))
    else:
        out = gm(x)
    slots = len(rc._frames[(0, 0, 0)].metas) if (0, 0, 0) in rc._frames else 0
    rc.recompute((0, 0, 0))
    out.sum().backward()
    return slots, {n: p.grad.clone() for n, p in gm.named_parameters()} | {"x": x.grad.clone()}


def test_segment_slots_only_its_nodes() -> None:
    """One process: the segment's forward leaves fewer tensors to the recompute than the whole
    stage's, more than none, and the gradients equal those of a plain forward bit for bit."""
    gm = torch.fx.symbolic_trace(_make(0.0).body)
    x = torch.randn(2, 2, 16, 16, dtype=torch.float64)
    nodes = [n.name for n in gm.graph.nodes]
    seg = SegmentRun(gm, segment_names(nodes, _segment(nodes, "_1_1"), gm, "stage 0"))
    _, plain = _saved(gm, x, None, whole=False)
    stats = gm.get_buffer("1.1.running_mean").clone()
    n_seg, got = _saved(gm, x, seg, whole=False)
    n_whole, whole = _saved(gm, x, None, whole=True)
    assert 0 < n_seg < n_whole
    for k in plain:
        assert torch.equal(got[k], plain[k]) and torch.equal(whole[k], plain[k]), k
    assert not torch.equal(gm.get_buffer("1.1.running_mean"), stats)  # updated by the forwards, once each


def test_plan_refuses_a_bad_segment() -> None:
    cm = nowdl.compile(_make(0.0), gpus=2, mode="estimate", cache=False, progress=False, recompute="off",
                       offload="off", **CFG)
    plan = cm.plan(torch.randn(1, 2, 16, 16, dtype=torch.float64))
    d = plan.to_dict()
    assert all("recompute_segment" not in s for s in d["stages"])  # absent where unset: old plans read the same
    assert nowdl.Plan.from_dict(d).stages[0].recompute_segment == []
    d["stages"][0]["recompute_segment"] = [0, 2]
    with pytest.raises(PlanError, match="recompute_segment"):  # recompute false
        nowdl.Plan.from_dict(d)
    d["stages"][0]["recompute"] = True
    assert nowdl.Plan.from_dict(d).stages[0].recompute_segment == [0, 2]
    d["stages"][0]["recompute_segment"] = [0, len(d["stages"][0]["nodes"]) + 1]
    with pytest.raises(PlanError, match="recompute_segment"):
        nowdl.Plan.from_dict(d)
