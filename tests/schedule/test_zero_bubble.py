"""Zero bubble (ZB-H1): the order, deferred weight gradients, and exactness against one process.

The distributed cases train 3 Adam steps with gloo processes, as tests/runtime/test_training.py does,
and compare losses and every parameter with one process running the same micro-batches.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers.exactness import (
    adam,
    compare,
    make_batch,
    make_loss,
    make_model,
    reference_run,
    train_worker,
)
from torch import nn

import nowdl
from nowdl.runtime.pipeline import deferred_wgrad as zerobubble
from nowdl.schedule import (
    chain_deps,
    inflight_peaks,
    simulate,
    validate_schedule,
    zero_bubble,
)
from nowdl.schedule.zero_bubble_order import zb_held, zb_slots

_ORDERS = [(k, m, r) for k, m in [(1, 3), (2, 4), (3, 5), (4, 4), (4, 8), (6, 3)] for r in (1, 2)
           if r == 1 or k >= 2]  # MASTER (replicas=2) needs two stages


@pytest.mark.parametrize("k,m,replicas", _ORDERS)
def test_order_is_complete_runs_and_bounds_inflight(k: int, m: int, replicas: int) -> None:
    sched = zero_bubble(k, m, replicas=replicas)
    validate_schedule(sched, k, m, replicas)
    steps = simulate(sched, chain_deps(k))
    assert sum(a is not None for row in steps for a in row.values()) == 3 * k * m * replicas
    assert max(inflight_peaks(steps).values()) == min(m, k)
    when = {a: t for t, row in enumerate(steps) for a in row.values() if a is not None}
    for a, t in when.items():  # B and W each in micro-batch order on every stage
        if a.kind != "F" and a.microbatch:
            assert when[type(a)(a.kind, a.stage, a.microbatch - 1, a.replica)] < t


@pytest.mark.parametrize("k,m", [(k, m) for k, m, r in _ORDERS if r == 1] + [(8, 16), (4, 2)])
def test_whole_activations_as_1f1b(k: int, m: int) -> None:
    """Forwards awaiting their B never exceed 1F1B's min(m, K - s) on stage s; zb_held counts
    them and the micro-batches whose W waits at the peak (ZB1P's (K - s, s) in steady state)."""
    held = zb_held(k, m)
    for s in range(k):
        whole = peak = 0
        for a in zero_bubble(k, m)[s]:
            whole += {"F": 1, "B": -1, "W": 0}[a.kind]
            peak = max(peak, whole)
        assert peak == min(m, k - s) == held[s][0], (k, m, s)
        assert held[s][1] <= min(m, k) - held[s][0]
    if m >= 2 * k:
        assert held == tuple((k - s, s) for s in range(k))


def test_zb_h1_step_length() -> None:
    """In time units F = B = W = 1: 1F1B (B and W fused) takes 3(m + K - 1), ZB-H1 3m + K - 1; with
    other proportions the step model keeps only the forwards in the bubble."""
    for k in range(2, 9):
        for m in range(k, 2 * k + 1):
            steps = len(simulate(zero_bubble(k, m), chain_deps(k)))
            assert steps == 3 * m + k - 1, (k, m, steps)
            assert zb_slots(k, m, 1 / 3) == pytest.approx(m + (k - 1) / 3), (k, m)
            assert m <= zb_slots(k, m, 0.25) < m + k - 1


def test_deferred_weight_gradients_equal_autograd() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.ConvTranspose2d(4, 4, 2, stride=2), nn.Flatten(), nn.Linear(4 * 16 * 16, 5)).double()
    ref = copy.deepcopy(model)
    assert zerobubble.enable(model) == 3
    queues = []
    for i in range(3):
        x = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        xr = x.clone().requires_grad_()
        ref(xr).square().sum().backward()
        xz = x.clone().requires_grad_()
        with zerobubble.capturing():
            y = model(xz)
        q: list[zerobubble.WeightGrad] = []
        with zerobubble.deferring(q):
            y.square().sum().backward()
        assert len(q) == 3 and model[0].weight.grad is None  # deferred
        assert model[1].weight.grad is not None  # norm layers are not
        torch.testing.assert_close(xz.grad, xr.grad, rtol=1e-12, atol=1e-12)
        queues.append(q)
    for q in queues:
        zerobubble.run_weight_grads(q)
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-12, atol=1e-12, msg=lambda s, n=name: f"{n}: {s}")
    model.zero_grad()  # outside the contexts the modules are the ordinary ones
    model(torch.randn(2, 3, 8, 8, dtype=torch.float64)).sum().backward()
    assert model[0].weight.grad is not None


