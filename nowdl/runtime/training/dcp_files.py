"""torch.distributed.checkpoint's file reader and writer as nowdl uses them.

Kept apart from ``checkpoint`` because importing DCP costs a second or more (it brings DTensor
and sympy): ``nowdl predict`` from a state_dict file, and every command that never reads or
writes a checkpoint folder, does without it. ``Writer`` adds the kill point between the shards
and the metadata; ``SafeReader`` unpickles DCP's metadata classes and nothing else (no code runs
from a foreign file).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from nowdl.runtime.launch import faults

__all__ = ["Writer", "SafeReader", "TensorStorageMetadata", "dcp"]


class Writer(dcp.FileSystemWriter):
    """DCP's writer (fsyncs its files, ``sync_files``), with the kill point between the shards and the metadata."""

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        out = super().write_data(*args, **kwargs)  # one thread: the shards are on disk when it returns
        faults.point("save.shards_half")
        return out


_SAFE_MODULES = ("torch.distributed.checkpoint.metadata",)
_SAFE = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
         ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
         ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes and nothing else (no code runs from a foreign file)."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _SAFE_MODULES or (module, name) in _SAFE or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


class SafeReader(dcp.FileSystemReader):
    """DCP's reader, its metadata read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata: Metadata = _MetadataUnpickler(f).load()
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata
