"""One error report per job: the first failing rank's message, printed once by rank 0.

[Note: error contract] Under torchrun, mpirun or srun every rank runs the same command, and a
failure is often seen on one rank only (an out-of-memory on rank 3, a damaged shard rank 1
reads). The other ranks would wait for it until their timeout, or be killed by the launcher
before anyone printed why. So a job keeps a small side channel on the rendezvous store:

* the first rank to fail posts its message (``compare_set``: the first one wins, so a rank that
  fails *because* a peer died cannot hide the cause);
* a watcher thread on every rank wakes on the post: rank 0 prints the posted message (naming
  the rank it came from) and acknowledges, every rank exits with status 2;
* a failing rank other than 0 prints nothing and waits (at most :data:`ACK_WAIT_S`) for rank
  0's acknowledgement before it exits, so the launcher does not kill rank 0 before it prints.

Without a store (a single process, or the MPI backend) the channel is off and each rank reports
its own errors (rank 0 only prints, as before).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

__all__ = ["FailureChannel", "ACK_WAIT_S", "open_channel"]

#: Seconds a failing rank waits for rank 0 to print its message before exiting anyway.
ACK_WAIT_S = 30.0
_POLL_S = 0.5
_GRACE_S = 1.0


class FailureChannel:
    """The job's failure side channel on a TCP store (see [Note: error contract])."""

    def __init__(self, store: dist.Store, rank: int, prefix: str, report: Callable[[str], None]) -> None:
        self.store = store
        self.rank = rank
        self._key = f"{prefix}/failure"
        self._ack = f"{prefix}/reported"
        self._report = report  # prints the paragraph on rank 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._failing = threading.Event()  # this rank's main thread is reporting its own failure
        self._reported = False
        self._thread = threading.Thread(target=self._watch, name="nowdl-failure-watch", daemon=True)

    def start(self) -> FailureChannel:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching (the run ended normally); the watcher is never left inside a store call."""
        self._done.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * _POLL_S)

    def post(self, message: str) -> str:
        """Post this rank's failure; returns the job's first one (``"rank R: ..."``)."""
        mine = f"rank {self.rank}: {message}" if self.rank != 0 else message
        try:
            return bytes(self.store.compare_set(self._key, "", mine)).decode()
        except Exception:  # the store is gone (its host died): report our own
            return mine

    def fail(self, message: str, *, consequence: bool = False) -> bool:
        """This rank failed with ``message``: post it; rank 0 prints its own message (or, when its
        failure is a ``consequence`` of a peer's, the job's first one) and other ranks wait for
        it. Returns True where it was printed."""
        self._failing.set()
        self._done.set()
        first = self.post(message)
        if self.rank == 0:
            return self._print(first if consequence else message)
        self._wait_ack()
        return False

    def _print(self, message: str) -> bool:
        with self._lock:
            if self._reported:
                return False
            self._reported = True
            self._report(message)
            try:
                self.store.set(self._ack, "1")
            except Exception:
                pass
            return True

    def _wait_ack(self) -> None:
        try:
            self.store.wait([self._ack], timedelta(seconds=ACK_WAIT_S))
        except Exception:
            pass

    def _watch(self) -> None:
        # polls with a quick check rather than a blocking store wait: a thread parked inside a
        # C++ store call when the interpreter exits aborts the process
        while not self._done.wait(_POLL_S):
            try:
                if not self.store.check([self._key]):
                    continue
            except Exception:
                return  # the store is gone (its host exited): the main thread fails on its own
            if self._done.is_set():
                return
            try:
                first = bytes(self.store.get(self._key)).decode()
            except Exception:
                return
            # a failure every rank sees (a planning error) reaches rank 0's main thread within
            # moments: let it report its own words rather than a peer's copy
            if self._failing.wait(_GRACE_S):
                return
            if self.rank == 0:
                self._print(first)
            else:
                self._wait_ack()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)  # the main thread may be stuck in a collective with the failed rank


def open_channel(rank: int, world: int, report: Callable[[str], None], timeout_s: float = 30.0) -> FailureChannel | None:
    """A started channel on the job's rendezvous store (None: single process or no TCP store)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world <= 1 or not addr or not port or not port.isdigit():
        return None
    try:
        store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception:
        return None
    run = os.environ.get("TORCHELASTIC_RUN_ID", "") + "/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return FailureChannel(store, rank, f"nowdl/{run}", report).start()
