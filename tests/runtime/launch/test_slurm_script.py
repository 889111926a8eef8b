"""docs/multinode.md's Slurm batch script, read from the page: its srun line runs under srun's
variables, SIGTERM (``--signal=TERM@...``) saves a checkpoint, and a requeue finishes the run;
the SIGTERM Slurm sends to every process of the step leaves the data loader's workers running."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.run_cli import ROOT, step_losses

from nowdl.cli.commands import main
from nowdl.runtime.data.loader import loader

DOC = ROOT / "docs" / "multinode.md"
TINY = '{"depth": 8, "version": 1, "width": 4, "num_classes": 3}'
#: The doc's 1000 steps become this many. SIGTERM is sent once step 2 is read and must land
#: before the last step. With 6 steps it had 4 steps (0.3 s on the loaded 2-core machine) to do
#: so: a test process that ran 0.5 s late saw both tasks finish (exit 0, nothing to resume), the
#: likely failure of a full suite run. A step takes 40-90 ms there under load (a 1 s late signal stopped
#: a 60-step run at step 25), so 200 steps leave seconds.
STEPS = 200


def _script() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    found = [b for b in blocks if "#SBATCH" in b]
    assert len(found) == 1, "docs/multinode.md should hold one Slurm batch script"
    return found[0]


def _job_id() -> int:
    """A job id whose MASTER_PORT (20000 + id % 20000, as the script computes it) is free now."""
    for port in range(20000 + os.getpid() % 19000, 40000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port - 20000 + 20000 * 7
    raise RuntimeError("no free port in 20000..39999")


def _expand(script: str, tmp: Path, job: int) -> tuple[list[str], dict[str, str]]:
    """The script run by bash with stand-ins for srun, scontrol and nowdl: srun's argv and the exports."""
    harness = ("srun() { printf '%s\\n' \"$@\" > srun.args; }\n"
               "scontrol() { echo 127.0.0.1; }\n"
               "nowdl() { :; }\n" + script +
               "\necho \"$MASTER_ADDR $MASTER_PORT\" > master.txt\n")
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": str(job), "SLURM_CPUS_PER_TASK": "2",
           "SLURM_JOB_NODELIST": "node[0-1]"}
    subprocess.run(["bash", "-euc", harness], cwd=tmp, env=env, check=True, timeout=30)
    addr, port = (tmp / "master.txt").read_text().split()
    return (tmp / "srun.args").read_text().splitlines(), {"MASTER_ADDR": addr, "MASTER_PORT": port}


def test_script_has_what_a_long_job_needs() -> None:
    script = _script()
    assert re.search(r"^#SBATCH --signal=TERM@\d+$", script, re.M)  # saves before the time limit
    assert re.search(r"^#SBATCH --cpus-per-task=\d+$", script, re.M)
    assert re.search(r"^#SBATCH --requeue$", script, re.M)
    assert re.search(r"^export MASTER_PORT=.*SLURM_JOB_ID", script, re.M)  # job-unique
    assert "--checkpoint " in script and "--save-every " in script and "--workers " in script