def test_queued_weight_gradient_holds_no_graph() -> None:
    """[Note: W holds no graph]: a queued W keeps its layer's input, not the tensors it was made from."""
    import weakref

    conv = nn.Conv2d(4, 2, 3, padding=1)
    zerobubble.enable(conv)
    a, b = torch.randn(1, 2, 8, 8, requires_grad=True), torch.randn(1, 2, 8, 8, requires_grad=True)
    with zerobubble.capturing():
        y = conv(torch.cat([a, b], 1))
    q: list[zerobubble.WeightGrad] = []
    with zerobubble.deferring(q):
        y.sum().backward()
    refs = [weakref.ref(a), weakref.ref(b)]
    del a, b, y
    assert len(q) == 1 and all(r() is None for r in refs)  # the received buffers are free before W
    zerobubble.run_weight_grads(q)
    assert conv.weight.grad is not None


@pytest.mark.parametrize("m", [2, 4])
def test_zb_two_stages(m: int) -> None:
    compare("resnet_bn", 2, {"stages": 2, "dp": 1, "replicas": 1, "micro_batches": m, "schedule": "zb"})


def test_zb_four_stages_long_skips() -> None:
    compare("monai_unet", 4, {"stages": 4, "dp": 1, "replicas": 1, "micro_batches": 4, "schedule": "zb"})


def test_zb_four_stages_master() -> None:
    compare("resnet_bn", 4, {"stages": 4, "dp": 1, "replicas": 2, "micro_batches": 2, "schedule": "zb"})


def test_zb_master_times_dp() -> None:
    compare("resnet_bn", 4, {"stages": 2, "dp": 2, "replicas": 2, "micro_batches": 2, "schedule": "zb"})


def test_one_process_defers_and_matches() -> None:
    """K = 1: the engine really defers (W actions, swapped layers) and trains like the reference."""
    cm = nowdl.compile(make_model("resnet_bn"), gpus=1, stages=1, micro_batches=2, schedule="zb", mode="estimate",
                       optimizer=adam, loss_fn=make_loss("resnet_bn"), cache=False, progress=False)
    losses = [cm.train_step(*make_batch("resnet_bn", 2, step)) for step in range(3)]
    eng = cm._trainer.engine
    assert eng.deferred == {0} and [a.kind for a in eng.actions] == ["F", "B", "W", "F", "B", "W"]
    ref_losses, ref_sd = reference_run("resnet_bn", 2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-7)
    sd = cm.state_dict()
    for k, ref in ref_sd.items():
        if ref.is_floating_point():
            torch.testing.assert_close(sd[k], ref, rtol=1e-5, atol=1e-6, msg=lambda s, k=k: f"{k}: {s}")


def _small_buckets_worker(*args: Any) -> Any:
    """test_runtime's worker with 512-byte gradient buckets: many all-reduces per stage, each
    launched from inside the last backward (or W) as its parameters' gradients become final."""
    from nowdl.runtime.pipeline import grad_sync as gradsync
    gradsync.BUCKET_BYTES = 512
    return train_worker(*args)


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_bucketed_allreduce_dp_is_exact(schedule: str) -> None:
    compare("resnet_bn", 4, {"stages": 2, "dp": 2, "replicas": 1, "micro_batches": 2, "schedule": schedule},
             worker=_small_buckets_worker)
