"""A rank's end (runtime/launch/group_exit.py): a daemon thread that comes back from a C++ call
while the interpreter finalizes aborts the process; ``exit_rank`` exits before finalization,
after the exit hooks and the non-daemon threads, and ``nowdl`` ranks end that way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nowdl.cli import commands
from nowdl.runtime.launch import group_exit

#: The last exit hook parks a daemon thread in a store wait that times out 0.3 s later, inside
#: the interpreter's finalization (tearing torch down takes about 1 s); a non-daemon thread and
#: another exit hook must still finish; then the process ends as argv[1] says.
_SCRIPT = """
import atexit, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from nowdl.runtime.launch.group_exit import exit_rank

store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=60))

def park():
    try:
        client.wait(["never"], timedelta(seconds=0.3))
    except Exception:
        pass

def write_late():
    time.sleep(0.5)
    print("non-daemon thread finished", flush=True)

atexit.register(lambda: threading.Thread(target=park, daemon=True).start())  # registered first: runs last
atexit.register(lambda: print("exit hook ran", flush=True))
threading.Thread(target=write_late).start()
if sys.argv[1] == "exit_rank":
    exit_rank(3)
sys.exit(3)
"""


def _end(how: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "end.py"
    script.write_text(_SCRIPT)
    return subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="CPython 3.14 parks such a thread instead of unwinding it")
def test_a_thread_back_from_cpp_during_finalization_aborts_the_process(tmp_path: Path) -> None:
    """Why exit_rank exists: a rank whose thread wakes in a store call as it exits ends with SIGABRT."""
    out = _end("sys.exit", tmp_path)
    assert out.returncode == -6, (out.returncode, out.stderr[-2000:])
    assert "terminate called without an active exception" in out.stderr


def test_exit_rank_ends_with_the_status_after_threads_and_hooks(tmp_path: Path) -> None:
    out = _end("exit_rank", tmp_path)
    assert out.returncode == 3, (out.returncode, out.stderr[-2000:])
    assert out.stdout.splitlines() == ["non-daemon thread finished", "exit hook ran"], out.stdout
    assert "terminate called" not in out.stderr


@pytest.mark.parametrize(("env", "exits"), [({"RANK": "0", "WORLD_SIZE": "2"}, True),
                                            ({"RANK": "0", "WORLD_SIZE": "1"}, False)])
def test_a_nowdl_rank_of_a_job_exits_through_exit_rank(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                       exits: bool) -> None:
    """The command line's own process (argv None) of a job of 2+ ranks; a lone process returns."""
    class Exited(Exception):
        pass

    def fake_exit(code: int) -> None:
        raise Exited(code)

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK",
              "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(group_exit, "exit_rank", fake_exit)
    monkeypatch.setattr(sys, "argv", ["nowdl", "show", "no-such-plan.json"])
    if exits:
        with pytest.raises(Exited) as got:
            commands.main()
        assert got.value.args == (2,)  # the error's status, passed on
    else:
        assert commands.main() == 2
    assert commands.main(["show", "no-such-plan.json"]) == 2  # called with argv (tests, --nproc ranks): returns
