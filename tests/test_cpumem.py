"""[Note: CPU freed memory]: a CPU rank reuses the pages it freed instead of faulting in new ones."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from nowdl import cpumem

_SCRIPT = textwrap.dedent("""
    import ctypes, json, resource, sys, torch
    import nowdl.runtime.pipeline.engine  # a rank's process: the engine keeps freed memory
    from nowdl.cpumem import keep_freed_memory
    class Info(ctypes.Structure):  # glibc's struct mallinfo2
        _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                    "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    def step():  # a forward's activation (40 MiB) made, then freed by the backward
        t = torch.empty(10 * 2**20).fill_(1.0)
        mapped = libc.mallinfo2().hblkhd
        del t
        return mapped
    mapped = step()
    free_after = libc.mallinfo2().fordblks
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(json.dumps({"mapped": mapped, "free_after": free_after, "faults": faults}))
""")
_MIB40 = 40 * 2**20


def _run(mode: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2: Linux only")
def test_freed_pages_are_kept_and_reused() -> None:
    default, kept = _run("default"), _run("keep")
    # glibc's default maps a 40 MiB block on its own and unmaps it when freed
    assert default["mapped"] >= _MIB40 and default["free_after"] < _MIB40, default
    # kept: the block comes from the heap and stays there when freed; later steps reuse its pages
    assert kept["mapped"] < _MIB40 and kept["free_after"] >= _MIB40, kept
    # (the default faults all 10 blocks in again; kept, at most the heap's growth once)
    assert default["faults"] >= 9 * _MIB40 // 4096 and kept["faults"] <= 2 * _MIB40 // 4096, (default, kept)


def test_opt_out_and_decided_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpumem, "_done", None)
    monkeypatch.setenv(cpumem.ENV, "0")
    assert cpumem.keep_freed_memory() is False
    monkeypatch.setenv(cpumem.ENV, "1")
    assert cpumem.keep_freed_memory() is False  # decided once per process
    monkeypatch.setattr(cpumem, "_done", None)
    assert cpumem.keep_freed_memory() is sys.platform.startswith("linux")
