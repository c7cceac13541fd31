"""Writing a checkpoint's files with every byte hashed as it is written (no second read).

`CrcWriter` is DCP's FileSystemWriter with its own `write_data` and `finish`: each item is
serialised in memory (torch.save of the tensor, as FileSystemWriter does; bytes items as they
are), its CRC32 taken over those bytes, then written once, one file per rank. It records each
file's size and CRC32 (`files`) and each item's byte range and CRC32 (`items`), which meta.json
lists: a load checks each item it reads, on the bytes it read (hybrid/ckpt/safeio.py).
`plain_bytes` and `write_bytes` do the same for the small torch.save'd files (RNG, loop state).
"""
from __future__ import annotations

import io
import os
import pickle
import zlib

import torch
from torch.distributed.checkpoint import FileSystemWriter


def _durable_write(path: str, chunks) -> tuple[int, int]:
    """Write the byte buffers to a new file at `path`, fsync it; (size, CRC32 of the whole file)."""
    size, crc = 0, 0
    with open(path, "xb") as f:
        for buf in chunks:
            f.write(buf)
            crc = zlib.crc32(buf, crc)
            size += len(buf)
        f.flush()
        os.fsync(f.fileno())
    return size, crc


def plain_bytes(obj) -> memoryview:
    """torch.save of plain data (RNG, loop state) into memory: taken when the save starts."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getbuffer()


def write_bytes(folder: str, rel: str, buf) -> list[int]:
    """`buf` into the new file folder/rel, fsync'd; [size, CRC32] hashed on the bytes written."""
    return list(_durable_write(os.path.join(folder, rel), [buf]))


def _serialise(item, planner) -> memoryview:
    """One write item's bytes: torch.save of its tensor (CPU, with no storage beyond its own
    elements, as DCP's loaders prepare it), or the bytes of a BYTE_IO item."""
    from torch.distributed.checkpoint.planner import WriteItemType
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        return data.getbuffer()
    tensor = data.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getbuffer()


class CrcWriter(FileSystemWriter):
    """FileSystemWriter (one file per rank, fsync'd) that hashes what it writes.

    files   {name in the dcp folder: [size, crc32]} of the files this rank wrote
    items   {name: [[offset, length, crc32], ...]} of the items in them
    """

    def __init__(self, path: str):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
        self.files: dict[str, list[int]] = {}
        self.items: dict[str, list[list[int]]] = {}

    def write_data(self, plan, planner):
        from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
        from torch.distributed.checkpoint.storage import WriteResult
        from torch.futures import Future

        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results, ranges = [], []

        def chunks():
            offset = 0
            for item in plan.items:
                buf = _serialise(item, planner)
                ranges.append([offset, len(buf), zlib.crc32(buf)])
                results.append(WriteResult(index=item.index, size_in_bytes=len(buf),
                                           storage_data=_StorageInfo(name, offset, len(buf))))
                offset += len(buf)
                yield buf

        self.files[name] = list(_durable_write(os.path.join(self.path, name), chunks()))
        self.items[name] = ranges
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata, results) -> None:
        """The coordinator's `.metadata`, written to a temporary name and renamed, as DCP does."""
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        tmp = os.path.join(self.path, ".metadata.tmp")
        self.files[".metadata"] = list(_durable_write(tmp, [pickle.dumps(metadata)]))
        os.replace(tmp, os.path.join(self.path, ".metadata"))
