"""Launch layer: launcher environments, backend choice, init_distributed, wait with deadlines."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import WorkerError, run_workers

from nowdl.errors import NowdlError
from nowdl.runtime.launch.group import (
    LaunchEnv,
    PeerError,
    default_backend,
    init_distributed,
    launch_env,
    wait,
)

# ---------------------------------------------------------------- pure environment mapping

MASTER = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    ("environ", "launcher"),
    [
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", **MASTER}, "torchrun"),
        (
            {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
             "OMPI_COMM_WORLD_LOCAL_RANK": "1", **MASTER},
            "openmpi",
        ),
        (
            {"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "8",
             "MV2_COMM_WORLD_LOCAL_RANK": "1", **MASTER},
            "mvapich",
        ),
        ({"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", **MASTER}, "mpich"),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", **MASTER}, "slurm"),
    ],
)
def test_launch_env_each_launcher(environ: dict[str, str], launcher: str) -> None:
    assert launch_env(environ) == LaunchEnv(3, 8, 1, "node0", 29500, launcher)


def test_launch_env_single_process() -> None:
    assert launch_env({}) == LaunchEnv(0, 1, 0, None, None, "single")
    assert launch_env({"PATH": "/bin", "MASTER_PORT": ""}).launcher == "single"


def test_launch_env_precedence() -> None:
    # mpirun inside a Slurm allocation: the MPI variables describe the processes.
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
           "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6"}
    got = launch_env(env)
    assert (got.launcher, got.rank, got.world_size, got.local_rank) == ("openmpi", 5, 6, 0)
    # torchrun wins over everything.
    assert launch_env({**env, "RANK": "1", "WORLD_SIZE": "2"}).launcher == "torchrun"


@pytest.mark.parametrize(
    ("environ", "needles"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, ["RANK='2'", "WORLD_SIZE='2'", "0..1"]),
        ({"RANK": "x", "WORLD_SIZE": "2"}, ["RANK='x'", "not an integer"]),
        ({"RANK": "0", "WORLD_SIZE": "0"}, ["WORLD_SIZE='0'", "at least 1"]),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, ["RANK='-1'"]),
        ({"RANK": "0"}, ["RANK='0'", "WORLD_SIZE is not"]),
        ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"},
         ["OMPI_COMM_WORLD_RANK='4'", "OMPI_COMM_WORLD_SIZE='4'"]),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "two"}, ["SLURM_NTASKS='two'", "not an integer"]),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "5"}, ["MPI_LOCALRANKID='5'"]),
        ({"MASTER_PORT": "http"}, ["MASTER_PORT='http'"]),
        ({"MASTER_PORT": "70000"}, ["MASTER_PORT=70000"]),
    ],
)
def test_launch_env_bad_values(environ: dict[str, str], needles: list[str]) -> None:
    with pytest.raises(NowdlError) as info:
        launch_env(environ)
    for needle in needles:
        assert needle in str(info.value)


def test_default_backend() -> None:
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert default_backend({}) == expected
    assert default_backend({"NOWDL_BACKEND": " GLOO "}) == "gloo"
    with pytest.raises(NowdlError, match="NOWDL_BACKEND='tcp'.*nccl, gloo, mpi"):
        default_backend({"NOWDL_BACKEND": "tcp"})
    if not dist.is_mpi_available():
        with pytest.raises(NowdlError, match="without MPI"):
            default_backend({"NOWDL_BACKEND": "mpi"})
    if not torch.cuda.is_available():
        with pytest.raises(NowdlError, match="use gloo"):
            default_backend({"NOWDL_BACKEND": "nccl"})


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> list[int]:
    """Pretend this machine has ``count`` GPUs and NCCL; returns the devices set_device was given."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    return chosen


