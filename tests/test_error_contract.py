"""The error contract: every bad input gives one paragraph (rank 0 only), exit 2, and writes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import WorkerError, run_workers
from helpers.run_cli import free_port, step_losses

import nowdl
from nowdl.cli.commands import main

ROOT = Path(__file__).resolve().parents[1]
TINY = '{"depth": 8, "version": 1, "width": 4, "num_classes": 3}'
RUN = ["run", "resnet", "--model-args", TINY, "--input", "1x3x16x16", "--batch-size", "2", "--steps", "1"]
PLAN = ["plan", "resnet", "--model-args", TINY, "--input", "1x3x16x16", "--gpus", "1"]


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A single process with no launcher variables, working in an empty folder."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
                "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _fixtures(d: Path) -> dict[str, str]:
    """Files the bad inputs point at (made before the listing, so they do not count as written)."""
    (d / "afile").write_text("not a folder")
    (d / "notjson.json").write_text("{")
    future = json.loads(json.dumps({"format": "nowdl.plan", "version": 99}))
    (d / "future.json").write_text(json.dumps(future))
    (d / "ck_nopointer").mkdir()
    (d / "ck_nopointer" / "step-00000001").mkdir()
    (d / "ck_badpointer").mkdir()
    (d / "ck_badpointer" / "latest").write_text("step-00000007")
    (d / "ck_nojson").mkdir()
    (d / "ck_nojson" / "step-00000001").mkdir()
    (d / "ck_nojson" / "latest").write_text("step-00000001")
    (d / "empty").mkdir()
    spec = {"name": "x", "fp32_flops": 1e12, "bf16_flops": 1e12, "fp16_flops": 1e12, "mem_bw": 1e11,
            "link_bw": 1e10, "memory_bytes": 2**30, "link_latency_s": -1}
    (d / "badspec.json").write_text(json.dumps(spec))
    return {k: str(d / k) for k in ("afile", "notjson.json", "future.json", "ck_nopointer", "ck_badpointer",
                                    "ck_nojson", "empty", "badspec.json")}


CLI_CASES: list[tuple[str, list[str], str]] = [
    ("unknown model", ["plan", "nosuchmodel", "--gpus", "2"], "unknown model 'nosuchmodel'"),
    ("model args not JSON", ["plan", "resnet", "--model-args", "{depth", "--gpus", "2"], "not valid JSON"),
    ("model args not an object", ["plan", "resnet", "--model-args", "[1]", "--gpus", "2"], "JSON object"),
    ("module not importable", ["plan", "nosuchpkg.mod:Net", "--gpus", "2"], "cannot import 'nosuchpkg.mod'"),
    ("no such attribute", ["plan", "monai.networks.nets:NoSuchNet", "--gpus", "2"], "has no attribute 'NoSuchNet'"),
    ("callable rejects args", ["plan", "monai.networks.nets:UNet", "--model-args", '{"bogus": 1}', "--gpus", "2"],
     "failed: TypeError"),
    ("bad model hyperparameter", ["plan", "resnet", "--model-args", '{"depth": 8}', "--gpus", "1"], "depth must be"),
    ("gpus zero", [*PLAN[:-2], "--gpus", "0"], "gpus must be a positive integer"),
    ("gpus not a number", [*PLAN[:-2], "--gpus", "two"], "invalid int value"),
    ("bad input shape", ["plan", "resnet", "--input", "1x3xabc", "--gpus", "1"], "abc"),
    ("bad memory size", [*PLAN, "--gpu-memory", "12 parsecs"], "parsecs"),
    ("more stages than gpus", [*PLAN[:-2], "--gpus", "2", "--stages", "5"], "no configuration of 2 GPUs"),
    ("unknown device spec", [*PLAN, "--device-spec", "tpu9"], "tpu9"),
    ("device spec bad calibrated field", [*PLAN, "--device-spec", "<badspec.json>"], "'link_latency_s' must be"),
    ("zero spatial parts", [*PLAN, "--spatial-parts", "0"], "--spatial-parts"),
    ("negative time limit", [*PLAN, "--time-limit", "-1"], "time_limit must be positive"),
    ("unknown option", [*PLAN, "--bogus"], "unrecognized arguments: --bogus"),
    ("plan out under a file", [*PLAN, "--out", "<afile>/plan.json"], "afile"),
    ("plot of unknown format", [*PLAN, "--plot", "picture.xyz"], "unknown picture format '.xyz'"),
    ("calibrate one rank", ["calibrate", "--ranks", "1"], "--ranks must be an integer >= 2"),
    ("calibrate out under a file", ["calibrate", "--out", "<afile>/spec.json"], "afile is a file"),
    ("calibrate out is a folder", ["calibrate", "--out", "<empty>"], "is a folder"),
    ("calibrate zero threads", ["calibrate", "--threads", "0"], "--threads must be a positive integer"),
    ("calibrate zero repeats", ["calibrate", "--repeats", "0"], "--repeats must be a positive integer"),
    ("calibrate unknown backend", ["calibrate", "--backend", "mpi"], "invalid choice: 'mpi'"),
    ("show missing plan", ["show", "missing.json"], "missing.json"),
    ("show not JSON", ["show", "<notjson.json>"], "not valid JSON"),
    ("show plan from the future", ["show", "<future.json>"], "future.json"),
    ("codegen missing plan", ["codegen", "missing.json", "--out", "gen"], "missing.json"),
    ("report missing folder", ["report", "nolog"], "nolog"),
    ("profile unknown sort", ["profile", "resnet", "--sort", "color"], "invalid choice: 'color'"),
    ("run steps zero", [*RUN[:-1], "0"], "--steps must be a positive integer"),
    ("run batch zero", [*RUN[:6], "--batch-size", "0", "--steps", "1"], "--batch-size must be a positive integer"),
    ("run negative lr", [*RUN, "--lr", "-1"], "--lr -1.0 must be a positive number"),
    ("run timeout zero", [*RUN, "--timeout", "0"], "--timeout must be positive"),
    ("run unknown device spec", [*RUN, "--device-spec", "tpu9"], "unknown device spec 'tpu9'"),
    ("run save-every zero", [*RUN, "--checkpoint", "ck", "--save-every", "0"], "--save-every must be a positive"),
    ("run save-every without checkpoint", [*RUN, "--save-every", "2"], "--save-every needs --checkpoint"),
    ("run unknown data kind", [*RUN, "--data", "ftp://x"], "--data ftp://x"),
    ("run missing image folder", [*RUN, "--data", "imagefolder:nofolder"], "does not exist"),
    ("run input without batch dim", [*RUN[:4], "--input", "3x16x16", *RUN[6:]], "--input 3x16x16 has no batch dimension"),
    ("run too many classes", [*RUN, "--num-classes", "7"], "outputs 3 classes"),
    ("run batch not divisible", [*RUN[:6], "--batch-size", "3", "--steps", "1", "--micro-batches", "2", "--dp", "1",
                                 "--replicas", "1"], "give --batch-size 2"),
    ("checkpoint is a file", [*RUN, "--checkpoint", "<afile>"], "is a file"),
    ("checkpoint without pointer", [*RUN, "--checkpoint", "<ck_nopointer>"], "no 'latest' pointer"),
    ("checkpoint pointer dangling", [*RUN, "--checkpoint", "<ck_badpointer>"], "points to 'step-00000007'"),
    ("checkpoint without nowdl.json", [*RUN, "--checkpoint", "<ck_nojson>"], "nowdl.json is missing"),
]


@pytest.mark.parametrize(("what", "argv", "needle"), CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(alone: Path, capsys: pytest.CaptureFixture[str], what: str, argv: list[str], needle: str) -> None:
    paths = _fixtures(alone)
    for key, path in paths.items():
        argv = [a.replace(f"<{key}>", path) for a in argv]
    before = _files(alone)
    with pytest.raises(SystemExit) as ex:
        sys.exit(main(argv))
    cap = capsys.readouterr()
    assert ex.value.code == 2, (what, cap)
    assert needle in cap.err, (what, cap.err)
    lines = cap.err.rstrip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("nowdl"), (what, cap.err)  # one paragraph, message first
    assert "Traceback" not in cap.err and not cap.out.strip(), (what, cap)
    assert _files(alone) == before, (what, _files(alone) - before)  # nothing written


def test_foreign_checkpoint_from_the_cli(alone: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*RUN, "--checkpoint", "ck"]) == 0
    capsys.readouterr()
    before = _files(alone)
    assert main(["run", "unet", "--model-args", '{"depth": 2, "base_channels": 4}', "--input", "1x3x16x16",
                 "--batch-size", "2", "--steps", "1", "--checkpoint", "ck"]) == 2
    err = capsys.readouterr().err
    assert "holds a run of 'resnet', not 'unet'" in err and err.count("\n") == 1
    shard = next((alone / "ck" / "step-00000001").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    assert main([*RUN[:-1], "2", "--checkpoint", "ck"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint file ck/step-00000001/{shard.name} has 1000 bytes" in err and err.count("\n") == 1
    assert _files(alone) == before


API_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("no gpus", {}, "give gpus=N"),
    ("gpus zero", {"gpus": 0}, "gpus must be a positive integer"),
    ("gpus bool", {"gpus": True}, "gpus must be a positive integer"),
    ("unknown mode", {"gpus": 2, "mode": "fast"}, "mode='fast' is not one of auto, estimate, measure"),
    ("missing plan file", {"plan": "missing.json"}, "plan file 'missing.json' does not exist"),
    ("unknown optimizer", {"gpus": 2, "optimizer": "lbfgs"}, "optimizer='lbfgs' is not one of"),
    ("factory returns junk", {"gpus": 2, "optimizer": lambda ps: 3}, "not a torch.optim.Optimizer"),
    ("bad precision", {"gpus": 2, "precision": "fp8"}, "fp8"),
    ("spatial parts junk", {"gpus": 2, "spatial_parts": "x"}, "spatial_parts must be an int"),
    ("halo fusion junk", {"gpus": 2, "halo_fusion": "sometimes"}, "sometimes"),
]


@pytest.mark.parametrize(("what", "kwargs", "needle"), API_CASES, ids=[c[0] for c in API_CASES])
def test_api_bad_input(alone: Path, what: str, kwargs: dict[str, Any], needle: str) -> None:
    before = _files(alone)
    with pytest.raises(nowdl.NowdlError) as e:
        nowdl.compile(nowdl.models.resnet(depth=8, version=1, width=4, num_classes=3), **kwargs)
    text = str(e.value)
    assert needle in text and "\n\n" not in text, (what, text)
    assert _files(alone) == before


def test_api_misuse(alone: Path) -> None:
    with pytest.raises(nowdl.NowdlError, match="expects an nn.Module"):
        nowdl.compile("resnet", gpus=2)  # type: ignore[arg-type]
    cm = nowdl.compile(nowdl.models.resnet(depth=8, version=1, width=4, num_classes=3), gpus=1, stages=1,
                       micro_batches=1, dp=1, replicas=1, spatial_parts=1, mode="estimate", cache=False, progress=False)
    with pytest.raises(nowdl.NowdlError, match="train_step needs a loss"):
        cm.train_step(torch.randn(1, 3, 16, 16), torch.zeros(1, dtype=torch.long))
    with pytest.raises(nowdl.NowdlError, match="load_checkpoint needs the engine"):
        cm.load_checkpoint(alone / "ck")
    with pytest.raises(nowdl.NowdlError, match="no checkpoint in"):
        cm.load_checkpoint(alone / "ck", torch.randn(1, 3, 16, 16))
    assert not (alone / "ck").exists()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ex:
        main(["--version"])
    assert ex.value.code == 0 and capsys.readouterr().out.startswith(f"nowdl {nowdl.__version__} (torch ")
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in nowdl.models.MODELS)


# ---- under a launcher ----------------------------------------------------------------------------
def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(NOWDL_BACKEND="gloo", OMP_NUM_THREADS="1")
    return env


def _torchrun(*args: str, n: int = 2) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "nowdl", *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)


def test_torchrun_bad_input_prints_once() -> None:
    res = _torchrun(*RUN[:-1], "0")
    assert res.returncode != 0
    assert res.stderr.count("nowdl run: error: --steps must be a positive integer") == 1, res.stderr
    assert res.stderr.startswith("nowdl run: error: --steps must be a positive integer, got 0\n"), res.stderr
    assert "nowdl/cli/commands.py" not in res.stderr and "nowdl/runtime" not in res.stderr  # no worker traceback
    assert res.stderr.count("exitcode  : 2") >= 1  # torchrun's own summary (and its traceback) follow


def _fail_on_rank1(rank: int, world: int) -> None:
    from nowdl.runtime.launch.failure import open_channel

    ch = open_channel(rank, world, report=lambda m: print(f"nowdl run: error: {m}", file=sys.stderr, flush=True))
    assert ch is not None
    if rank == 1:
        ch.fail("RuntimeError: CUDA out of memory (simulated)")
        os._exit(2)
    t = torch.zeros(1)
    dist.recv(t, src=1)  # never sent: rank 0 waits, as for a peer that died mid-step


def test_rank_local_failure_is_printed_once_by_rank0(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(WorkerError) as e:
        run_workers(_fail_on_rank1, 2, timeout_s=60, start_method="spawn")
    err = capfd.readouterr().err
    assert err.count("nowdl run: error: rank 1: RuntimeError: CUDA out of memory (simulated)") == 1, err
    assert e.value.failures.keys() == {0, 1}
    assert all("exited with code 2" in f for f in e.value.failures.values()), e.value.failures



# ---- stopping on a signal -------------------------------------------------------------------------
_DATA = """import time

