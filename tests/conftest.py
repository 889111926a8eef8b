"""Shared fixtures: an isolated profile cache for every test; the nominal device specs.

The planner's tests check its logic against the datasheet's rooflines (``NOWDL_SPECS=nominal``,
set before nowdl is imported, so subprocesses plan the same way); the GPU-faithful default specs
(fitted to benchmarks/records/, with the memory reserve) are tested by name in
tests/profiler/test_gpu_fit.py (``fitted_specs()``).
"""

from __future__ import annotations

import os

os.environ["NOWDL_SPECS"] = "nominal"

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("nowdl-cache")
    monkeypatch.setenv("NOWDL_CACHE_DIR", str(d))
    yield d


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many random cases each property test ran (tests/helpers/properties.py)."""
    import sys

    props = sys.modules.get("helpers.properties")
    counts = getattr(props, "COUNTS", None)
    if counts:
        shown = ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))
        terminalreporter.write_line(f"hypothesis cases run ({props.PROFILE} profile): {shown}")  # type: ignore[union-attr]
