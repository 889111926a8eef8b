"""One error report per job: the first failing rank's message, printed once; lost ranks named.

[Note: error contract] Under torchrun, mpirun or srun every rank runs the same command, and a
failure is often seen on one rank only (an out-of-memory on rank 3, a damaged shard rank 1
reads). The other ranks would wait for it until their timeout, or be killed by the launcher
before anyone printed why. So a job keeps a small side channel on the rendezvous store (its
keys under this attempt's prefix, runtime/launch/attempt.py):

* the first rank to fail posts its message (``compare_set``: the first one wins, so a rank that
  fails *because* a peer died cannot hide the cause);
* a watcher thread on every rank wakes on the post: rank 0 prints the posted message (naming
  the rank it came from) and acknowledges, every rank exits with status 2;
* a failing rank other than 0 prints nothing and waits (at most :data:`ACK_WAIT_S`) for rank
  0's acknowledgement before it exits, so the launcher does not kill rank 0 before it prints.

[Note: lost ranks] The watcher thread also beats: it adds 1 to the rank's counter in the store
every :data:`BEAT_S` seconds, and rank 0's watcher checks every rank's counter. A rank whose
counter stops moving for ``silence_s`` (the run's ``--timeout``) is lost (its process was
SIGKILLed, the OOM killer took it, its node went down, or it is frozen): rank 0 posts "rank R
(host H) stopped answering at step S, action A" as the job's failure. A rank whose exchange with
a peer fails (a reset connection, a deadline) looks at the counters for :data:`SETTLE_S`
seconds first and names the ranks whose counters stood still (:meth:`FailureChannel.silent`).
When rank 0 is among the lost, the first surviving rank to fail prints instead; when the store
itself is gone (rank 0 hosted it under srun/mpirun), each surviving rank prints its own message.

Without a store (a single process, or the MPI backend) the channel is off and each rank reports
its own errors (rank 0 only prints, as before).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist

from nowdl.runtime.launch.attempt import attempt_prefix
from nowdl.runtime.launch.where import here

__all__ = ["FailureChannel", "ACK_WAIT_S", "BEAT_S", "SETTLE_S", "open_channel"]

#: Seconds a failing rank waits for rank 0 to print its message before exiting anyway.
ACK_WAIT_S = 30.0
#: Seconds between two beats of a rank's watcher thread.
BEAT_S = 0.5
#: Seconds a rank whose exchange failed watches the counters before naming the silent ranks.
SETTLE_S = 3.0
_GRACE_S = 1.0


class FailureChannel:
    """The job's failure side channel on a TCP store (see [Note: error contract], [Note: lost ranks])."""

    def __init__(self, store: dist.Store, rank: int, prefix: str, report: Callable[[str], None], *,
                 world: int = 1, silence_s: float = 300.0) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.silence_s = silence_s
        self._prefix = prefix
        self._key = f"{prefix}/failure"
        self._ack = f"{prefix}/reported"
        self._report = report  # prints the paragraph
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._failing = threading.Event()  # this rank's main thread is reporting its own failure
        self._reported = False
        self._hosts: dict[int, str] = {}
        #: called before the watcher ends the process (a peer failed): temporary folders to remove
        self.before_exit: list[Callable[[], object]] = []
        self._thread = threading.Thread(target=self._watch, name="nowdl-failure-watch", daemon=True)

    def start(self) -> FailureChannel:
        try:
            self.store.set(f"{self._prefix}/host/{self.rank}", socket.gethostname())
            self._beat()
        except Exception:  # noqa: BLE001 - the channel is best effort; the run goes on without it
            pass
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching (the run ended); the watcher is never left inside a store call."""
        self._done.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * BEAT_S)

    # ---- who is alive --------------------------------------------------------------------------
    def _beat(self) -> None:
        self.store.add(f"{self._prefix}/beat/{self.rank}", 1)

    def _counts(self) -> list[int]:
        keys = [f"{self._prefix}/beat/{r}" for r in range(self.world)]
        return [int(self.store.add(k, 0)) for k in keys]

    def host(self, rank: int) -> str:
        """The host name ``rank`` registered ("?" when unknown)."""
        if rank not in self._hosts:
            try:
                key = f"{self._prefix}/host/{rank}"
                self._hosts[rank] = bytes(self.store.get(key)).decode() if self.store.check([key]) else "?"
            except Exception:  # noqa: BLE001
                return "?"
        return self._hosts[rank]

    def silent(self, settle_s: float = SETTLE_S) -> list[int] | None:
        """The other ranks whose beat counters stood still over ``settle_s`` seconds (None: the
        store is gone, which under srun/mpirun means rank 0, its host, is)."""
        try:
            before = self._counts()
            time.sleep(settle_s)
            after = self._counts()
        except Exception:  # noqa: BLE001
            return None
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]

    def name(self, ranks: Sequence[int]) -> str:
        """``"rank 1 (host a)"``, ``"ranks 1 (host a) and 3 (host b)"``."""
        shown = [f"{r} (host {self.host(r)})" for r in ranks]
        return ("rank " if len(shown) == 1 else "ranks ") + (
            shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1])

    # ---- failing -------------------------------------------------------------------------------
    def post(self, message: str) -> str:
        """Post this rank's failure; returns the job's first one (``"rank R: ..."``)."""
        return self._post(message)[0]

    def _post(self, message: str) -> tuple[str, bool]:
        mine = f"rank {self.rank}: {message}" if self.rank != 0 else message
        try:
            return bytes(self.store.compare_set(self._key, "", mine)).decode(), True
        except Exception:  # noqa: BLE001 - the store is gone (its host died): report our own
            return mine, False

    def fail(self, message: str, *, consequence: bool = False, lost: Sequence[int] = ()) -> bool:
        """This rank failed with ``message``: post it; rank 0 prints its own message (or, when its
        failure is a ``consequence`` of a peer's, the job's first one) and other ranks wait for
        it. When rank 0 is ``lost`` the first surviving rank to get here prints; when the store is
        gone every rank prints its own. Returns True where it was printed."""
        self._failing.set()
        first, stored = self._post(message)
        if not stored:
            return self._print(f"rank {self.rank}: {message}" if self.rank else message)
        if self.rank == 0:
            return self._print(first if consequence else message)
        if 0 in lost and self._claim():
            return self._print(first)
        self._wait_ack()
        return False

    def _claim(self) -> bool:
        try:
            won = bytes(self.store.compare_set(f"{self._prefix}/printer", "", str(self.rank))).decode()
        except Exception:  # noqa: BLE001
            return True
        return won == str(self.rank)

    def _print(self, message: str) -> bool:
        with self._lock:
            if self._reported:
                return False
            self._reported = True
            self._report(message)
            try:
                self.store.set(self._ack, "1")
            except Exception:  # noqa: BLE001
                pass
            return True

    def _wait_ack(self) -> None:
        try:
            self.store.wait([self._ack], timedelta(seconds=ACK_WAIT_S))
        except Exception:  # noqa: BLE001
            pass

    # ---- the watcher thread ----------------------------------------------------------------------
    def _watch(self) -> None:
        # polls with a quick check rather than a blocking store wait: a thread parked inside a
        # C++ store call when the interpreter exits aborts the process
        every = max(BEAT_S, min(self.silence_s / 4, 10.0))  # rank 0 looks at the counters this often
        last: list[int] = []
        moved: list[float] = []
        looked = 0.0
        while not self._done.wait(BEAT_S):
            try:
                self._beat()
                posted = self.store.check([self._key])
                now = time.monotonic()
                if self.rank == 0 and self.world > 1 and not posted and not self._failing.is_set() \
                        and now - looked >= every:
                    looked, counts = now, self._counts()
                    moved = [now if not last or c != last[r] else moved[r] for r, c in enumerate(counts)]
                    last = counts
                    lost = [r for r in range(1, self.world) if now - moved[r] > self.silence_s]
                    if lost:
                        self._post_lost(lost)
                        continue
            except Exception:  # noqa: BLE001
                return  # the store is gone (its host exited): the main thread fails on its own
            if not posted or self._failing.is_set():
                continue
            self._on_post()

    def _post_lost(self, lost: list[int]) -> None:
        """Rank 0's watcher saw no beat from ``lost`` for ``silence_s``: post them as the job's failure."""
        self._post(f"{self.name(lost)} stopped answering: no sign of life for {self.silence_s:g} s (the --timeout) "
                   f"while rank 0 was at {here() or 'setup'}; its process died (killed, out of memory) or is frozen, "
                   "or its node was lost: see its log for the first error")

    def _on_post(self) -> None:
        # a failure every rank sees (a planning error) reaches rank 0's main thread within
        # moments: let it report its own words rather than a peer's copy
        if self._failing.wait(_GRACE_S):
            return
        try:
            first = bytes(self.store.get(self._key)).decode()
        except Exception:  # noqa: BLE001
            first = ""
        if self.rank == 0 and first:
            self._print(first)
        else:
            self._wait_ack()
        for clean in self.before_exit:
            try:
                clean()
            except Exception:  # noqa: BLE001 - exiting matters more
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)  # the main thread may be stuck in a collective with the failed rank


def open_channel(rank: int, world: int, report: Callable[[str], None], timeout_s: float = 30.0
                 ) -> FailureChannel | None:
    """A started channel on the job's rendezvous store (None: single process or no TCP store);
    a rank silent for ``timeout_s`` is reported lost."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world <= 1 or not addr or not port or not port.isdigit():
        return None
    try:
        store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001
        return None
    return FailureChannel(store, rank, attempt_prefix(), report, world=world, silence_s=timeout_s).start()
