"""Who started this process: the launcher's rank, world size, local rank and node layout.

Each launcher describes the job in its own environment variables:

* ``torchrun`` (and ``python -m torch.distributed.run``): ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``; nodes from ``GROUP_RANK`` and ``LOCAL_WORLD_SIZE``;
* Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK`` / ``_LOCAL_SIZE``;
* MVAPICH2: ``MV2_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK`` / ``_LOCAL_SIZE``;
* MPICH / Intel MPI (Hydra): ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``;
* Slurm's ``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; nodes from
  ``SLURM_NODEID`` and the tasks per node (``SLURM_STEP_TASKS_PER_NODE``, else
  ``SLURM_TASKS_PER_NODE``, else ``SLURM_NTASKS_PER_NODE``; written ``2(x3),1``).

The MPI launchers give no node number: a process's node is rank // processes per node (block
placement, mpirun's default). :func:`~nowdl.runtime.launch.group.init_distributed` exports
``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` for other code and records the launcher it read in
``NOWDL_LAUNCHER``, so that later reads of the same process (and of its children) still see the
launcher's own layout rather than taking the exported variables for torchrun's.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from nowdl.errors import NowdlError

__all__ = ["LaunchEnv", "launch_env", "LAUNCHER_VAR", "slurm_tasks_per_node"]

logger = logging.getLogger(__name__)

#: Variable naming the launcher ``init_distributed`` read (see the module docstring).
LAUNCHER_VAR = "NOWDL_LAUNCHER"


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    launcher: str
    """``"torchrun"``, ``"openmpi"``, ``"mvapich"``, ``"mpich"``, ``"slurm"`` or ``"single"``."""
    node_rank: int | None = None
    """This process's node (torchrun ``GROUP_RANK``, Slurm ``SLURM_NODEID``; else rank // local size)."""
    local_world_size: int | None = None
    """Processes on this node (torchrun ``LOCAL_WORLD_SIZE``, Slurm's tasks per node, MPI local size)."""


# (launcher, rank variable, size variable, local-rank variable), in order of precedence.
# MPI comes before Slurm: ``mpirun`` inside an ``salloc``/``sbatch`` allocation still sees
# the allocation's SLURM_* variables, and the MPI ones describe the actual processes.
_LAUNCHERS: tuple[tuple[str, str, str, str], ...] = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)

