"""Predict's background writes: one window's writes at a time, a failure raised at the next agreement."""

from __future__ import annotations

import errno
import threading
import time

import pytest

from nowdl.errors import NowdlError
from nowdl.runtime.predict.agreement import Writes


def test_writes_run_in_the_background_one_window_at_a_time() -> None:
    spans: list[tuple[str, float, float]] = []
    main = threading.get_ident()
    threads: set[int] = set()

    def write(name: str) -> None:
        t0 = time.perf_counter()
        threads.add(threading.get_ident())
        time.sleep(0.05)
        spans.append((name, t0, time.perf_counter()))

    writes = Writes()
    try:
        writes.submit(lambda: write("a"), "out.zarr")
        assert not spans  # submit returned before the write finished
        writes.submit(lambda: write("b"), "out.zarr")  # waits for "a" first
        writes.wait()
    finally:
        writes.close()
    assert [s[0] for s in spans] == ["a", "b"] and spans[0][2] <= spans[1][1]
    assert main not in threads


def test_a_failed_write_raises_at_the_next_agreement() -> None:
    def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    writes = Writes()
    try:
        writes.submit(full, "out.zarr")
        with pytest.raises(NowdlError, match="writing out.zarr failed: the disk is full"):
            writes.submit(lambda: None, "out.zarr")
        writes.wait()  # nothing left in flight
    finally:
        writes.close()