def _tasks(argv: list[str], tmp: Path, master: dict[str, str], job: int, restart: int) -> list[subprocess.Popen[str]]:
    """The two tasks, in one process group of their own: one ``killpg`` signals both at once, as
    Slurm signals every task of the step (two ``kill`` calls leave a gap in which the first task
    could stop, save and exit, and the second then dies of a SIGTERM it no longer handles)."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT") and not k.startswith(("SLURM_", "OMPI_"))}
    procs = []
    for r in range(2):  # two nodes of one task, as srun --distribution=block starts them
        env = {**base, **master, "NOWDL_BACKEND": "gloo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
               "SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": str(r),
               "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_ID": str(job), "SLURM_CPUS_PER_TASK": "2",
               "SLURM_RESTART_COUNT": str(restart)}
        procs.append(subprocess.Popen([sys.executable, *argv], cwd=tmp, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      process_group=procs[0].pid if procs else 0))
    return procs


@pytest.mark.slow
def test_script_launch_line_saves_on_sigterm_and_finishes_when_requeued(tmp_path: Path) -> None:
    job = _job_id()
    argv, master = _expand(_script(), tmp_path, job)
    assert master["MASTER_PORT"] == str(20000 + job % 20000)
    assert argv[:argv.index("python")] == ["--distribution=block", "--cpus-per-task=2"]
    run = argv[argv.index("python") + 1:]
    assert run[:3] == ["-m", "nowdl", "run"] and "--workers" in run and run[run.index("--workers") + 1] == "1"
    # the doc's 64-GPU plan becomes a 2-node plan of a small model, its 1000 steps STEPS; the rest as written
    assert main(["plan", "resnet", "--model-args", TINY, "--input", "2x3x16x16", "--gpus", "2", "--nodes", "2",
                 "--gpus-per-node", "1", "--stages", "2", "--micro-batches", "2", "--dp", "1", "--replicas", "1",
                 "--device-spec", "cpu", "--out", str(tmp_path / run[3])]) == 0
    run[run.index("--steps") + 1] = str(STEPS)
    ckpt = tmp_path / run[run.index("--checkpoint") + 1]

    first = _tasks(run, tmp_path, master, job, 0)
    assert first[0].stdout is not None
    seen, deadline = "", time.monotonic() + 240
    while f"step 2/{STEPS}" not in seen and time.monotonic() < deadline and first[0].poll() is None:
        seen += first[0].stdout.readline()
    os.killpg(first[0].pid, signal.SIGTERM)  # Slurm signals every task of the step
    outs = [p.communicate(timeout=240) for p in first]
    out = seen + outs[0][0]
    assert [p.returncode for p in first] == [143, 143], [o[1][-2000:] for o in outs]
    assert not any("node(s)" in o[1] for o in outs), outs  # no "the job runs on 1 node(s)": srun's 2 nodes were read
    m = re.search(rf"interrupted at step (\d+): resume with the same command \(SIGTERM; step \d+ of {STEPS}", out)
    assert m is not None and f"saved checkpoint at step {m.group(1)} to {ckpt.relative_to(tmp_path)}" in out, out
    stop = int(m.group(1))
    assert 2 <= stop < STEPS, out  # stopped mid-run, so the requeue has steps to train
    assert (ckpt / "latest").read_text() == f"step-{stop:08d}"
    # a requeue (SLURM_RESTART_COUNT=1) runs the same line: it resumes and ends at step STEPS
    second = _tasks(run, tmp_path, master, job, 1)
    outs = [p.communicate(timeout=240) for p in second]
    assert [p.returncode for p in second] == [0, 0], [o[1][-2000:] for o in outs]
    assert f"resumed from {ckpt.relative_to(tmp_path)} at step {stop}" in outs[0][0], outs[0][0]
    assert min(step_losses(outs[0][0])) == stop + 1 and max(step_losses(outs[0][0])) == STEPS, outs[0][0]


@pytest.mark.slow
def test_sigterm_to_every_process_of_a_task_saves_with_loader_workers(tmp_path: Path) -> None:
    """Slurm signals every process of the step, the loader workers too: a worker that died of it
    made the rank fail ("DataLoader worker ... is killed by signal: Terminated") without saving."""
    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (tmp_path / "data" / cls).mkdir(parents=True)
        for i in range(8):
            np.save(tmp_path / "data" / cls / f"{i}.npy", rng.integers(0, 255, (3, 16, 16), dtype=np.uint8))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.Popen([sys.executable, "-m", "nowdl", "run", "resnet", "--model-args", TINY, "--num-classes", "2",
                          "--input", "1x3x16x16", "--steps", str(STEPS), "--batch-size", "4", "--data",
                          "imagefolder:data", "--workers", "1", "--checkpoint", "ck"], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0)
    assert p.stdout is not None
    seen, deadline = "", time.monotonic() + 240
    while f"step 2/{STEPS}" not in seen and time.monotonic() < deadline and p.poll() is None:
        seen += p.stdout.readline()
    os.killpg(p.pid, signal.SIGTERM)  # the task and its loader worker
    out, err = p.communicate(timeout=240)
    assert p.returncode == 143 and "error" not in err, err
    m = re.search(r"interrupted at step (\d+): resume with the same command \(SIGTERM", seen + out)
    assert m is not None and (tmp_path / "ck" / "latest").read_text() == f"step-{int(m.group(1)):08d}", seen + out


def test_loader_workers_outlive_sigterm_and_ctrl_c() -> None:
    """Slurm's SIGTERM and a terminal's Ctrl-C (SIGINT) reach the loader workers too: they live on."""
    ds = torch.utils.data.TensorDataset(torch.arange(64.0).view(16, 4), torch.zeros(16, dtype=torch.long))
    it = iter(loader(ds, 4, workers=1, steps=4))
    next(it)
    worker = it._workers[0]  # type: ignore[attr-defined]
    os.kill(worker.pid, signal.SIGTERM)
    os.kill(worker.pid, signal.SIGINT)
    time.sleep(0.5)
    assert worker.is_alive() and len(list(it)) == 3
