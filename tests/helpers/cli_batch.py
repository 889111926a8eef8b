"""Test helper (a script): run `nowdl` command lines one after another in ONE process.

Each line of standard input is a JSON job ``{"id": ..., "argv": [...]}`` (argv without the
``nowdl``); each answer is one JSON line on standard output, ``{"id", "rc", "stdout", "stderr"}``,
with what the command printed. The point is one import of torch and the model packages for
dozens of commands (each fresh `python -m nowdl` pays 2-4 s of imports on 2 cores). Log records
go to this process's own standard error.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys


def main() -> None:
    from nowdl.cli.commands import main as nowdl_main

    logging.basicConfig(stream=sys.__stderr__, level=logging.WARNING)  # the commands' basicConfig is then a no-op
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = nowdl_main(job["argv"])
            except SystemExit as e:  # argparse's exit
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        print(json.dumps({"id": job["id"], "rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}), flush=True)


if __name__ == "__main__":
    main()