def test_ranks_sharing_a_gpu_use_gloo_bound_to_local_rank_modulo_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from nowdl.runtime.launch.group import _auto_backend, _set_device

    chosen = _fake_gpus(monkeypatch, 1)
    four = [LaunchEnv(r, 4, r, "h", 1, "torchrun", local_world_size=4) for r in range(4)]
    assert [_auto_backend(e, {}) for e in four] == ["gloo"] * 4  # every rank of the node alike
    assert [_set_device(e, "gloo") for e in four] == [torch.device("cuda", 0)] * 4 and chosen == [0] * 4
    assert _auto_backend(four[0], {"NOWDL_BACKEND": "nccl"}) == "nccl"  # asked for: kept, and refused below
    for e in four:  # every rank refuses, not only those past the GPU count
        with pytest.raises(NowdlError, match=r"one of 4 ranks on this node .* 1 GPU\(s\) and NCCL takes one GPU "
                                             r"per rank: .*--nproc-per-node 1.*backend='gloo'"):
            _set_device(e, "nccl")
    chosen = _fake_gpus(monkeypatch, 2)
    two = [LaunchEnv(r, 2, r, "h", 1, "torchrun", local_world_size=2) for r in range(2)]
    assert [_auto_backend(e, {}) for e in two] == ["nccl"] * 2
    assert [_set_device(e, "nccl") for e in two] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    shared = [LaunchEnv(r, 3, r, "h", 1, "torchrun", local_world_size=3) for r in range(3)]
    assert [_set_device(e, "gloo") for e in shared] == [torch.device("cuda", i) for i in (0, 1, 0)]
    _fake_gpus(monkeypatch, 0)
    assert _auto_backend(four[0], {}) == "gloo" and _set_device(four[0], "gloo") is None


def test_a_device_other_than_the_one_nccl_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from nowdl.runtime.training.trainer import Trainer

    def device(asked: str, backend: str) -> torch.device:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
        tr = Trainer(SimpleNamespace(device=asked), loss_fn=None)  # type: ignore[arg-type]
        tr.rank = 1
        return tr.device()

    with pytest.raises(NowdlError, match=r"rank 1: compile\(device='cuda:0'\) but NCCL bound this rank to cuda:1 "
                                         r"\(its LOCAL_RANK\): pass device='cuda'"):
        device("cuda:0", "nccl")
    assert device("cuda:1", "nccl") == torch.device("cuda", 1)
    assert device("cuda", "nccl") == torch.device("cuda")
    assert device("cuda:0", "gloo") == torch.device("cuda", 0)  # several ranks on one GPU: allowed


def test_init_distributed_needs_master_under_mpirun() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "node0"}
    with pytest.raises(NowdlError, match="openmpi.*MASTER_PORT is not set.*export MASTER_ADDR"):
        init_distributed(environ=env, backend="gloo")
    assert not dist.is_initialized()


def test_init_distributed_world_mismatch_before_rendezvous() -> None:
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}  # no master needed: fails first
    with pytest.raises(NowdlError, match=r"rank 1: this plan needs 8 ranks \(gpus\) but the job has 4"):
        init_distributed(environ=env, expected_world_size=8)
    assert not dist.is_initialized()


