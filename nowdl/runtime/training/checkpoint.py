"""Checkpoints on disk: torch.distributed.checkpoint shards under the model's original names.

[Note: checkpoint layout] A checkpoint folder holds one sub-folder per saved step and a pointer::

    DIR/latest                 "step-00000012" (written last, atomically: the valid checkpoint)
    DIR/step-00000012/         torch.distributed.checkpoint (DCP) files: .metadata, __<r>_0.distcp
    DIR/step-00000012/nowdl.json   format, step, world, the plan config, optimizer hyperparameters,
                                   and every file's size and CRC-32 (checked before loading)

Every rank writes the tensors it owns, keyed by the model's original names (``model/<name>``,
``optim/<name>/<state key>``, ``rng/<rank>``), so any plan of the same model can read any of
them back: a run re-planned for other stages or GPUs loads the same keys from other files
(resharding is DCP's, by key). A save goes to ``DIR/.saving-step-N`` first and is renamed and
pointed to only when every rank has written and every file is checksummed; a crash mid-save
leaves ``latest`` at the previous, complete checkpoint, and the next save clears the debris.
Every file is fsynced, then its folder, before the rename that publishes it ([Note: durable
saves] in durable.py), so after a power loss ``latest`` names a step that is on the disk.

[Note: re-save] Saving the step ``latest`` already names (a run re-saved at its last step) moves
the old folder aside to ``.replaced-step-N`` before the new one takes its name, and removes it
only once ``latest`` is durable. A crash between the two renames leaves ``latest`` naming a
missing folder with its old copy aside: loading reads the copy, and the next save puts it back.

Loading never unpickles anything but DCP's own metadata classes (an allow-listed unpickler);
tensors are read by DCP with ``weights_only=True``; our own metadata is JSON.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from nowdl.errors import NowdlError
from nowdl.runtime.launch import faults
from nowdl.runtime.training.durable import fsync_dir, replace_durable, write_durable

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["CheckpointError", "Checkpoint", "FORMAT", "save_checkpoint", "open_checkpoint", "find_checkpoint",
           "latest_step_dir"]

FORMAT = "nowdl.checkpoint"
VERSION = 2
LATEST = "latest"
META = "nowdl.json"


class CheckpointError(NowdlError):
    """A checkpoint is missing, truncated, corrupt, or of another model (the message names the file)."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agree(error: str | None, cleanup: Path | None = None) -> None:
    """Raise ``error`` on every rank if any rank has one (the lowest rank's message wins), after
    removing ``cleanup`` (an unfinished save's folder). Collective: a barrier when all is well."""
    if _distributed():
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        raise CheckpointError(error)


