"""The built-in one-machine launcher: ``nowdl run|predict --nproc N`` forks N ranks after one import.

[Note: local launcher] ``torchrun --nproc-per-node N`` starts an agent process and N fresh
interpreters; each imports torch, nowdl and the model's package (MONAI: ~1.5 s each) before any
work, and on a few cores these imports are most of a small job's wall time. ``--nproc N``
imports all of that once in the parent, then forks the N ranks: each child inherits the loaded
modules and sets the variables torchrun would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` on a free loopback port),
so everything after the launch is the torchrun path. The parent runs no torch op and starts no
CUDA context before the fork (both would be unsafe to inherit).

As one job: the parent waits for every rank; when one exits non-zero it sends the others
SIGTERM, then SIGKILL after ``grace_s``, and exits with the first failure's status. Ctrl-C
reaches every rank through the terminal's process group (each says it was interrupted); the
parent ignores it and waits; SIGTERM to the parent is passed on to the ranks. There is no
restart of a lost rank here: for restarts (``--max-restarts``) and several nodes use torchrun,
srun or mpirun.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from nowdl.errors import NowdlError

__all__ = ["add_nproc_argument", "fork_ranks", "free_port", "preload", "without_nproc"]


def add_nproc_argument(p: argparse.ArgumentParser) -> None:
    """Register ``--nproc N`` on a command's parser (``nowdl run``, ``nowdl predict``)."""
    p.add_argument("--nproc", type=int, metavar="N",
                   help="start N ranks on this machine (forked after importing torch and the model once; no "
                   "restarts: use torchrun, srun or mpirun for those and for several nodes)")


def without_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` less its ``--nproc N`` / ``--nproc=N``: what each forked rank parses."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def preload(modules: Sequence[str], model: str | None) -> None:
    """Import ``modules`` and the package of MODEL (``package.module:callable``, or the one a plan
    JSON records) before the fork. Runs no torch op and touches no GPU. A model that does not
    import is left for the ranks to report with their usual message."""
    for mod in modules:
        importlib.import_module(mod)
    spec = model
    if model is not None and model.lower().endswith(".json"):
        spec = None
        with contextlib.suppress(OSError, ValueError, AttributeError, TypeError, KeyError):
            spec = str(json.loads(Path(model).read_text())["model"]["source"]["spec"])
    if spec and ":" in spec:
        from nowdl.models.resolve import import_callable

        with contextlib.suppress(Exception):
            import_callable(spec, f"model {spec!r}", f"{spec!r} is not callable")


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(rank: int, n: int, port: int, run: Callable[[], int], parent: int) -> None:
    """In the forked rank: the launcher's variables, then ``run``; never returns."""
    with contextlib.suppress(Exception):  # Linux: the rank gets SIGTERM if the launcher dies (even by SIGKILL)
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the launcher died before the line above
        os._exit(1)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n),
                       "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    code = 1
    try:
        code = int(run() or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the rank's last word, then its exit status
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _status(wait_status: int) -> int:
    """A child's exit status as a shell reports it (128 + signal when killed)."""
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def fork_ranks(n: int, run: Callable[[], int], grace_s: float = 30.0, exit_now: bool = False) -> int:
    """Fork ``n`` ranks of one job on this machine, each calling ``run``; the job's exit status.

    ``exit_now`` (the command line's own process): once the ranks are done, the parent exits with
    their status at once, skipping the interpreter's teardown of torch and the model's package
    (~1 s on 2 cores), which frees nothing the operating system does not.

    Raises:
        NowdlError: ``n`` < 1, or this process is already a rank of a launched job.
    """
    if n < 1:
        raise NowdlError(f"--nproc {n}: give the number of ranks to start on this machine (1 or more)")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise NowdlError(f"--nproc {n} inside a launched job (RANK={os.environ['RANK']}, WORLD_SIZE="
                         f"{os.environ['WORLD_SIZE']}): drop --nproc, or run without torchrun/srun/mpirun")
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}
    parent = os.getpid()
    for r in range(n):
        pid = os.fork()
        if pid == 0:
            _child(r, n, port, run, parent)
        ranks[pid] = r
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the ranks hear Ctrl-C themselves

    def _forward(signum: int, _frame: object) -> None:
        _signal(ranks, signum)

    old_term = signal.signal(signal.SIGTERM, _forward)
    try:
        rc = _wait(ranks, grace_s)
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
    if exit_now:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _wait(ranks: dict[int, int], grace_s: float) -> int:
    """Reap the ranks; on the first failure stop the others (SIGTERM, then SIGKILL after ``grace_s``)."""
    live = dict(ranks)
    first: int | None = None
    deadline = float("inf")
    while live:
        for pid in list(live):
            done, st = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                continue
            del live[pid]
            code = _status(st)
            if code != 0 and first is None:
                first = code
                _signal(live, signal.SIGTERM)
                deadline = time.monotonic() + grace_s
        if live and time.monotonic() > deadline:
            _signal(live, signal.SIGKILL)
            deadline = float("inf")
        if live:
            time.sleep(0.02)
    return first or 0


def _signal(pids: dict[int, int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
