"""Multi-node launch on one machine: two torchrun launchers (--nnodes 2), srun's variables, and bad launches."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.multinode_worker import batch, make_model, sgd
from helpers.reference import train_reference
from torch import nn

import nowdl
from nowdl.errors import NowdlError
from nowdl.runtime.launch.group import LaunchEnv, launch_env
from nowdl.runtime.launch.nodes import job_topology, split_groups

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "helpers" / "multinode_worker.py")
STEPS = 2
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_USE_AGENT_STORE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(("SLURM_", "OMPI_"))}
    env.update(NOWDL_BACKEND="gloo", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    return env


def _plan(tmp: Path, name: str, **pins: Any) -> tuple[Path, nowdl.Plan]:
    cm = nowdl.compile(make_model("resnet"), gpus=4, nodes=2, gpus_per_node=2, mode="estimate", cache=False,
                       progress=False, **pins)
    plan = cm.plan(torch.empty(1, 3, 16, 16, dtype=torch.float64, device="meta"))
    path = tmp / f"{name}.json"
    plan.save(path)
    return path, plan


def _reference(plan: nowdl.Plan) -> tuple[list[float], dict[str, torch.Tensor]]:
    total = plan.config["micro_batches"] * plan.config["replicas"] * plan.config["dp"]
    model = make_model("resnet")
    return train_reference(model, sgd(model.parameters()), nn.CrossEntropyLoss(), lambda s: batch(s, total), total,
                           STEPS)


def _check_exact(out: Path, plan: nowdl.Plan, world: int) -> list[dict[str, Any]]:
    got = torch.load(out / "result.pt", weights_only=False)
    ref_losses, ref_sd = _reference(plan)
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-9, abs=1e-12)
    one_copy = plan.config["replicas"] == 1 and plan.config["dp"] == 1
    assert set(got["state"]) == set(ref_sd)
    for k, ref in ref_sd.items():
        if not ref.is_floating_point() or (not one_copy and "running" in k):
            continue  # MASTER's two replicas keep their own BatchNorm running statistics
        torch.testing.assert_close(got["state"][k], ref, rtol=1e-9, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _wait(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    return out


# ---------------------------------------------------------------- the launch environment across nodes

def test_launch_env_node_variables() -> None:
    env = launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (env.node_rank, env.local_world_size, env.local_rank) == (1, 2, 1)
    env = launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
                      "SLURM_NTASKS_PER_NODE": "2(x4)"})
    assert env == LaunchEnv(5, 8, 1, None, None, "slurm", 2, 2)
    env = launch_env({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert (env.node_rank, env.local_world_size) == (1, 4)  # block placement: rank // processes per node
    assert job_topology({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "2(x4)"}) == (4, 2)
    assert job_topology({"RANK": "0", "WORLD_SIZE": "2"}) == (None, None)
    with pytest.raises(NowdlError, match=r"SLURM_NTASKS_PER_NODE='two'.*processes per node"):
        launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "two"})
    with pytest.raises(NowdlError, match=r"LOCAL_WORLD_SIZE='9'.*1\.\.4"):
        launch_env({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "9"})


def test_a_launch_that_splits_a_tile_group_is_refused(tmp_path: Path) -> None:
    _, plan = _plan(tmp_path, "sp", spatial_parts=2, spatial_stages=1, stages=3, dp=1, replicas=1, micro_batches=2)
    assert [0, 1] in plan.topology["together"]  # the 2 tiles of stage 0 share node 0
    assert split_groups(plan, ["a", "a", "b", "b"]) == []
    assert split_groups(plan, ["a", "b", "a", "b"]) == [([0, 1], ["a", "b"])]  # 1 process per node, interleaved
    from nowdl.runtime.launch import nodes
    orig = nodes.node_ids
    nodes.node_ids = lambda world, environ=None: ["node 0", "node 1", "node 2", "node 3"]  # type: ignore[assignment]
    try:
        with pytest.raises(NowdlError, match=r"puts ranks \[0, 1\] on 2 nodes \(node 0, node 1\).*2 nodes x 2 GPUs.*"
                                             r"--nnodes 2 --nproc-per-node 2"):
            nodes.check_node_map(plan, 4)
    finally:
        nodes.node_ids = orig  # type: ignore[assignment]


# ---------------------------------------------------------------- two torchrun launchers, one per "node"

@pytest.mark.slow
def test_two_torchrun_nodes_train_exactly_like_one_process(tmp_path: Path) -> None:
    """A 2-tile spatial stage on node 0 (its halos stay inside it), two pipeline stages on node 1;
    two launchers, --node-rank 0 and 1, 2 ranks each."""
    path, plan = _plan(tmp_path, "spatial", spatial_parts=2, spatial_stages=1, stages=3, dp=1, replicas=1,
                       micro_batches=2)
    assert plan.topology["node_of_rank"] == [0, 0, 1, 1] and plan.stages[0].ranks == [0, 1]
    cross = plan.topology["cross_node_bytes"]
    assert cross["halo"] == 0 and cross["boundary"] > 0  # the tiles share node 0; stage 0 -> 1 crosses
    port = str(_free_port())
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}", WORKER, str(path), str(tmp_path),
               "resnet", str(STEPS)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_base_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    for rc, text in _wait(procs, 240):
        assert rc == 0, text[-4000:]
    info = _check_exact(tmp_path, plan, 4)
    assert [(i["node_rank"], i["local_rank"], i["local_world_size"]) for i in info] == [
        (0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert {i["launcher"] for i in info} == {"torchrun"} and {i["device"] for i in info} == {"cpu"}


# ---------------------------------------------------------------- srun's variables

def _srun(tmp: Path, path: Path, nodes: int, per_node: int) -> list[tuple[int, str]]:
    port = str(_free_port())
    procs = []
    world = nodes * per_node
    for r in range(world):
        env = _base_env()
        env.update(SLURM_PROCID=str(r), SLURM_NTASKS=str(world), SLURM_LOCALID=str(r % per_node),
                   SLURM_NODEID=str(r // per_node), SLURM_NTASKS_PER_NODE=f"{per_node}(x{nodes})",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, WORKER, str(path), str(tmp), "resnet", str(STEPS)],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return _wait(procs, 240)


@pytest.mark.slow
def test_srun_variables_across_two_nodes_train_exactly(tmp_path: Path) -> None:
    """MASTER x 2 data-parallel copies on 2 nodes x 2: each MASTER pair on one node, the
    all-reduce across nodes; ranks, nodes and local ranks from SLURM_* as srun sets them."""
    path, plan = _plan(tmp_path, "master_dp", stages=2, replicas=2, dp=2, micro_batches=2)
    assert plan.topology["node_of_rank"] == [0, 0, 1, 1]
    cross = plan.topology["cross_node_bytes"]
    assert cross["master"] == 0 and cross["dp_allreduce"] > 0
    for rc, text in _srun(tmp_path, path, 2, 2):
        assert rc == 0, text[-4000:]
    info = _check_exact(tmp_path, plan, 4)
    assert [(i["launcher"], i["node_rank"], i["local_rank"]) for i in info] == [
        ("slurm", 0, 0), ("slurm", 0, 1), ("slurm", 1, 0), ("slurm", 1, 1)]


@pytest.mark.slow
def test_ranks_placed_out_of_pipeline_order_train_exactly(tmp_path: Path) -> None:
    """MASTER over 3 stages on 3 one-GPU nodes: the paired layout puts slot 2 on rank 1 and slot 1
    on rank 2; the runtime follows the plan's rank map."""
    cm = nowdl.compile(make_model("resnet"), gpus=3, nodes=3, gpus_per_node=1, stages=3, replicas=2, dp=1,
                       micro_batches=2, mode="estimate", cache=False, progress=False)
    plan = cm.plan(torch.empty(1, 3, 16, 16, dtype=torch.float64, device="meta"))
    path = tmp_path / "paired.json"
    plan.save(path)
    assert [s.ranks for s in plan.stages] == [[0], [2], [1]]
    for rc, text in _srun(tmp_path, path, 3, 1):
        assert rc == 0, text[-4000:]
    _check_exact(tmp_path, plan, 3)


# ---------------------------------------------------------------- a rendezvous that never completes

def test_rendezvous_that_never_completes_exits_2_naming_the_timeout() -> None:
    env = _base_env()  # rank 0 of 2 under srun; rank 1 never starts
    env.update(SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NTASKS_PER_NODE="1(x2)",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    cmd = [sys.executable, "-m", "nowdl", "run", "resnet", "--model-args",
           '{"depth": 8, "version": 1, "width": 4, "num_classes": 3}', "--input", "1x3x16x16", "--batch-size", "2",
           "--steps", "1", "--timeout", "3"]
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert time.monotonic() - t0 < 60
    assert res.stderr.startswith("nowdl run: error: rank 0 of 2 (node 0): the rendezvous at 127.0.0.1:")
    assert "did not complete within 3 s" in res.stderr and res.stderr.count("\n") == 1, res.stderr