def test_init_distributed_single_process() -> None:
    try:
        env = init_distributed(environ={}, backend="gloo", expected_world_size=1)
        assert env == LaunchEnv(0, 1, 0, None, None, "single")
        assert dist.get_world_size() == 1
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        # Already initialised: only checks.
        assert init_distributed(environ={}, expected_world_size=1).world_size == 1
        with pytest.raises(NowdlError, match="needs 2 ranks"):
            init_distributed(environ={}, expected_world_size=2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_group_nowdl_made_is_destroyed_before_the_interpreter_ends() -> None:
    """A program that never destroys its process group (a training script's usual end) still
    gets it destroyed at exit, before finalization (gloo can abort there: runtime/launch/group_exit.py).
    The script's own exit hook, registered first, runs last and sees it gone."""
    import subprocess
    import sys

    script = (
        "import atexit, torch.distributed as dist\n"
        "atexit.register(lambda: print('alive at the end:', dist.is_initialized()))\n"
        "from nowdl.runtime.launch.group import init_distributed\n"
        "init_distributed(environ={}, backend='gloo', expected_world_size=1)\n"
        "print('alive after init:', dist.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "alive after init: True" in out.stdout and "alive at the end: False" in out.stdout, out.stdout


# ---------------------------------------------------------------- multi-process (run_workers)


def _all_reduce(rank: int, world: int, style: str) -> dict[str, Any]:
    if style == "openmpi":
        # As under mpirun with exported MASTER_ADDR/PORT: only OMPI_* variables give the rank.
        environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        environ.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(world),
                       OMPI_COMM_WORLD_LOCAL_RANK=str(rank))
        env = init_distributed(environ=environ, expected_world_size=world, timeout_s=30)
    else:
        env = init_distributed(expected_world_size=world, timeout_s=30)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    work = dist.all_reduce(torch.ones(2), async_op=True)
    wait(work, timeout_s=10, what="a test all-reduce", peer=None)
    return {"rank": env.rank, "world": env.world_size, "launcher": env.launcher,
            "sum": t.item(), "backend": dist.get_backend()}


# Each spawned rank pays for importing torch, so the launcher styles share the world sizes.
@pytest.mark.parametrize(("world", "style"), [(2, "openmpi"), (4, "torchrun")])
def test_all_reduce_through_init_distributed(world: int, style: str) -> None:
    out = run_workers(_all_reduce, world, style, init_group=False, timeout_s=60)
    total = world * (world + 1) / 2
    assert out == [
        {"rank": r, "world": world, "launcher": style, "sum": total, "backend": "gloo"}
        for r in range(world)
    ]


def _mismatch(rank: int, world: int) -> None:
    init_distributed(expected_world_size=world + 2)


def test_world_size_mismatch_raises_on_every_rank() -> None:
    with pytest.raises(WorkerError) as info:
        run_workers(_mismatch, 2, init_group=False, timeout_s=60)
    assert sorted(info.value.failures) == [0, 1]
    assert not info.value.unfinished
    for rank in (0, 1):
        assert (
            f"rank {rank}: this plan needs 4 ranks (gpus) but the job has 2: launch with "
            "torchrun --nproc-per-node 4 (or re-plan with --gpus 2)"
        ) in info.value.failures[rank]


def _silent_peer(rank: int, world: int) -> str:
    if rank == 1:
        # Alive but never sends. (No barrier with rank 0 here: after a timed-out wait gloo
        # closes the pair, so the group cannot be used with that peer any more.)
        time.sleep(3)
        return "silent"
    buf = torch.zeros(4)
    start = time.monotonic()
    with pytest.raises(PeerError) as info:
        wait(dist.irecv(buf, src=1), timeout_s=2, what="activations of micro-batch 0", peer=1)
    elapsed = time.monotonic() - start
    assert 1.5 < elapsed < 10, elapsed
    assert (info.value.peer, info.value.what, info.value.timeout_s) == (
        1, "activations of micro-batch 0", 2)
    return str(info.value)


def test_wait_times_out_naming_the_peer() -> None:
    message, silent = run_workers(_silent_peer, 2, timeout_s=60)
    assert silent == "silent"
    assert "rank 0: rank 1 did not answer within 2 s" in message
    assert "activations of micro-batch 0" in message
    assert "rank 1 probably died" in message and "log" in message


def _dies_mid_exchange(rank: int, world: int) -> float:
    buf = torch.zeros(4)
    if rank == 1:
        dist.send(torch.ones(4), dst=0)  # the first exchange works
        time.sleep(0.5)
        os._exit(1)  # ... then it dies before the second
    wait(dist.irecv(buf, src=1), timeout_s=20, what="activations of micro-batch 0", peer=1)
    assert buf.tolist() == [1.0] * 4
    start = time.monotonic()
    try:
        wait(dist.irecv(buf, src=1), timeout_s=20, what="activations of micro-batch 1", peer=1)
    except PeerError:
        elapsed = time.monotonic() - start
        assert elapsed < 20, elapsed
        raise
    return -1.0


def test_killed_rank_fails_fast_and_is_reported() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_workers(_dies_mid_exchange, 2, timeout_s=60)
    assert time.monotonic() - start < 30
    err = info.value
    assert sorted(err.failures) == [0, 1] and not err.unfinished
    assert "exited with code 1" in err.failures[1]
    assert "PeerError" in err.failures[0]
    assert "rank 1" in err.failures[0] and "activations of micro-batch 1" in err.failures[0]
    assert "probably died" in err.failures[0]
    assert "rank 1 failed" in str(err) and "rank 0 failed" in str(err)


def _hangs(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(60)


def test_run_workers_kills_hung_ranks_at_the_deadline() -> None:
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_workers(_hangs, 2, timeout_s=5)
    assert time.monotonic() - start < 15
    err = info.value
    assert not err.failures and 1 in err.unfinished
    # Rank 0 returns at once, unless a loaded machine took the whole deadline to spawn it.
    assert err.results == ({} if 0 in err.unfinished else {0: None})
    assert "within timeout_s=5" in str(err) and "did not finish" in str(err)
