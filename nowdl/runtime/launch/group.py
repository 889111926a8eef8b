"""Launch layer of the distributed runtime: who am I, how many are we, and join the group.

A pipeline job is started by one of several launchers, each of which describes the job in
its own environment variables:

* ``torchrun`` (and ``python -m torch.distributed.run``): ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
* Open MPI's ``mpirun``: ``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK``;
* MVAPICH2: ``MV2_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK``;
* MPICH / Intel MPI (Hydra): ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``;
* Slurm's ``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``.

Across nodes, the node rank and the processes per node come from ``GROUP_RANK`` /
``LOCAL_WORLD_SIZE`` (torchrun), ``SLURM_NODEID`` / ``SLURM_NTASKS_PER_NODE`` (srun) or the
MPI local-size variables; the CUDA device of a process is its local rank on its node.

:func:`launch_env` reads them (in that order of precedence; none means a single process),
:func:`init_distributed` joins the default process group, and :func:`wait` waits for an
asynchronous send/receive/collective with a deadline, turning a silent hang on a dead peer
into a :class:`PeerError` that names the peer and what was being exchanged.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from nowdl.backends import BACKENDS, backend_name
from nowdl.errors import NowdlError
from nowdl.runtime.launch.group_exit import destroy_at_exit

__all__ = [
    "LaunchEnv",
    "PeerError",
    "launch_env",
    "default_backend",
    "init_distributed",
    "wait",
    "BACKENDS",
    "rendezvous_message",
]

logger = logging.getLogger(__name__)

#: Backends :func:`default_backend` and :func:`init_distributed` accept.


class PeerError(NowdlError):
    """A point-to-point or collective exchange with a peer rank failed or timed out.

    ``peer`` is the peer's rank (``None`` for a collective, where any rank may be the culprit),
    ``what`` what was being exchanged, and ``timeout_s`` the deadline that applied.
    """

    def __init__(self, message: str, *, peer: int | None, what: str, timeout_s: float) -> None:
        super().__init__(message)
        self.peer = peer
        self.what = what
        self.timeout_s = timeout_s


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
    """Processes on this node (torchrun ``LOCAL_WORLD_SIZE``, Slurm ``SLURM_NTASKS_PER_NODE``, ...)."""


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


# launcher -> (node-rank variable or "", processes-per-node variable)
_NODE_VARS: dict[str, tuple[str, str]] = {
    "torchrun": ("GROUP_RANK", "LOCAL_WORLD_SIZE"),
    "openmpi": ("", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mvapich": ("", "MV2_COMM_WORLD_LOCAL_SIZE"),
    "mpich": ("", "MPI_LOCALNRANKS"),
    "slurm": ("SLURM_NODEID", "SLURM_NTASKS_PER_NODE"),
}


def _node_vars(env: Mapping[str, str], launcher: str, rank: int, world: int) -> tuple[int | None, int | None]:
    """(node rank, processes per node) as the launcher tells them, None where it does not. Slurm
    writes SLURM_NTASKS_PER_NODE as ``2`` or ``2(x4)``; without a node-rank variable the node is
    rank // processes per node (block placement)."""
    node_var, size_var = _NODE_VARS[launcher]
    size: int | None = None
    raw = env.get(size_var, "").strip()
    if raw:
        head = raw.split(",")[0].split("(")[0]
        try:
            size = int(head)
        except ValueError:
            raise NowdlError(f"{size_var}={raw!r} is not a number of processes per node ({launcher})") from None
        if not 1 <= size <= world:
            raise NowdlError(f"{size_var}={raw!r}: processes per node must be in 1..{world} ({launcher})")
    node: int | None = None
    if node_var and env.get(node_var, "").strip():
        node = _int_var(env, node_var, launcher)
        if node < 0:
            raise NowdlError(f"{node_var}={env[node_var]!r}: a node rank is >= 0 ({launcher})")
    elif size is not None:
        node = rank // size
    return node, size


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read this process's rank, world size and local rank from its launcher's variables.

    ``environ`` defaults to :data:`os.environ`. The first launcher (torchrun, Open MPI,
    MVAPICH, MPICH/Hydra, Slurm) whose rank or size variable is set wins; if none is, the
    process is alone (rank 0 of 1). ``MASTER_ADDR``/``MASTER_PORT`` are read whatever the
    launcher. Raises :class:`~nowdl.errors.NowdlError`, naming the variables and their
    values, if they are not integers or do not fit together (e.g. rank >= world size).
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    master_addr, master_port = _master(env)
    for launcher, rank_var, size_var, local_var in _LAUNCHERS:
        if rank_var not in env and size_var not in env:
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


