"""Test helper (not a test module): what a power loss could leave of a folder, from what was fsynced.

``with Journal(root) as j: ...`` records, at every file-system call the code under test makes
(``os.fsync``, ``os.replace``, ``os.rename``, ``os.mkdir``, ``os.unlink``, ``shutil.rmtree``),
the folder's tree as it is and what a crash would keep of it: a file's bytes as of its last
``fsync``, a folder's entries as of the folder's last ``fsync`` (keyed by inode, so a renamed
folder keeps its entries). ``j.crash(rng, into)`` writes one state a crash at a random recorded
moment could leave: each folder's entries as at a random moment between its last fsync and the
crash (a journaling filesystem such as ext4 or XFS applies one folder's renames in order and each
whole, and loses those not yet fsynced), each file written since its last fsync with its durable
bytes, its new bytes, a prefix of them, or nothing. Everything under ``root`` when the journal
starts counts as durable.
"""

from __future__ import annotations

import os
import random
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Journal"]

Key = tuple[int, int]  # (inode, generation): an inode number freed and reused is another file
Listing = dict[str, Key]  # name -> file


@dataclass
class _Moment:
    root: Key
    dirs: dict[Key, Listing]  # the tree now: folder -> entries
    data: dict[Key, bytes]  # file -> bytes now
    kinds: dict[Key, bool]  # file or folder -> is a folder
    durable_dirs: dict[Key, Listing]
    durable_data: dict[Key, bytes]


class Journal:
    """Records the durable and the present state of ``root`` at every file-system call."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.moments: list[_Moment] = []
        self._saved: dict[str, Any] = {}
        self.durable_dirs: dict[Key, Listing] = {}
        self.durable_data: dict[Key, bytes] = {}
        self._gen: dict[int, int] = {}
        self._synced: dict[Key, list[int]] = {}  # folder -> the moments its fsyncs were recorded at
        self._seen: set[int] = set()
        self.fsyncs: list[str] = []  # paths fsynced, relative to root ('.' for root)

    # ---- scanning ------------------------------------------------------------------------------
    def _key(self, ino: int) -> Key:
        return ino, self._gen.get(ino, 0)

    def _scan(self) -> tuple[dict[Key, Listing], dict[Key, bytes], dict[Key, bool]]:
        dirs: dict[Key, Listing] = {}
        data: dict[Key, bytes] = {}
        kinds: dict[Key, bool] = {}
        present: set[int] = set()

        def walk(path: Path) -> None:
            key = self._key(path.stat().st_ino)
            kinds[key] = True
            entries: Listing = {}
            for child in path.iterdir():
                st = child.lstat()
                present.add(st.st_ino)
                entries[child.name] = k = self._key(st.st_ino)
                if stat.S_ISDIR(st.st_mode):
                    walk(child)
                else:
                    kinds[k] = False
                    data[k] = child.read_bytes()
            dirs[key] = entries

        walk(self.root)
        for ino in self._seen - present:  # gone: a later file with this inode number is another file
            self._gen[ino] = self._gen.get(ino, 0) + 1
        self._seen = present
        return dirs, data, kinds

    def _moment(self) -> None:
        dirs, data, kinds = self._scan()
        self.moments.append(_Moment(self._key(self.root.stat().st_ino), dirs, data, kinds,
                                    {k: dict(v) for k, v in self.durable_dirs.items()}, dict(self.durable_data)))

    # ---- the shims -----------------------------------------------------------------------------
    def _fsync(self, fd: int) -> None:
        self._saved["fsync"](fd)
        st = os.fstat(fd)
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if self.root not in (path, *path.parents):
            return
        self.fsyncs.append(str(path.relative_to(self.root)))
        self._scan()  # generations up to date
        if stat.S_ISDIR(st.st_mode):
            self.durable_dirs[self._key(st.st_ino)] = {p.name: self._key(p.lstat().st_ino) for p in path.iterdir()}
        else:
            self.durable_data[self._key(st.st_ino)] = path.read_bytes()
        self._moment()
        if stat.S_ISDIR(st.st_mode):
            self._synced.setdefault(self._key(st.st_ino), []).append(len(self.moments) - 1)

    def _wrap(self, name: str, owner: Any) -> Any:
        real = getattr(owner, name)
        self._saved[name] = real

        def call(*args: Any, **kwargs: Any) -> Any:
            self._moment()
            out = real(*args, **kwargs)
            self._moment()
            return out

        return call

    def __enter__(self) -> Journal:
        dirs, data, _ = self._scan()
        self.durable_dirs, self.durable_data = dirs, data
        self._saved["fsync"] = os.fsync
        os.fsync = self._fsync  # type: ignore[assignment]
        for name in ("replace", "rename", "mkdir", "unlink"):
            setattr(os, name, self._wrap(name, os))
        self._saved["shutil.rmtree"] = shutil.rmtree
        shutil.rmtree = self._wrap("rmtree", shutil)  # type: ignore[assignment]
        self._moment()
        return self

    def __exit__(self, *exc: Any) -> None:
        os.fsync = self._saved["fsync"]  # type: ignore[assignment]
        for name in ("replace", "rename", "mkdir", "unlink"):
            setattr(os, name, self._saved[name])
        shutil.rmtree = self._saved["shutil.rmtree"]  # type: ignore[assignment]
        self._moment()

    # ---- crashing ------------------------------------------------------------------------------
    def crash(self, rng: random.Random, into: Path) -> int:
        """Write into ``into`` (an empty folder) what a crash at a random moment could leave; the moment's index."""
        i = rng.randrange(len(self.moments))
        m = self.moments[i]

        def content(key: Key) -> bytes:
            now, old = m.data.get(key), m.durable_data.get(key)
            if old is not None and now in (old, None):  # unchanged since its fsync, or removed since (bytes stay)
                return old
            options = [b""] + ([old] if old is not None else [])
            if now is not None:
                options += [now, now[: rng.randrange(len(now) + 1)]]
            return rng.choice(options)

        def listing(key: Key) -> Listing:
            # a folder's entries as at some moment from its last fsync up to the crash: a journaling
            # filesystem applies one folder's renames in order and each whole, but may lose any not fsynced
            synced = [t for t in self._synced.get(key, []) if t <= i]
            t = rng.randint(synced[-1] if synced else 0, i)
            return self.moments[t].dirs.get(key, {})

        def is_dir(key: Key) -> bool:
            return any(mo.kinds.get(key) for mo in self.moments[: i + 1] if key in mo.kinds)

        def build(key: Key, path: Path, depth: int) -> None:
            for name, child in listing(key).items():
                if is_dir(child):
                    if depth < 8:
                        (path / name).mkdir()
                        build(child, path / name, depth + 1)
                else:
                    (path / name).write_bytes(content(child))

        build(m.root, into, 0)
        return i