# launcher -> (node-rank variable or "", processes-per-node variables in order of precedence)
_NODE_VARS: dict[str, tuple[str, tuple[str, ...]]] = {
    "torchrun": ("GROUP_RANK", ("LOCAL_WORLD_SIZE",)),
    "openmpi": ("", ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    "mvapich": ("", ("MV2_COMM_WORLD_LOCAL_SIZE",)),
    "mpich": ("", ("MPI_LOCALNRANKS",)),
    "slurm": ("SLURM_NODEID", ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")),
}

_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _int_var(environ: Mapping[str, str], name: str, launcher: str) -> int:
    raw = environ[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise NowdlError(
            f"{name}={raw!r} is not an integer (read as the {launcher} launch environment); "
            f"fix or unset {name}"
        ) from None


def _master(environ: Mapping[str, str]) -> tuple[str | None, int | None]:
    addr = environ.get("MASTER_ADDR", "").strip() or None
    raw_port = environ.get("MASTER_PORT", "").strip()
    if not raw_port:
        return addr, None
    try:
        port = int(raw_port)
    except ValueError:
        raise NowdlError(f"MASTER_PORT={raw_port!r} is not an integer port number") from None
    if not 1 <= port <= 65535:
        raise NowdlError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
    return addr, port


def slurm_tasks_per_node(raw: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Slurm's tasks-per-node list expanded: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        NowdlError: ``raw`` is not in Slurm's form (the variable and its value named).
    """
    out: list[int] = []
    for part in raw.strip().split(","):
        m = _TASKS.match(part.strip())
        if m is None or int(m.group(1)) < 1:
            raise NowdlError(f"{name}={raw!r} is not a number of processes per node (e.g. 2, or Slurm's 2(x4))")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _node_vars(env: Mapping[str, str], launcher: str, rank: int, world: int) -> tuple[int | None, int | None]:
    """(node rank, processes per node) as the launcher tells them, None where it does not (the
    processes per node also where nodes hold different numbers); without a node-rank variable the
    node is rank // processes per node (block placement)."""
    node_var, size_vars = _NODE_VARS[launcher]
    node: int | None = None
    if node_var and env.get(node_var, "").strip():
        node = _int_var(env, node_var, launcher)
        if node < 0:
            raise NowdlError(f"{node_var}={env[node_var]!r}: a node rank is >= 0 ({launcher})")
    size_var = next((v for v in size_vars if env.get(v, "").strip()), None)
    if size_var is None:
        return node, None
    raw = env[size_var].strip()
    counts = slurm_tasks_per_node(raw, size_var)
    if len(set(counts)) > 1:  # uneven nodes: no single processes-per-node figure
        if sum(counts) != world:
            raise NowdlError(f"{size_var}={raw!r} adds up to {sum(counts)} processes but the world size is {world} "
                             f"({launcher}): fix or unset {size_var}")
        return node, None
    size = counts[0]
    if not 1 <= size <= world:
        raise NowdlError(f"{size_var}={raw!r}: processes per node must be in 1..{world} ({launcher})")
    if node is None:
        node = rank // size
    return node, size


def _skipped(env: Mapping[str, str], launcher: str) -> bool:
    """Whether ``launcher``'s variables are the ones ``init_distributed`` exported for another launcher."""
    pinned = env.get(LAUNCHER_VAR, "").strip()
    if launcher != "torchrun" or not pinned or pinned == "torchrun":
        return False
    return any(name == pinned and rank_var in env for name, rank_var, _, _ in _LAUNCHERS)


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read this process's rank, world size, local rank and node from its launcher's variables.

    ``environ`` defaults to :data:`os.environ`. The first launcher (torchrun, Open MPI,
    MVAPICH, MPICH/Hydra, Slurm) whose rank or size variable is set wins (torchrun's are skipped
    where ``NOWDL_LAUNCHER`` names another launcher whose variables are set); if none is, the
    process is alone (rank 0 of 1). ``MASTER_ADDR``/``MASTER_PORT`` are read whatever the
    launcher. Raises :class:`~nowdl.errors.NowdlError`, naming the variables and their
    values, if they are not integers or do not fit together (e.g. rank >= world size).
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    master_addr, master_port = _master(env)
    for launcher, rank_var, size_var, local_var in _LAUNCHERS:
        if (rank_var not in env and size_var not in env) or _skipped(env, launcher):
            continue
        missing = [v for v in (rank_var, size_var) if v not in env]
        if missing:
            present = rank_var if rank_var in env else size_var
            raise NowdlError(
                f"{present}={env[present]!r} is set but {missing[0]} is not: the {launcher} "
                f"launch environment needs both {rank_var} and {size_var}"
            )
        rank = _int_var(env, rank_var, launcher)
        world = _int_var(env, size_var, launcher)
        local = _int_var(env, local_var, launcher) if local_var in env else 0
        shown = f"{rank_var}={env[rank_var]!r}, {size_var}={env[size_var]!r}"
        if world < 1:
            raise NowdlError(f"{shown}: the world size must be at least 1 ({launcher})")
        if not 0 <= rank < world:
            raise NowdlError(f"{shown}: the rank must be in 0..{world - 1} ({launcher})")
        if not 0 <= local < world:
            raise NowdlError(
                f"{local_var}={env[local_var]!r}, {size_var}={env[size_var]!r}: the local "
                f"rank must be in 0..{world - 1} ({launcher})"
            )
        if local_var not in env and world > 1:
            logger.debug("%s not set; assuming local rank 0", local_var)
        node_rank, local_size = _node_vars(env, launcher, rank, world)
        return LaunchEnv(rank, world, local, master_addr, master_port, launcher, node_rank, local_size)
    return LaunchEnv(0, 1, 0, master_addr, master_port, "single")
