"""A benchmark's results file: what it prints, under the command that made it and the machine it ran on.

Every benchmark script takes ``--results`` and runs its tables inside :func:`recorded`::

    if __name__ == "__main__":
        with recorded("bench_planner", "--results" in sys.argv):
            sys.exit(main())

and its parser accepts ``--results`` (:data:`HELP`). Everything the script prints to stdout then
goes to ``docs/results/<name>.md`` too (written when the run ends well, whole: a run that fails
leaves the last complete file in place), under a header
that names the exact command line, the date, and the machine: cores, load average, torch version,
CPU or GPU. docs/benchmarks.md links these files; nothing in it is copied by hand.
"""

from __future__ import annotations

import io
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["recorded", "RESULTS", "HELP", "machine_line"]

HELP = "also write what this prints to docs/results/<script>.md, with the command and the machine"

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def machine_line() -> str:
    """Cores, load average, torch version and the processor or GPU, in one line."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    cpu = platform.processor() or platform.machine()
    return (f"{os.cpu_count()} CPU cores ({cpu}), load average {load} at the end, torch {torch.__version__}"
            + (f", GPU {gpu}" if gpu else ", no GPU"))


class _Tee(io.TextIOBase):
    def __init__(self, out: io.TextIOBase, copy: io.StringIO) -> None:
        self.out, self.copy = out, copy

    def write(self, s: str) -> int:
        self.copy.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


@contextmanager
def recorded(name: str, on: bool, note: str = "", script: str | None = None) -> Iterator[None]:
    """Copy stdout into ``docs/results/<name>.md`` when ``on`` (``--results``), with its header
    (``script``: the script's name when it is not ``name``)."""
    if not on:
        yield
        return
    copy = io.StringIO()
    real = sys.stdout
    sys.stdout = _Tee(real, copy)  # type: ignore[assignment]
    t0 = time.time()
    try:
        yield
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        sys.stdout = real
    cmd = " ".join(shlex.quote(a) for a in ["python", os.path.relpath(sys.argv[0], RESULTS.parent.parent), *sys.argv[1:]])
    head = [f"# Results: `benchmarks/{script or name}.py`", "", f"Command: `{cmd}`", "",
            f"Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t0))}, {time.time() - t0:.0f} s; "
            f"machine: {machine_line()}.", ""]
    if note:
        head += [note, ""]
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS / f".{name}.md.tmp"
    tmp.write_text("\n".join(head) + "\n" + copy.getvalue().rstrip() + "\n")
    os.replace(tmp, RESULTS / f"{name}.md")
