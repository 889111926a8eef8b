"""The built-in launcher ``--nproc N`` ([Note: local launcher]): ranks forked here, failing as one job."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from nowdl.errors import NowdlError
from nowdl.runtime.launch.local import fork_ranks, without_nproc


@pytest.fixture()
def alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


def test_every_rank_gets_torchruns_variables(alone: None, tmp_path: Path) -> None:
    def run() -> int:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
        (tmp_path / f"r{os.environ['RANK']}.json").write_text(json.dumps({k: os.environ[k] for k in keys}))
        return 0

    assert fork_ranks(3, run) == 0
    seen = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(3)]
    assert [s["RANK"] for s in seen] == ["0", "1", "2"] == [s["LOCAL_RANK"] for s in seen]
    assert {s["WORLD_SIZE"] for s in seen} == {"3"} == {s["LOCAL_WORLD_SIZE"] for s in seen}
    assert len({s["MASTER_PORT"] for s in seen}) == 1 and seen[0]["MASTER_ADDR"] == "127.0.0.1"
    assert "RANK" not in os.environ  # the parent's environment is untouched


def test_first_failure_stops_the_others(alone: None, tmp_path: Path) -> None:
    def run() -> int:
        if os.environ["RANK"] == "1":
            raise SystemExit(3)
        time.sleep(120)  # rank 0 would hang on its peer: the launcher stops it
        (tmp_path / "finished").touch()
        return 0

    assert fork_ranks(2, run, grace_s=60) == 3  # the first failure's status; SIGTERM ended rank 0 at once
    assert not (tmp_path / "finished").exists()


def test_failure_status_and_exception(alone: None, tmp_path: Path) -> None:
    def fails() -> int:
        if os.environ["RANK"] == "0":
            raise RuntimeError("boom")
        return 0

    assert fork_ranks(2, fails) == 1  # an exception is exit status 1, its traceback on stderr
    assert fork_ranks(2, lambda: 0) == 0


def test_ignoring_sigterm_is_killed_after_the_grace(alone: None) -> None:
    import signal

    def run() -> int:
        if os.environ["RANK"] == "1":
            return 2
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)
        return 0

    assert fork_ranks(2, run, grace_s=0.5) == 2  # the first failure's status, rank 0 SIGKILLed


def test_refusals(monkeypatch: pytest.MonkeyPatch, alone: None) -> None:
    with pytest.raises(NowdlError, match=r"--nproc 0: give the number of ranks"):
        fork_ranks(0, lambda: 0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(NowdlError, match=r"--nproc 2 inside a launched job \(RANK=1, WORLD_SIZE=2\): drop --nproc"):
        fork_ranks(2, lambda: 0)


def test_without_nproc() -> None:
    assert without_nproc(["predict", "m", "--nproc", "2", "--out", "x"]) == ["predict", "m", "--out", "x"]
    assert without_nproc(["run", "--nproc=4", "--steps", "1"]) == ["run", "--steps", "1"]


def test_ranks_end_when_the_launcher_is_killed(tmp_path: Path) -> None:
    """SIGKILL of the launcher leaves no rank behind (PR_SET_PDEATHSIG sends each SIGTERM)."""
    import signal
    import subprocess
    import sys

    script = ("import os, time\nfrom nowdl.runtime.launch.local import fork_ranks\n"
              f"def run():\n    open(os.path.join({str(tmp_path)!r}, os.environ['RANK']), 'w').write(str(os.getpid()))\n"
              "    time.sleep(120)\n    return 0\nfork_ranks(2, run)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        for _ in range(600):
            if all((tmp_path / r).exists() and (tmp_path / r).read_text() for r in ("0", "1")):
                break
            time.sleep(0.05)
        pids = [int((tmp_path / r).read_text()) for r in ("0", "1")]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except OSError:
            return False

    for _ in range(200):
        alive = [p for p in pids if running(p)]
        if not alive:
            break
        time.sleep(0.05)
    assert not alive, f"ranks {alive} outlived their launcher"
