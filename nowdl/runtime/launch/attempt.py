"""One attempt of a job: which restart this is, and the rendezvous store keys of this attempt only.

[Note: restarts] ``torchrun --max-restarts N`` restarts every worker of a job when one dies, and
Slurm requeues a job (``--requeue``, a node failure) by starting its batch script again. Each
start is an *attempt*, numbered by ``TORCHELASTIC_RESTART_COUNT`` and ``SLURM_RESTART_COUNT``
(0 or unset: the first). torchrun's static rendezvous keeps one TCP store for all the attempts
of a job and gives the workers of every attempt the same ``MASTER_PORT``: keys a process group
wrote in the store during attempt 0 (each rank's gloo address, barrier counters) are still
there in attempt 1, and a restarted rank that reads them connects to a dead peer ("Gloo
connectFullMesh failed ... Connection refused") or counts a barrier wrong (a hang). So every
key nowdl's process group and failure channel write goes under :func:`attempt_prefix`, which
names the run and the attempt.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

__all__ = ["restart_count", "attempt_prefix", "job_store", "agent_store"]


def _count(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "").strip()
    return int(raw) if raw.isdigit() else 0


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times this job was restarted: torchrun's restarts plus Slurm's requeues (0: the first attempt)."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    return _count(env, "TORCHELASTIC_RESTART_COUNT") + _count(env, "SLURM_RESTART_COUNT")


def attempt_prefix(environ: Mapping[str, str] | None = None) -> str:
    """``nowdl/<run>/<attempt>``: the store prefix of this attempt of this job."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    run = env.get("TORCHELASTIC_RUN_ID", "").strip() or env.get("SLURM_JOB_ID", "").strip() or "job"
    attempt = f"t{_count(env, 'TORCHELASTIC_RESTART_COUNT')}-s{_count(env, 'SLURM_RESTART_COUNT')}"
    return f"nowdl/{run}/{attempt}"


def agent_store(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the store at MASTER_PORT is hosted by torchrun's agent (not by rank 0)."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    return env.get("TORCHELASTIC_USE_AGENT_STORE", "").strip().lower() == "true"


def job_store(host: str, port: int, rank: int, world: int, timeout: timedelta,
              environ: Mapping[str, str] | None = None) -> dist.Store:
    """The rendezvous store of this attempt: a client of torchrun's agent store, else a TCP store
    rank 0 hosts at ``host:port``; its keys under :func:`attempt_prefix`."""
    hosted = not agent_store(environ) and rank == 0
    store = dist.TCPStore(host, port, world, hosted, timeout, multi_tenant=True)  # every rank counts in
    return dist.PrefixStore(f"{attempt_prefix(environ)}/pg", store)