def _check_backend(backend: str, source: str) -> str:
    name = backend_name(backend, source)
    if name == "mpi" and not dist.is_mpi_available():
        raise NowdlError(
            f"{source}={backend!r} but this torch ({torch.__version__}) was built without MPI "
            "support: use nccl (GPUs) or gloo (CPU), or build torch from source against your MPI"
        )
    if name == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise NowdlError(
            f"{source}={backend!r} but CUDA/NCCL is not available in this torch "
            f"({torch.__version__}) on this machine: use gloo"
        )
    if name == "gloo" and not dist.is_gloo_available():
        raise NowdlError(f"{source}={backend!r} but this torch was built without gloo")
    return name


def default_backend(environ: Mapping[str, str] | None = None) -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``; ``NOWDL_BACKEND`` overrides.

    ``NOWDL_BACKEND`` may be ``nccl``, ``gloo`` or ``mpi`` (the last only if torch was built
    with MPI); anything else, or a backend this build cannot use, is a
    :class:`~nowdl.errors.NowdlError`.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    override = env.get("NOWDL_BACKEND", "").strip()
    if override:
        return _check_backend(override, "NOWDL_BACKEND")
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _check_world(env: LaunchEnv, expected_world_size: int | None) -> None:
    if expected_world_size is not None and expected_world_size != env.world_size:
        n, m = expected_world_size, env.world_size
        raise NowdlError(
            f"rank {env.rank}: this plan needs {n} ranks (gpus) but the job has {m}: "
            f"launch with torchrun --nproc-per-node {n} (or re-plan with --gpus {m})"
        )


def _set_device(env: LaunchEnv, backend: str) -> None:
    if not torch.cuda.is_available():
        return
    count = torch.cuda.device_count()
    if env.local_rank < count:
        torch.cuda.set_device(env.local_rank)
    elif backend == "nccl":
        raise NowdlError(
            f"rank {env.rank} has local rank {env.local_rank} but this node has only {count} "
            f"GPU(s): start at most {count} processes per node (--nproc-per-node {count})"
        )
    else:
        logger.warning("local rank %d >= %d visible GPUs; not setting a CUDA device", env.local_rank, count)


