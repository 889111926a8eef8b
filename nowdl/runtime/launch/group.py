"""Launch layer of the distributed runtime: join the group, and wait on peers with a deadline.

:func:`launch_env` (``runtime/launch/launcher.py``) reads torchrun's, srun's or mpirun's
variables (none means a single process), :func:`init_distributed` joins the default process
group on a rendezvous store whose keys belong to this attempt of the job only ([Note:
restarts] in ``runtime/launch/attempt.py``), and :func:`wait` waits for an asynchronous
send/receive/collective with a deadline, turning a silent hang on a dead peer into a
:class:`PeerError` that names the peer, what was being exchanged and where this rank was
(``runtime/launch/where.py``).

[Note: NCCL device] Before the group starts, each process makes ``cuda:LOCAL_RANK`` its current
device (torch requires it for NCCL: object collectives, barrier and batched p2p use the current
device) and, under NCCL, passes it as ``device_id``, which binds the process to it: the
communicator forms at once (a bad GPU or network fails here, not at the first step) and the
runtime's sub-groups are split from it. NCCL takes one GPU per rank; when a node's ranks
outnumber its GPUs and no backend was asked for, the ranks use gloo, bound to
``LOCAL_RANK % GPUs``, with CUDA tensors staged through host memory ([Note: host staging] in
``runtime/launch/comm.py``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from nowdl.backends import BACKENDS, backend_name
from nowdl.errors import NowdlError
from nowdl.runtime.launch.attempt import job_store
from nowdl.runtime.launch.comm import Waitable
from nowdl.runtime.launch.group_exit import destroy_at_exit
from nowdl.runtime.launch.launcher import LAUNCHER_VAR, LaunchEnv, launch_env
from nowdl.runtime.launch.where import here

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


def _gpus_per_rank(env: LaunchEnv) -> tuple[int, int]:
    """(ranks on this node, GPUs this process sees); the ranks are ``local_rank + 1`` at least."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(env.local_world_size or 0, env.local_rank + 1), count


def _auto_backend(env: LaunchEnv, environ: Mapping[str, str] | None) -> str:
    """:func:`default_backend`, but gloo when this node's ranks outnumber its GPUs (NCCL takes one
    GPU per rank; gloo moves CUDA tensors through host memory: [Note: host staging] in
    runtime/launch/comm.py). Every rank of a node decides alike from LOCAL_WORLD_SIZE."""
    name = default_backend(environ)
    env_vars: Mapping[str, str] = os.environ if environ is None else environ
    ranks, gpus = _gpus_per_rank(env)
    if name == "nccl" and not env_vars.get("NOWDL_BACKEND", "").strip() and env.local_world_size and ranks > gpus:
        logger.info("%d ranks share %d GPU(s) on this node: NCCL takes one GPU per rank, so the ranks use gloo, "
                    "which moves CUDA tensors through host memory", ranks, gpus)
        return "gloo"
    return name


def _set_device(env: LaunchEnv, backend: str) -> torch.device | None:
    """Make ``cuda:local_rank`` (modulo the GPUs seen: several ranks may share one under gloo) this
    process's current device before the group starts, as NCCL requires; returns it (None without CUDA)."""
    ranks, count = _gpus_per_rank(env)
    if count == 0:
        return None
    if backend == "nccl" and ranks > count:
        raise NowdlError(
            f"rank {env.rank} is one of {ranks} ranks on this node (local rank {env.local_rank}) but the node has "
            f"{count} GPU(s) and NCCL takes one GPU per rank: start at most {count} processes per node "
            f"(--nproc-per-node {count}), or use backend='gloo' (NOWDL_BACKEND=gloo), which lets ranks share a GPU "
            "and moves CUDA tensors through host memory"
        )
    index = env.local_rank % count
    torch.cuda.set_device(index)
    if env.local_rank >= count:
        logger.info("local rank %d shares GPU %d (%d visible)", env.local_rank, index, count)
    return torch.device("cuda", index)


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
    name = _check_backend(backend, "backend") if backend is not None else _auto_backend(env, environ)
    timeout = timedelta(seconds=timeout_s)
    device = _set_device(env, name)
    bind = device if name == "nccl" else None  # [Note: NCCL device]
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
        dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=bind)
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
            os.environ[LAUNCHER_VAR] = env.launcher  # later reads keep this launcher's node layout
        logger.info("rank %d/%d (%s, local %d) joining %s at %s:%d", env.rank, env.world_size,
                    env.launcher, env.local_rank, name, env.master_addr, env.master_port)
        try:
            store = job_store(env.master_addr, env.master_port, env.rank, env.world_size, timeout, environ)
            dist.init_process_group(name, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout,
                                    device_id=bind)
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


def wait(work: Waitable | None, *, timeout_s: float, what: str, peer: int | None) -> None:
    """Wait for an async send/receive/collective ``work`` for at most ``timeout_s`` seconds.

    ``work`` is what ``isend``/``irecv``/``all_reduce(..., async_op=True)`` of torch.distributed
    or of ``runtime/launch/comm.py`` return; ``None`` (they return it when this rank is not in
    the group) means nothing to wait for.

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
    at = here()
    message = (
        f"{prefix}{problem} while exchanging {what}{' at ' + at if at else ''}: {suspect} probably died or is stuck "
        f"(see its log for the first error)"
    )
    if detail:
        message += f" [{type(cause).__name__}: {detail.strip()}]"
    logger.debug("%s", message)
    raise PeerError(message, peer=peer, what=what, timeout_s=timeout_s) from cause
