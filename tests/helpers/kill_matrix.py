"""Test helper (not a test module): run many ``nowdl`` jobs under torchelastic, each killed at a named point.

``python -m helpers.kill_matrix CASES.json RESULTS.json`` (with ``tests/`` on the path) runs each
case as torchrun would run ``nowdl ARGV`` with ``--max-restarts R``: torch's own elastic agent
(``torch.distributed.launcher.api.elastic_launch``, the agent behind torchrun, static rendezvous
on a local port) starts the ranks, restarts them all when one dies, and numbers the attempts.
The workers are forked from this process, which has imported torch and nowdl once, so a case pays
no imports. Each case's ``NOWDL_FAULT`` ([Note: kill points] in nowdl/runtime/launch/faults.py)
makes a rank SIGKILL itself at a point; its ``env`` (optional) sets more variables for its workers.
A case is ``{"name", "argv", "world", "restarts", "fault", "env"}``;
its result ``{"name", "ok", "error", "attempts", "logs": {"<attempt>/<rank>": stdout + stderr}}``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["run_cases", "run_in_shards"]


def _entry(argv: list[str]) -> int:
    import signal

    from nowdl.cli.commands import main

    def defaults() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)

    defaults()  # a forked worker starts with the defaults, as a fresh process does
    try:
        code = int(main(argv) or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed as a torchrun worker's traceback would be
        import traceback

        traceback.print_exc()
        code = 1
    if code:
        # a failed torchrun worker's process ends here with its status; torchelastic keeps a
        # finished function worker waiting for the agent instead, whose SIGTERM arrived while
        # nowdl ignored it to report the failure ([Note: lost ranks])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _logs(root: Path) -> dict[str, str]:
    """``attempt/rank`` -> what that worker printed (torchelastic's log folders)."""
    out: dict[str, str] = {}
    for f in sorted(root.rglob("*.log")):
        parts = f.relative_to(root).parts  # <run>/attempt_<n>/<local rank>/std{out,err}.log
        att = next((p.removeprefix("attempt_") for p in parts if p.startswith("attempt_")), "?")
        key = f"{att}/{parts[-2]}"
        out[key] = out.get(key, "") + f.read_text(errors="replace")
    return out


def run_case(case: dict[str, Any], log_root: Path) -> dict[str, Any]:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logs = log_root / case["name"].replace(" ", "_")
    # shutdown_timeout: torchrun's default (30 s) between its SIGTERM and SIGKILL to the survivors;
    # a survivor naming the lost rank watches the beats for SETTLE_S first, longer on a loaded machine
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=case["world"], run_id=case["name"].replace(" ", "_"),
                       rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{_port()}", rdzv_configs={"rank": 0, "timeout": 60},
                       max_restarts=case["restarts"], monitor_interval=0.1, start_method="fork", shutdown_timeout=30,
                       logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ALL))
    os.environ["NOWDL_FAULT"] = case.get("fault", "")
    os.environ.update(case.get("env", {}))
    t = time.perf_counter()
    ok, error = True, ""
    try:
        elastic_launch(cfg, _entry)(list(case["argv"]))
    except ChildFailedError as e:
        ok, error = False, str(e)[-3000:]
    except Exception:  # noqa: BLE001 - the agent's own failure is this case's result
        ok, error = False, traceback.format_exc()[-3000:]
    finally:
        for var in ("NOWDL_FAULT", *case.get("env", {})):
            os.environ.pop(var, None)
    out = _logs(logs)
    return {"name": case["name"], "ok": ok, "error": error, "wall_s": time.perf_counter() - t,
            "attempts": len({k.split("/")[0] for k in out}), "logs": out}


def run_cases(cases: list[dict[str, Any]], log_root: Path) -> list[dict[str, Any]]:
    return [run_case(c, log_root) for c in cases]


def run_in_shards(cases: list[dict[str, Any]], tmp: Path, shards: int) -> dict[str, dict[str, Any]]:
    """Run ``cases`` in ``shards`` launcher processes at once (``python -m helpers.kill_matrix``,
    their waits overlap); the results by case name."""
    import subprocess

    from helpers.run_cli import ROOT

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "NOWDL_FAULT", "NOWDL_MEMORY_CAP")
           and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    procs = []
    for i in range(shards):
        shard = tmp / f"shard{i}"
        shard.mkdir()
        (shard / "cases.json").write_text(json.dumps(cases[i::shards]))
        with open(shard / "launcher.log", "w") as log:
            procs.append((shard, subprocess.Popen([sys.executable, "-m", "helpers.kill_matrix", str(shard / "cases.json"),
                                                   str(shard / "results.json")], cwd=ROOT, env=env,
                                                  stdout=subprocess.DEVNULL, stderr=log)))
    results: dict[str, dict[str, Any]] = {}
    for shard, p in procs:
        assert p.wait(timeout=900) == 0, (shard / "launcher.log").read_text()[-3000:]
        results.update({r["name"]: r for r in json.loads((shard / "results.json").read_text())})
    return results


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["NOWDL_BACKEND"] = "gloo"
    import torch  # noqa: F401 - imported once here, before the workers fork

    import nowdl.cli.commands  # noqa: F401

    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    results = run_cases(cases, out.parent / "logs")
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