import torch


class Toy(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):  # slow: the signal finds the loader worker reading
        time.sleep(0.05)
        return torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(i)), i % 3


def make():
    return Toy()
"""


def _nowdl(args: list[str], cwd: Path) -> list[str]:
    """``nowdl ARGS`` as the console script runs it: ``-P`` keeps the current folder off
    ``sys.path``, so ``--data mydata:make`` is found only because nowdl looks there itself."""
    (cwd / "mydata.py").write_text(_DATA)
    return [sys.executable, "-P", "-m", "nowdl", *args, "--data", "mydata:make", "--workers", "1"]


def _popen(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in _env().items() if not k.startswith(("RANK", "WORLD_SIZE", "SLURM", "OMPI", "PMI"))}
    return subprocess.Popen(_nowdl(args, cwd), cwd=cwd, env={**env, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, process_group=0)


def _losses(out: str) -> dict[int, str]:
    return step_losses(out)


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_saves_and_resumes_exactly(tmp_path: Path, sig: signal.Signals) -> None:
    """Ctrl-C (SIGINT to the whole process group, loader worker included) or SIGTERM mid-run: one
    line, no traceback, the finished steps saved, and the same command resumes exactly."""
    ck = tmp_path / "ck"
    base = [*RUN[:-1], "200", "--checkpoint", str(ck)]
    proc = _popen(base, tmp_path)
    assert proc.stdout is not None
    seen = ""
    deadline = time.monotonic() + 120
    while "step 3/200" not in seen and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
    os.killpg(proc.pid, sig)  # as a terminal's Ctrl-C, or Slurm, signals every process
    out, err = proc.communicate(timeout=60)
    out = seen + out
    assert proc.returncode == 128 + sig, (proc.returncode, out, err)
    assert err == "", err  # no worker traceback, no "DataLoader worker ... exited unexpectedly"
    stopped = int(out.split("interrupted at step ")[1].split(":")[0])
    assert f": resume with the same command ({sig.name}; step {stopped} of 200 saved to {ck})" in out, out
    assert stopped >= 3 and f"saved checkpoint at step {stopped} to {ck}" in out, out
    lost = max(_losses(out)) - stopped
    assert lost == 0, out  # every step that finished is in the checkpoint
    resumed = subprocess.run(_nowdl([*RUN[:-1], str(stopped + 2), "--checkpoint", str(ck)], tmp_path), cwd=tmp_path,
                             env={**_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    plain = subprocess.run(_nowdl([*RUN[:-1], str(stopped + 2)], tmp_path), cwd=tmp_path,
                           env={**_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    want = {k: v for k, v in _losses(plain.stdout).items() if k > stopped}
    assert _losses(resumed.stdout) == want, (resumed.stdout, plain.stdout)


@pytest.mark.parametrize("launcher", ["slurm", "openmpi"])
def test_srun_and_mpirun_bad_input_prints_once(tmp_path: Path, launcher: str) -> None:
    """Two processes described as srun or mpirun would: rank 0 prints the paragraph, rank 1
    nothing, both exit 2 (bad input found before the process group forms)."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {k: v for k, v in _env().items() if not k.startswith(("SLURM", "OMPI", "PMI", "MV2"))}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=str(ROOT))
        if launcher == "slurm":
            env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank))
        else:
            env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, "-m", "nowdl", *RUN[:-1], "0"], cwd=tmp_path, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    assert outs[0][1] == "nowdl run: error: --steps must be a positive integer, got 0\n", outs[0]
    assert outs[1] == ("", ""), outs[1]
    assert list(tmp_path.iterdir()) == []
