"""The job's nodes as launched, checked against the plan's rank -> node map.

A plan made for a cluster ([Note: placement]) keeps every tile group and MASTER pair it lists
in ``topology.together`` inside one node. When the job is launched with another layout (say
4 processes per node for a plan of 8 GPUs per node), such a group may land on two nodes: it
would still train correctly, but its halos would cross the slow link the plan avoided, so
every rank refuses to start with one error naming the group, the nodes and the fix.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping, Sequence

import torch.distributed as dist

from nowdl.errors import NowdlError
from nowdl.plan.plan import Plan
from nowdl.runtime.launch.group import LaunchEnv, launch_env

__all__ = ["job_topology", "node_ids", "check_node_map", "split_groups"]

log = logging.getLogger(__name__)


def job_topology(environ: Mapping[str, str] | None = None) -> tuple[int | None, int | None]:
    """(nodes, GPUs per node) of the running job as its launcher describes it; (None, None) when
    it does not say (then the planner uses the device spec's node)."""
    env = launch_env(environ)
    size = env.local_world_size
    if size is None or env.world_size % size:
        return None, None
    return env.world_size // size, size


def _my_node(env: LaunchEnv) -> str:
    return f"node {env.node_rank}" if env.node_rank is not None else socket.gethostname()


def node_ids(world: int, environ: Mapping[str, str] | None = None) -> list[str]:
    """Every rank's node (launcher node rank, else host name), gathered from all ranks."""
    mine = _my_node(launch_env(environ))
    if world <= 1 or not dist.is_initialized():
        return [mine]
    out: list[object] = [None] * world
    dist.all_gather_object(out, mine)
    return [str(x) for x in out]


def split_groups(plan: Plan, nodes: Sequence[str]) -> list[tuple[list[int], list[str]]]:
    """The groups of ``plan.topology.together`` that ``nodes`` (the node of each rank) splits."""
    bad = []
    for group in plan.topology.get("together", []) if plan.topology else []:
        where = sorted({nodes[int(r)] for r in group if int(r) < len(nodes)})
        if len(where) > 1:
            bad.append(([int(r) for r in group], where))
    return bad


def check_node_map(plan: Plan, world: int, environ: Mapping[str, str] | None = None) -> list[str]:
    """Gather every rank's node and refuse a launch that splits a group the plan keeps together.

    Returns every rank's node. Every rank raises the same error, so all of them exit.

    Raises:
        NowdlError: the first split group, its nodes, and the fix.
    """
    nodes = node_ids(world, environ)
    if world <= 1 or not plan.topology:
        return nodes
    bad = split_groups(plan, nodes)
    per_node = {n: nodes.count(n) for n in nodes}
    want_g = plan.topology.get("gpus_per_node")
    want_n = plan.topology.get("nodes")
    if bad:
        group, where = bad[0]
        raise NowdlError(
            f"this job puts ranks {group} on {len(where)} nodes ({', '.join(where)}), but the plan keeps them on one "
            f"node (a tile group or MASTER pair; plan: {want_n} nodes x {want_g} GPUs, job: {len(per_node)} nodes x "
            f"{sorted(set(per_node.values()))} processes): launch {want_g} processes on each of {want_n} nodes "
            f"(torchrun --nnodes {want_n} --nproc-per-node {want_g}), or re-plan with --nodes {len(per_node)} "
            f"--gpus-per-node {max(per_node.values())}"
        )
    if len(per_node) != want_n:
        log.warning("the plan is for %s nodes x %s GPUs but the job runs on %d node(s): its link costs do not hold",
                    want_n, want_g, len(per_node))
    return nodes
