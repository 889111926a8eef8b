"""A peer that died mid-run, named: which rank (and host) stopped answering, at which step and action.

A rank learns that a peer is gone from the backend (gloo: "Connection reset by peer", "Connection
closed by peer"; NCCL: a communicator error; a deadline: :class:`PeerError`). :func:`peer_loss`
tells such an error from others, and :func:`lost_message` turns it into one paragraph that names
the ranks whose beat stopped ([Note: lost ranks] in runtime/launch/failure.py), this rank's step
and action (runtime/launch/where.py), what happens next, and the backend's first line.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from nowdl.errors import NowdlError, ReportedError, error_text
from nowdl.runtime.launch.failure import FailureChannel
from nowdl.runtime.launch.group import PeerError
from nowdl.runtime.launch.where import here

__all__ = ["peer_loss", "lost_message", "report_failure"]

_SIGNS = ("connection reset", "connection closed", "broken pipe", "connection refused", "socket closed",
          "end of file", "communicator was aborted", "remote process exited", "no route to host",
          "connectfullmesh", "unhandled system error", "nccl error", "timed out")
_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")


def peer_loss(e: BaseException) -> bool:
    """Whether ``e`` says an exchange with another rank failed (not a bug of this rank)."""
    if isinstance(e, PeerError):
        return True
    if not isinstance(e, RuntimeError):
        return False
    text = str(e).lower()
    return type(e).__name__ in _TYPES or any(sign in text for sign in _SIGNS)


def _first_line(e: BaseException) -> str:
    """``Type: the backend's words``, without gloo's source path and boilerplate."""
    if isinstance(e, PeerError) and e.__cause__ is not None:
        return f"{e.what}: {_first_line(e.__cause__)}"
    text = (str(e).strip().splitlines() or [""])[0]
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)
    text = text.split(". This is typically caused")[0]
    return f"{type(e).__name__}: {text[:300]}"


def lost_message(e: BaseException, rank: int, channel: FailureChannel | None) -> tuple[str, list[int]]:
    """One paragraph for the peer failure ``e`` seen by ``rank``, and the ranks found lost (the
    ranks whose beat stood still; ``[0]`` when the store rank 0 hosted is gone). Takes up to
    :data:`~nowdl.runtime.launch.failure.SETTLE_S` seconds (watching the beats)."""
    at = here() or "setup"
    me = f"rank {rank} (host {socket.gethostname()})"
    after = ("; the job stops (exit status 2): with --checkpoint, torchrun --max-restarts N or a Slurm requeue "
             "restarts it from the latest complete checkpoint")
    cause = f" [{_first_line(e)}]"
    lost = channel.silent() if channel is not None else []
    if lost is None:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return (f"the job's rendezvous store at {where} stopped answering while {me} was at {at}: rank 0 or the "
                f"node hosting the store was lost (its process died, was killed, ran out of memory){after}{cause}",
                [0])
    if lost:
        assert channel is not None
        verb = "stopped" if len(lost) == 1 else "all stopped"
        return (f"{channel.name(lost)} {verb} answering while {me} was at {at}: its process died (killed, out of "
                f"memory) or its node was lost{after}{cause}", lost)
    if isinstance(e, PeerError):
        return str(e), []
    return (f"an exchange with another rank failed while {me} was at {at}: a peer died or closed its connection "
            f"(see the other ranks' logs for the first error){after}{cause}", [])


@contextmanager
def _term_held() -> Iterator[None]:
    """SIGTERM ignored while the failure is reported: torchrun sends it to the surviving workers
    the moment one dies, and the report (naming the lost rank) takes a few seconds."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def report_failure(e: BaseException, rank: int, world: int, channel: FailureChannel | None) -> BaseException | None:
    """Report ``e``, which stopped this rank of a ``world``-rank job, once for the whole job.

    Returns what to raise instead of ``e``: :class:`~nowdl.errors.ReportedError` when the channel
    reported it, a :class:`~nowdl.errors.NowdlError` naming the lost rank when a peer's loss
    caused it and there is no channel, None to raise ``e`` as it is.
    """
    with _term_held():
        loss = world > 1 and peer_loss(e)
        text, lost = lost_message(e, rank, channel) if loss else (error_text(e), [])
        if channel is None:
            return NowdlError(text) if loss else None
        channel.fail(text, consequence=loss, lost=lost)  # rank 0 prints the job's first failure
    return ReportedError(text)
