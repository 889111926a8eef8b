"""Shared fixtures: an isolated profile cache for every test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = tmp_path_factory.mktemp("nowdl-cache")
    monkeypatch.setenv("NOWDL_CACHE_DIR", str(d))
    yield d
