"""The job's node layout read the same way under torchrun, srun and mpirun, before and after joining
the group, and a layout that splits a tile group refused under each."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from helpers.multinode_worker import make_model
from helpers.run_cli import ROOT, free_port

import nowdl
from nowdl.errors import NowdlError
from nowdl.runtime.launch import nodes
from nowdl.runtime.launch.launcher import LAUNCHER_VAR, launch_env, slurm_tasks_per_node
from nowdl.runtime.launch.nodes import job_topology

# rank r of 4 with ``per`` processes per node (block placement), in each launcher's own variables
LAUNCHERS: dict[str, Callable[[int, int], dict[str, str]]] = {
    "torchrun": lambda r, per: {"RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r % per),
                                "GROUP_RANK": str(r // per), "LOCAL_WORLD_SIZE": str(per)},
    "slurm": lambda r, per: {"SLURM_PROCID": str(r), "SLURM_NTASKS": "4", "SLURM_LOCALID": str(r % per),
                             "SLURM_NODEID": str(r // per), "SLURM_TASKS_PER_NODE": f"{per}(x{4 // per})",
                             "SLURM_JOB_ID": "77"},
    "openmpi": lambda r, per: {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "4",
                               "OMPI_COMM_WORLD_LOCAL_RANK": str(r % per), "OMPI_COMM_WORLD_LOCAL_SIZE": str(per)},
    "mvapich": lambda r, per: {"MV2_COMM_WORLD_RANK": str(r), "MV2_COMM_WORLD_SIZE": "4",
                               "MV2_COMM_WORLD_LOCAL_RANK": str(r % per), "MV2_COMM_WORLD_LOCAL_SIZE": str(per)},
    "mpich": lambda r, per: {"PMI_RANK": str(r), "PMI_SIZE": "4", "MPI_LOCALRANKID": str(r % per),
                             "MPI_LOCALNRANKS": str(per)},
}


def _exported(env: dict[str, str], launcher: str) -> dict[str, str]:
    """``env`` after init_distributed exported RANK/WORLD_SIZE/LOCAL_RANK (as it does under every launcher)."""
    e = launch_env(env)
    return {"RANK": str(e.rank), "WORLD_SIZE": str(e.world_size), "LOCAL_RANK": str(e.local_rank), **env,
            LAUNCHER_VAR: launcher}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_every_launcher_gives_two_nodes_of_two(launcher: str) -> None:
    for r in range(4):
        for env in (LAUNCHERS[launcher](r, 2), _exported(LAUNCHERS[launcher](r, 2), launcher)):
            got = launch_env(env)
            assert (got.launcher, got.rank, got.world_size, got.local_rank) == (launcher, r, 4, r % 2)
            assert (got.node_rank, got.local_world_size) == (r // 2, 2)
            assert job_topology(env) == (2, 2)


def test_exported_torchrun_variables_no_longer_hide_srun() -> None:
    env = {**LAUNCHERS["slurm"](2, 2), "RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}
    assert launch_env(env).launcher == "torchrun" and job_topology(env) == (None, None)  # what nowdl read before
    assert job_topology({**env, LAUNCHER_VAR: "slurm"}) == (2, 2)
    assert launch_env({**env, LAUNCHER_VAR: "torchrun"}).launcher == "torchrun"
    real = {**LAUNCHERS["torchrun"](2, 2), "SLURM_PROCID": "0", "SLURM_NTASKS": "1", LAUNCHER_VAR: "slurm"}
    assert launch_env(real).launcher == "slurm"  # the recorded launcher wins over torchrun's variables


def test_slurm_tasks_per_node_forms() -> None:
    assert slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm_tasks_per_node("4") == [4]
    with pytest.raises(NowdlError, match=r"SLURM_TASKS_PER_NODE='2\(x\)'"):
        slurm_tasks_per_node("2(x)")
    uneven = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "3,1"}
    assert (launch_env(uneven).node_rank, launch_env(uneven).local_world_size) == (1, None)
    assert job_topology(uneven) == (None, None)  # no one figure of GPUs per node: the planner uses the spec's
    with pytest.raises(NowdlError, match=r"adds up to 5 processes but the world size is 4"):
        launch_env({**uneven, "SLURM_TASKS_PER_NODE": "3,2"})
    step = {**uneven, "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    assert job_topology(step) == (2, 2)  # the job step's own layout comes first


@pytest.fixture(scope="module")
def tiled_plan() -> nowdl.Plan:
    cm = nowdl.compile(make_model("resnet"), gpus=4, nodes=2, gpus_per_node=2, mode="estimate", cache=False,
                       progress=False, spatial_parts=2, spatial_stages=1, stages=3, dp=1, replicas=1, micro_batches=2)
    plan = cm.plan(torch.empty(1, 3, 16, 16, dtype=torch.float64, device="meta"))
    assert [0, 1] in plan.topology["together"]  # the 2 tiles of stage 0 share a node
    return plan


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_layout_that_splits_a_tile_group_is_refused_under_every_launcher(
        launcher: str, tiled_plan: nowdl.Plan, monkeypatch: pytest.MonkeyPatch) -> None:
    def nodes_of(envs: list[dict[str, str]]) -> list[str]:
        return [f"node {launch_env(e).node_rank}" for e in envs]

    block = [_exported(LAUNCHERS[launcher](r, 2), launcher) for r in range(4)]
    monkeypatch.setattr(nodes, "node_ids", lambda world, environ=None: nodes_of(block))
    assert nodes.check_node_map(tiled_plan, 4) == ["node 0", "node 0", "node 1", "node 1"]
    # one process per node on 4 nodes: ranks 0 and 1 (one tile group) on two nodes
    one_each = [_exported(LAUNCHERS[launcher](r, 1), launcher) for r in range(4)]
    assert nodes_of(one_each) == ["node 0", "node 1", "node 2", "node 3"]
    monkeypatch.setattr(nodes, "node_ids", lambda world, environ=None: nodes_of(one_each))
    with pytest.raises(NowdlError, match=r"puts ranks \[0, 1\] on 2 nodes \(node 0, node 1\)"):
        nodes.check_node_map(tiled_plan, 4)


def test_init_distributed_records_the_launcher() -> None:
    """A real join under srun's variables (one task): afterwards the process still reads srun's layout."""
    code = ("import os\nfrom nowdl.runtime.launch.group import init_distributed, launch_env\n"
            "init_distributed(backend='gloo', timeout_s=30)\n"
            "e = launch_env()\n"
            "print(os.environ['RANK'], os.environ['NOWDL_LAUNCHER'], e.launcher, e.node_rank, e.local_world_size)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", LAUNCHER_VAR)
           and not k.startswith(("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC"))}
    env.update(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_NODEID="3", SLURM_TASKS_PER_NODE="1(x4)",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["0", "slurm", "slurm", "3", "1"]