def _bcast(value: Any) -> Any:
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _crc(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


# ---- saving --------------------------------------------------------------------------------------
def save_checkpoint(directory: str | os.PathLike[str], step: int, tensors: Mapping[str, torch.Tensor],
                    meta: Mapping[str, Any], *, keep: int = 1) -> Path:
    """Write this rank's ``tensors`` as step ``step`` of ``directory`` (collective: every rank calls it).

    ``meta`` (JSON-ready, rank 0's is written) is stored beside the shards in ``nowdl.json``.
    Returns the step folder. The previous checkpoint stays valid until this one is complete; a save
    that fails on any rank (a full disk) removes its unfinished folder and raises
    :class:`CheckpointError` on every rank, naming the checkpoint that is kept.
    """
    root = Path(directory)
    rank = dist.get_rank() if _distributed() else 0
    world = dist.get_world_size() if _distributed() else 1
    tmp = root / f".saving-{_step_name(step)}"
    error = None
    if rank == 0:
        try:
            if root.exists() and not root.is_dir():
                raise NotADirectoryError(f"{root} is a file")
            if not root.is_dir():
                root.mkdir(parents=True)
                fsync_dir(root.parent)
            _tidy(root)
            tmp.mkdir()
        except OSError as e:
            error = f"cannot write a checkpoint in {root}: {e}; pass a writable folder"
    _agree(error)
    kept = _kept(root)
    error = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
            from nowdl.runtime.training.dcp_files import Writer, dcp

            dcp.save(dict(tensors), storage_writer=Writer(tmp), no_dist=not _distributed())
        faults.point("save.metadata")
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        mine = {name: [(tmp / name).stat().st_size, _crc(tmp / name)] for name in files[rank::world]}
    except Exception as e:  # noqa: BLE001 - a full disk, a quota, a lost mount: reported on every rank below
        error, mine = _failed(e, root, step, kept), {}
    _agree(error, cleanup=tmp if rank == 0 else None)
    sums: list[Any] = [mine]
    if _distributed():
        sums = [None] * world
        dist.all_gather_object(sums, mine)
    final = root / _step_name(step)
    if rank != 0:  # this rank waits in the save while rank 0 publishes it: the same kill points, in that order
        for name in ("save.before_rename", "save.after_rename", "save.before_latest", "save.after_latest"):
            faults.point(name)
    if rank == 0:
        try:
            record = {"format": FORMAT, "version": VERSION, "step": step, "world": world, **dict(meta),
                      "files": {k: v for part in sums for k, v in part.items()}}
            write_durable(tmp / META, json.dumps(record, indent=1))
            fsync_dir(tmp)  # DCP fsyncs its shards and .metadata; their entries and the record's are made durable here
            faults.point("save.before_rename")
            aside = _publish(tmp, final)
            faults.point("save.after_rename")
            pointer = root / f".{LATEST}.tmp"
            write_durable(pointer, final.name)
            faults.point("save.before_latest")
            replace_durable(pointer, root / LATEST)
            faults.point("save.after_latest")
        except OSError as e:
            error = _failed(e, root, step, _kept(root))
        else:
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
            steps = sorted(p for p in root.glob("step-*") if p.is_dir() and p.name != final.name)
            for old in steps[:max(0, len(steps) - (keep - 1))] if keep >= 1 else []:
                shutil.rmtree(old, ignore_errors=True)
    _agree(error, cleanup=tmp if rank == 0 else None)  # also the barrier: every rank returns once it is complete
    return final


def _aside(final: Path) -> Path:
    return final.with_name(f".replaced-{final.name}")


def _publish(tmp: Path, final: Path) -> Path | None:
    """Rename the complete ``tmp`` to ``final``. A re-save of the same step moves the old ``final``
    aside first (``.replaced-step-N``, returned, removed by the caller once the pointer is durable),
    so the step's only copy is never deleted before its replacement is on disk ([Note: re-save])."""
    aside = None
    if final.exists():
        aside = _aside(final)
        shutil.rmtree(aside, ignore_errors=True)
        replace_durable(final, aside)
    replace_durable(tmp, final)
    return aside


def _tidy(root: Path) -> None:
    """Before a save: remove an interrupted save's folder, and settle an interrupted re-save
    ([Note: re-save]): its old copy goes back where ``latest`` looks if the new one never arrived,
    and is removed if it did."""
    for old in root.glob(".saving-step-*"):
        shutil.rmtree(old, ignore_errors=True)
    for aside in root.glob(".replaced-step-*"):
        final = root / aside.name.removeprefix(".replaced-")
        if final.is_dir():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            replace_durable(aside, final)


def _kept(root: Path) -> str:
    """What the pointer of ``root`` names now (the checkpoint a failed save leaves in place; its copy
    aside when a re-save stopped between its renames, [Note: re-save])."""
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        return ""
    if (root / name).is_dir():
        return name
    return _aside(root / name).name if name and _aside(root / name).is_dir() else ""


def _failed(e: BaseException, root: Path, step: int, kept: str) -> str:
    """The message of a save of ``step`` that failed with ``e`` (``kept``: the checkpoint still valid)."""
    reason = e.strerror if isinstance(e, OSError) and e.strerror else (str(e).strip().splitlines() or [""])[0][:200]
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        fix = "free space on that filesystem (or pass another --checkpoint folder) and resume"
    else:
        fix = "fix the folder (space, quota, permissions, the mount) and resume"
    where = (f"the previous checkpoint {root / kept} is kept intact and a resume starts from it" if kept else
             "no earlier checkpoint is there, so a resume starts from the beginning")
    return f"saving the checkpoint of step {step} to {root} failed ({type(e).__name__}: {reason}): {where}; {fix}"


# ---- loading -------------------------------------------------------------------------------------
def latest_step_dir(directory: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint ``directory`` points to (None: no checkpoint there yet)."""
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint folder {root} is a file: pass a folder")
    pointer = root / LATEST
    if not pointer.exists():
        if any(root.glob("step-*")) or (root / "nowdl-checkpoint.json").exists():
            raise CheckpointError(f"{root} holds checkpoint files but no '{LATEST}' pointer (written by an older nowdl, "
                                  "or not by nowdl): use another folder")
        return None
    name = pointer.read_text().strip()
    step_dir = root / name
    if name.startswith("step-") and not step_dir.is_dir() and _aside(step_dir).is_dir():
        step_dir = _aside(step_dir)  # a re-save of this step stopped between its two renames ([Note: re-save])
    if not name.startswith("step-") or not step_dir.is_dir():
        raise CheckpointError(f"{pointer} points to {name!r}, which is not a checkpoint folder in {root}: the checkpoint "
                              "was moved or damaged; restore it or use another folder")
    return step_dir


def find_checkpoint(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``nowdl.json`` of the latest checkpoint in ``directory`` (None: none yet), checked for format."""
    step_dir = latest_step_dir(directory)
    if step_dir is None:
        return None
    f = step_dir / META
    try:
        record = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{f} is missing: {step_dir} is not a complete nowdl checkpoint") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {f} ({e}): the checkpoint is damaged") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{f} is not a nowdl checkpoint (format {record.get('format') if isinstance(record, dict) else '?'!r})")
    if int(record.get("version", 0)) > VERSION:
        raise CheckpointError(f"{f} was written by a newer nowdl (checkpoint version {record['version']} > {VERSION}): "
                              "upgrade nowdl")
    if not isinstance(record.get("files"), dict) or not isinstance(record.get("step"), int):
        raise CheckpointError(f"{f} lacks its file list or step: the checkpoint is damaged")
    record["dir"] = str(step_dir)
    return record


class Checkpoint:
    """A complete checkpoint found by :func:`open_checkpoint`; its reads are collective."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record
        self.dir = Path(record["dir"])
        self.step = int(record["step"])
        self.world = int(record.get("world", 1))
        self._index: dict[str, TensorStorageMetadata] | None = None

    def index(self) -> dict[str, TensorStorageMetadata]:
        """Tensor keys -> saved shape/dtype, after every file's size and CRC are checked (shared
        among the ranks; collective on the first call)."""
        if self._index is not None:
            return self._index
        rank = dist.get_rank() if _distributed() else 0
        world = dist.get_world_size() if _distributed() else 1
        files = sorted(self.record["files"].items())
        error = None
        for name, (size, crc) in files[rank::world]:
            f = self.dir / name
            if not f.is_file():
                error = f"checkpoint file {f} is missing: restore it, or start from another checkpoint folder"
            elif f.stat().st_size != size:
                error = (f"checkpoint file {f} has {f.stat().st_size} bytes but was written with {size} (truncated "
                         "or replaced): restore it, or start from another checkpoint folder")
            elif _crc(f) != crc:
                error = (f"checkpoint file {f} is corrupt (CRC-32 mismatch): restore it, or start from another "
                         "checkpoint folder")
            if error:
                break
        _agree(error)
        from nowdl.runtime.training.dcp_files import SafeReader, TensorStorageMetadata

        try:
            metadata = SafeReader(self.dir).read_metadata()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
            raise CheckpointError(f"cannot read {self.dir / '.metadata'} ({e}): the checkpoint is damaged") from None
        self._index = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        return self._index

    def read(self, wanted: Mapping[str, tuple[int, ...] | None], *, optional: frozenset[str] = frozenset()
             ) -> dict[str, torch.Tensor]:
        """Read the keys of ``wanted`` (value: the shape the model expects, None: any).

        Keys in ``optional`` that the checkpoint lacks are skipped; any other missing key or
        shape mismatch raises CheckpointError on every rank (collective: every rank calls it,
        each with its own keys).
        """
        index = self.index()
        error = None
        out: dict[str, torch.Tensor] = {}
        for key, shape in wanted.items():
            md = index.get(key)
            if md is None:
                if key not in optional:
                    error = error or (f"checkpoint {self.dir} has no tensor {key!r}: it was saved from another model "
                                      "(or another optimizer); start from a checkpoint of this model")
                continue
            saved = tuple(md.size)
            if shape is not None and tuple(shape) != saved:
                error = error or (f"checkpoint {self.dir} holds {key!r} with shape {list(saved)} but the model has "
                                  f"{list(shape)}: it was saved from another model configuration")
                continue
            out[key] = torch.empty(saved, dtype=md.properties.dtype)
        _agree(error)
        faults.point("load.read")
        from nowdl.runtime.training.dcp_files import SafeReader, dcp

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(out, storage_reader=SafeReader(self.dir), no_dist=not _distributed())
        except Exception as e:  # CheckpointException carries every rank's failure
            first = (str(e).splitlines() or [""])[0][:300]
            raise CheckpointError(f"cannot read checkpoint {self.dir}: {type(e).__name__}: {first}; restore it or "
                                  "start from another checkpoint folder") from None
        return out


def open_checkpoint(directory: str | os.PathLike[str]) -> Checkpoint | None:
    """The latest complete checkpoint in ``directory`` (None: none yet). Rank 0 reads the pointer
    and ``nowdl.json``; every rank gets the same answer or the same CheckpointError."""
    rank = dist.get_rank() if _distributed() else 0
    answer: Any = None
    if rank == 0:
        try:
            answer = {"ok": find_checkpoint(directory)}
        except CheckpointError as e:
            answer = {"error": str(e)}
    answer = _bcast(answer)
    if "error" in answer:
        raise CheckpointError(answer["error"])
    return None if answer["ok"] is None else Checkpoint(answer["ok"])
