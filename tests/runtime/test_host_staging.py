"""Host staging (runtime/launch/comm.py): every exchange of the runtime through host buffers, as on one GPU.

``NOWDL_STAGE_HOST=1`` sends CPU tensors through the path CUDA tensors take on gloo (copied into a
separate host buffer, moved, copied back on ``wait``), so these CPU tests run every line of it. The
exactness tests of the runtime that run staged are marked in their modules (``staged_worker``).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_workers

from nowdl.errors import NowdlError
from nowdl.runtime.launch import comm
from nowdl.runtime.launch.group import PeerError, wait
from nowdl.runtime.spatial.dispatch import sum_weight_grads

STAGED = {comm.STAGE_VAR: "1"}


def _exchanges(rank: int, world: int) -> dict[str, Any]:
    """Each wrapper once, staged; returns what arrived and the bytes counted."""
    out: dict[str, Any] = {}
    start = comm.staged_bytes()
    peer = 1 - rank
    # p2p: the receive lands in a non-contiguous view; the send's tensor is free once isend returns
    recv_into = torch.zeros(3, 4)
    r = comm.irecv(recv_into.t(), src=peer, tag=7)
    msg = torch.arange(12.0).reshape(4, 3) + 100 * rank
    s = comm.isend(msg, dst=peer, tag=7)
    assert isinstance(s, comm.StagedWork) and isinstance(r, comm.StagedWork)
    msg.fill_(-1.0)  # the host copy was taken when isend returned
    assert recv_into.abs().sum() == 0  # nothing lands before the wait (gloo completes p2p in wait())
    assert r.wait(timedelta(seconds=10)) is True and s.wait() is True and r.is_completed()
    out["p2p"] = recv_into.t().clone()
    # async all-reduce: is_completed() finishes it (the caller's tensor holds the sum then)
    t = torch.full((5,), float(rank + 1))
    w = comm.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)
    while not w.is_completed():
        time.sleep(0.01)
    out["sum"] = t.clone()
    wait(w, timeout_s=10, what="a test all-reduce", peer=None)  # done: returns at once
    m = torch.tensor([float(rank)], dtype=torch.float64)
    assert comm.all_reduce(m, op=dist.ReduceOp.MAX) is None
    out["max"] = float(m)
    parts = [torch.empty(2, 2, dtype=torch.int64) for _ in range(world)]
    comm.all_gather(parts, torch.full((2, 2), rank, dtype=torch.int64))
    out["gather"] = [int(p[0, 0]) for p in parts]
    b = torch.full((4,), float(10 + rank))
    comm.broadcast(b, src=1)
    out["bcast"] = b.clone()
    sub = dist.new_group([0, 1])
    g = torch.ones(2) * (rank + 1)
    comm.all_reduce(g, group=sub)
    out["sub"] = g.clone()
    out["bytes"] = comm.staged_bytes() - start
    lin = torch.nn.Linear(2, 1)  # the tiles' weight gradients (spatial/dispatch.py): one flat all-reduce
    for p in lin.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    sum_weight_grads(lin)
    out["grads"] = [p.grad.tolist() for p in lin.parameters()]
    out["grad_bytes"] = comm.staged_bytes() - start - out["bytes"]
    return out


def test_staged_exchanges_deliver_what_torch_distributed_does() -> None:
    res = run_workers(_exchanges, 2, env=STAGED, timeout_s=60)
    for rank, out in enumerate(res):
        sent = torch.arange(12.0).reshape(4, 3) + 100 * (1 - rank)
        assert torch.equal(out["p2p"], sent)
        assert out["sum"].tolist() == [3.0] * 5
        assert out["max"] == 1.0
        assert out["gather"] == [0, 1]
        assert out["bcast"].tolist() == [11.0] * 4
        assert out["sub"].tolist() == [3.0, 3.0]
        # every byte through a staging buffer: p2p 48 + 48, all-reduces 2x20 + 2x8, all_gather
        # 32 + 2x32, broadcast 16 (the source copies out, the other copies in), sub-group 2x8
        assert out["bytes"] == 96 + 40 + 16 + 96 + 16 + 16, out["bytes"]
        assert out["grads"] == [[[3.0, 3.0]], [3.0]] and out["grad_bytes"] == 2 * 3 * 4


def _plain(rank: int, world: int) -> tuple[int, bool]:
    t = torch.ones(3)
    w = comm.all_reduce(t, async_op=True)
    w.wait()
    return comm.staged_bytes(), isinstance(w, comm.StagedWork)


def test_cpu_tensors_are_not_staged_by_default_nor_with_staging_off() -> None:
    assert run_workers(_plain, 2, timeout_s=60) == [(0, False)] * 2
    assert run_workers(_plain, 2, env={comm.STAGE_VAR: "0"}, timeout_s=60) == [(0, False)] * 2


def _silent_staged(rank: int, world: int) -> tuple[str, list[float]]:
    if rank == 1:
        time.sleep(3)
        return "silent", []
    buf = torch.zeros(4)
    with pytest.raises(PeerError) as info:
        wait(comm.irecv(buf, src=1), timeout_s=2, what="a staged halo", peer=1)
    return str(info.value), buf.tolist()


def test_a_staged_receive_times_out_naming_the_peer_and_leaves_the_buffer() -> None:
    (message, buf), (silent, _) = run_workers(_silent_staged, 2, env=STAGED, timeout_s=60)
    assert silent == "silent"
    assert "rank 0: rank 1 did not answer within 2 s while exchanging a staged halo" in message
    assert buf == [0.0] * 4


def test_which_tensors_are_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto: a non-CPU tensor whose device the group runs on gloo; never under NCCL; 1/0 force."""
    meta = torch.empty(2, device="meta")
    cpu = torch.empty(2)
    configs = {"gloo": "cpu:gloo,meta:gloo", "nccl": "meta:nccl", "mixed": "cpu:gloo,meta:nccl"}
    for env, name, t, want in [("", "gloo", meta, True), ("", "gloo", cpu, False), ("", "nccl", meta, False),
                               ("", "mixed", meta, False), ("1", "gloo", cpu, True), ("1", "nccl", meta, False),
                               ("0", "gloo", meta, False), ("auto", "gloo", meta, True)]:
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None, name=name: configs[name])
        monkeypatch.setenv(comm.STAGE_VAR, env)
        assert comm.staged(t) is want, (env, name, t.device)
    monkeypatch.setenv(comm.STAGE_VAR, "sometimes")
    with pytest.raises(NowdlError, match="NOWDL_STAGE_HOST='sometimes' is not 1, 0 or auto"):
        comm.staged(meta)

