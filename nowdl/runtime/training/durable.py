"""Crash-consistent file operations: data fsynced before the rename that publishes it, and the rename fsynced.

[Note: durable saves] After a power loss or a node crash, POSIX promises only what was fsynced:
a file's bytes once the file was fsynced, a directory's entries (a create, a rename, a removal)
once the directory was fsynced. ext4 and XFS with default options may put a rename on disk
before the data it names, and so may network filesystems. So every file nowdl writes is fsynced,
then its folder, before the rename that makes it visible, and the folder holding the renamed
entry is fsynced after it. Without that, ``latest`` could name a step that never reached the disk.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "fsync_file", "write_durable", "replace_durable"]


def fsync_file(path: Path) -> None:
    """Flush ``path``'s bytes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s entries (creates, renames, removals inside it) to the disk. Filesystems that
    cannot fsync a directory (some network ones raise EINVAL) are left as they are."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_durable(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and fsync it (``path`` is not yet published: its folder's rename does that)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def replace_durable(src: Path, dst: Path) -> None:
    """``os.replace(src, dst)``, its parent folder fsynced after (``src`` must already be durable)."""
    os.replace(src, dst)
    fsync_dir(dst.parent)
    if src.parent != dst.parent:
        fsync_dir(src.parent)
