"""Reading checkpoints without running code from them.

A checkpoint is data someone else may have written. `torch.distributed.checkpoint` unpickles its
`.metadata` file with plain `pickle` and its non-tensor items with `torch.load(weights_only=False)`:
either runs whatever a crafted file asks. Here the metadata goes through an unpickler that only
builds DCP's own metadata classes and torch's dtype/size values, and non-tensor items through
`torch.load(weights_only=True)`. Anything else is a HybridError naming the file.
"""
from __future__ import annotations

import io
import os
import pickle

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from .errors import HybridError

# (module, name) pairs a DCP .metadata file legitimately refers to (torch 2.6 - 2.13).
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "torch.distributed.checkpoint.planner": {"WriteItemType", "LoadItemType"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "tuple", "list", "dict"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},          # maps "torch.strided" to the layout object
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which a checkpoint's metadata never needs")


def load_metadata(path: str):
    """Unpickle a DCP metadata file through the allowlist; HybridError for anything else."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise HybridError(f"checkpoint metadata {path!r} is missing") from None
    except Exception as e:   # noqa: BLE001 - any malformed pickle is the same verdict
        raise HybridError(f"refusing to load {path!r}: it is not plain checkpoint metadata ({e}); "
                          "a checkpoint from an untrusted source may try to run code") from None


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata goes through the allowlist unpickler."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        path = os.fspath(self._get_metadata_path(kwargs.get("rank")))
        metadata = load_metadata(path)
        if not isinstance(metadata, Metadata):
            raise HybridError(f"refusing to load {path!r}: it holds a {type(metadata).__name__}, not "
                              "checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """Non-tensor items (optimizer hyper-parameters, steps) with torch.load(weights_only=True)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:   # noqa: BLE001
            raise HybridError(f"refusing to load checkpoint item {read_item.dest_index.fqn!r}: it is not plain "
                              f"data ({str(e).splitlines()[0][:200]})") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # what DCP itself uses
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_dcp_metadata(path: str):
    """The checkpoint's DCP metadata, checked before DCP sees it (DCP would fall back to other
    files, with tracebacks, if its own read failed)."""
    return SafeReader(path).read_metadata()


def dcp_load(state: dict, path: str, no_dist: bool = False) -> None:
    """dcp.load through the safe reader and planner."""
    import torch.distributed.checkpoint as dcp
    read_dcp_metadata(path)
    dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner(), no_dist=no_dist)