def init_distributed(
    *,
    backend: str | None = None,
    timeout_s: float = 300.0,
    expected_world_size: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> LaunchEnv:
    """Join (or check) the default process group and return this process's :class:`LaunchEnv`.

    If the default group is already initialised, only the checks run and the returned
    rank/world size are the group's. Otherwise the launcher's variables (see
    :func:`launch_env`) give the rank and world size, ``MASTER_ADDR``/``MASTER_PORT`` the
    rendezvous (they must be exported by hand under ``mpirun``/``srun``), ``backend``
    defaults to :func:`default_backend`, and ``timeout_s`` bounds every collective. On CUDA
    the current device becomes ``local_rank``. When ``environ`` is ``None`` (the real
    environment), RANK/WORLD_SIZE/LOCAL_RANK are exported for code that reads them.

    If ``expected_world_size`` (the plan's GPU count) differs from the job's world size,
    every rank raises :class:`~nowdl.errors.NowdlError` before any communication.
    """
    if not dist.is_available():
        raise NowdlError("this torch build has no torch.distributed support")
    if not timeout_s > 0:
        raise NowdlError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
    env = launch_env(environ)

    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        if env.launcher != "single" and (rank, world) != (env.rank, env.world_size):
            logger.warning(
                "the process group says rank %d of %d but the %s environment says %d of %d; "
                "trusting the process group",
                rank, world, env.launcher, env.rank, env.world_size,
            )
        env = replace(env, rank=rank, world_size=world)
        _check_world(env, expected_world_size)
        return env

    _check_world(env, expected_world_size)
    name = _check_backend(backend, "backend") if backend is not None else default_backend(environ)
    timeout = timedelta(seconds=timeout_s)
    _set_device(env, name)
    destroy_at_exit()  # the group we make ends before the interpreter does (runtime/launch/group_exit.py)

    if name == "mpi":
        # MPI has its own rendezvous (the launcher's); it ignores rank/world/store.
        dist.init_process_group("mpi", timeout=timeout)
        rank, world = dist.get_rank(), dist.get_world_size()
        if (rank, world) != (env.rank, env.world_size):
            logger.warning("MPI says rank %d of %d, %s environment %d of %d", rank, world,
                           env.launcher, env.rank, env.world_size)
        env = replace(env, rank=rank, world_size=world)
    elif env.launcher == "single" and (env.master_addr is None or env.master_port is None):
        # Alone: an in-memory store, no port to pick.
        dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        if env.master_addr is None or env.master_port is None:
            missing = " and ".join(
                v for v, val in (("MASTER_ADDR", env.master_addr), ("MASTER_PORT", env.master_port))
                if val is None
            )
            raise NowdlError(
                f"rank {env.rank} of {env.world_size} was started by {env.launcher}, but "
                f"{missing} is not set: export MASTER_ADDR=<host of rank 0> and "
                "MASTER_PORT=<a free port> before launching (e.g. "
                "`export MASTER_ADDR=$(hostname) MASTER_PORT=29500`; with Open MPI also pass "
                "`-x MASTER_ADDR -x MASTER_PORT`), or launch with torchrun, which sets them"
            )
        if environ is None:
            for key, value in (("RANK", env.rank), ("WORLD_SIZE", env.world_size), ("LOCAL_RANK", env.local_rank),
                               ("MASTER_ADDR", env.master_addr), ("MASTER_PORT", env.master_port)):
                os.environ.setdefault(key, str(value))
        host = env.master_addr
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # IPv6 literal
        logger.info("rank %d/%d (%s, local %d) joining %s at %s:%d", env.rank, env.world_size,
                    env.launcher, env.local_rank, name, env.master_addr, env.master_port)
        try:
            dist.init_process_group(
                name,
                init_method=f"tcp://{host}:{env.master_port}",
                rank=env.rank,
                world_size=env.world_size,
                timeout=timeout,
            )
        except (RuntimeError, TimeoutError) as exc:  # DistStoreError, DistNetworkError: RuntimeErrors
            raise NowdlError(rendezvous_message(env, timeout_s, exc)) from exc
    return env


def rendezvous_message(env: LaunchEnv, timeout_s: float, exc: BaseException) -> str:
    """The one-paragraph error of a rendezvous that did not complete within ``timeout_s``."""
    where = f"{env.master_addr}:{env.master_port}"
    node = f" (node {env.node_rank})" if env.node_rank is not None else ""
    per = f", {env.local_world_size} per node" if env.local_world_size else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"rank {env.rank} of {env.world_size}{node}: the rendezvous at {where} did not complete within "
            f"{timeout_s:g} s (the timeout; {env.world_size} ranks expected{per}): start the launcher on every "
            f"node (torchrun --nnodes N --node-rank I, or srun), make {where} reachable from every node, or "
            f"raise --timeout [{type(exc).__name__}: {first}]")


def wait(work: dist.Work | None, *, timeout_s: float, what: str, peer: int | None) -> None:
    """Wait for an async send/receive/collective ``work`` for at most ``timeout_s`` seconds.

    ``work`` is what ``dist.isend``/``irecv``/``all_reduce(..., async_op=True)`` return;
    ``None`` (they return it when this rank is not in the group) means nothing to wait for.

    ``what`` says what is being exchanged (e.g. ``"activations of micro-batch 3"``) and
    ``peer`` with whom (``None`` for a collective). If the peer does not answer in time, or
    the exchange fails (typically because the peer's process died and closed its
    connection), raises :class:`PeerError` naming the peer and ``what``.
    """
    if not timeout_s > 0:
        raise NowdlError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
    if work is None:
        return
    start = time.monotonic()
    cause: BaseException | None = None
    try:
        done = work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # backends raise RuntimeError / DistBackendError subclasses
        cause = exc
        done = False
    if done is not False or (cause is None and work.is_completed()):
        return

    elapsed = time.monotonic() - start
    me = dist.get_rank() if dist.is_initialized() else None
    who = f"rank {peer}" if peer is not None else "a peer rank (collective)"
    prefix = f"rank {me}: " if me is not None else ""
    detail = str(cause) if cause is not None else ""
    if cause is None or "timed out" in detail.lower() or elapsed >= timeout_s:
        problem = f"{who} did not answer within {timeout_s:g} s"
    else:
        problem = f"the exchange with {who} failed after {elapsed:.1f} s"
    suspect = f"rank {peer}" if peer is not None else "one of the other ranks"
    message = (
        f"{prefix}{problem} while exchanging {what}: {suspect} probably died or is stuck "
        f"(see its log for the first error)"
    )
    if detail:
        message += f" [{type(cause).__name__}: {detail.strip()}]"
    logger.debug("%s", message)
    raise PeerError(message, peer=peer, what=what, timeout_s=timeout_s) from cause
