"""A lost rank is named: which rank (and host) stopped answering, at which step and action, printed once."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import WorkerError, run_workers

from nowdl.errors import NowdlError, ReportedError
from nowdl.runtime.launch.failure import open_channel
from nowdl.runtime.launch.group import PeerError
from nowdl.runtime.launch.lost import peer_loss, report_failure
from nowdl.runtime.launch.where import here, set_action, set_step
from nowdl.schedule import Action

HOST = socket.gethostname()


def _say(message: str) -> None:
    print(f"nowdl run: error: {message}", file=sys.stderr, flush=True)


def _freeze_rank2(rank: int, world: int) -> None:
    open_channel(rank, world, report=_say, timeout_s=5)
    set_step(7)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen, as a rank on a node that went away: no reset connection
    t = torch.zeros(1)
    dist.recv(t, src=2)  # ranks 0 and 1 wait for it; rank 0's watcher sees its beat stop


@pytest.mark.slow
def test_a_silent_rank_is_named_within_the_timeout(capfd: pytest.CaptureFixture[str]) -> None:
    # timeout_s bounds the whole run, the start of 3 fresh interpreters included: 25-80 s on the
    # loaded 2-core machine, so 60 s once ended the run before rank 0 could name rank 2 (5 s)
    with pytest.raises(WorkerError) as e:
        run_workers(_freeze_rank2, 3, timeout_s=300, grace_s=2, start_method="spawn")
    err = capfd.readouterr().err
    line = f"nowdl run: error: rank 2 (host {HOST}) stopped answering: no sign of life for 5 s (the --timeout) " \
           "while rank 0 was at step 7"
    assert err.count(line) == 1 and err.count("nowdl run: error:") == 1, err
    assert "exited with code 2" in e.value.failures[0] and "exited with code 2" in e.value.failures[1], e.value.failures


def _kill_rank0(rank: int, world: int) -> None:
    ch = open_channel(rank, world, report=_say, timeout_s=30)
    set_step(3)
    set_action(Action("F", 1, 0))
    if rank == 0:
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        # a barrier returns on each rank when that rank has its last message, so rank 0 can be
        # gone before a peer's barrier has returned: that peer sees the loss here
        dist.barrier()
        t = torch.zeros(1)
        dist.recv(t, src=0)  # never sent: rank 0 is gone
    except Exception as exc:  # what run_main does with it
        instead = report_failure(exc, rank, world, ch)
        assert isinstance(instead, ReportedError)
        os._exit(2)


@pytest.mark.slow
def test_rank0_lost_is_named_by_one_survivor(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(WorkerError) as e:
        run_workers(_kill_rank0, 3, timeout_s=300, grace_s=15, start_method="spawn")
    err = capfd.readouterr().err
    assert err.count("nowdl run: error:") == 1, err  # rank 0, the usual reporter, is gone: one survivor prints
    assert re.search(rf"nowdl run: error: rank ([12]): rank 0 \(host {HOST}\) stopped answering while rank \1 \(host "
                     rf"{HOST}\) was at step 3, action 1F0 \(forward of stage 1, micro-batch 0\): its process died", err), err
    # the backend's words close the paragraph; gloo words the loss as the timing falls ("Connection closed by
    # peer" after a clean close, "Read error [...]: Connection reset by peer" when rank 0 died with unread
    # bytes, a broken pipe on a write): any of them, as long as they are a peer's loss
    cause = re.search(r"\[(RuntimeError|DistBackendError|DistNetworkError): (.*)\]$", err, re.M)
    assert cause is not None and peer_loss(RuntimeError(cause.group(2))), err
    assert "unexpected" not in err
    assert all("exited with code 2" in e.value.failures[r] for r in (1, 2)), e.value.failures


def test_peer_failures_are_told_from_bugs() -> None:
    assert peer_loss(RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer"))
    assert peer_loss(PeerError("x", peer=1, what="y", timeout_s=1.0))
    assert not peer_loss(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not peer_loss(ValueError("Connection reset by peer"))
    set_step(None)
    assert here() == ""
    set_step(12)
    set_action(Action("B", 0, 3, replica=1))
    assert here() == "step 12, action 0B3' (backward of stage 0, micro-batch 3, replica 1)"
    set_step(None)
    # without a channel (no store): the loss is still named in words a user can act on, not "unexpected"
    got = report_failure(RuntimeError("Connection closed by peer"), 1, 2, None)
    assert isinstance(got, NowdlError) and "an exchange with another rank failed while rank 1" in str(got)
    assert report_failure(KeyError("x"), 1, 2, None) is None
