"""On-disk JSON cache of profiles: keys, atomic writes, corrupt files ignored."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from nowdl.profiler.cost import PROFILE_FORMAT_VERSION, Profile

__all__ = [
    "default_cache_dir",
    "resolve_cache_dir",
    "graph_digest",
    "cache_key",
    "load_cached",
    "store_cached",
    "atomic_write_text",
]

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$NOWDL_CACHE_DIR`` if set, else ``~/.cache/nowdl/profiles``."""
    env = os.environ.get("NOWDL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "nowdl" / "profiles"


def resolve_cache_dir(cache: bool | str | os.PathLike[str]) -> Path | None:
    """The cache directory for ``profile(cache=...)``; None when caching is off."""
    if cache is True:
        return default_cache_dir()
    if cache is False or cache is None:
        return None
    return Path(cache).expanduser()


def graph_digest(gm: torch.fx.GraphModule) -> str:
    """sha256 of the graph code, parameter/buffer shapes and dtypes, and train/eval flags.

    Guards the cache against two different models profiled with the same (or no) fingerprint.
    """
    h = hashlib.sha256(gm.code.encode())
    for name, p in gm.named_parameters():
        h.update(f"p:{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}".encode())
    for name, b in gm.named_buffers():
        h.update(f"b:{name}:{tuple(b.shape)}:{b.dtype}".encode())
    for name, m in gm.named_modules():
        h.update(f"m:{name}:{m.training}".encode())
    return h.hexdigest()


def cache_key(parts: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of ``parts`` (fingerprint, shapes, dtype, mode, ...)."""
    blob = json.dumps({"format_version": PROFILE_FORMAT_VERSION, **parts}, sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temp file and ``os.replace`` (never half-written)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load_cached(cache_dir: Path, key: str) -> Profile | None:
    """The cached profile for ``key``, or None (missing, or corrupt: logged and ignored)."""
    path = cache_dir / f"{key}.json"
    if not path.exists():
        return None
    try:
        prof = Profile.from_json(path.read_text())
    except Exception as e:  # noqa: BLE001 - any corruption means "re-profile"
        log.warning("ignoring corrupt profile cache file %s (%s: %s); re-profiling",
                    path, type(e).__name__, e)
        return None
    log.debug("profile cache hit %s", path)
    return prof


def store_cached(cache_dir: Path, key: str, prof: Profile) -> None:
    """Write ``prof`` to the cache atomically; failures are logged, not raised."""
    path = cache_dir / f"{key}.json"
    try:
        atomic_write_text(path, prof.to_json())
    except OSError as e:
        log.warning("could not write profile cache %s: %s", path, e)
