"""Reading checkpoints without running code from them or leaving them.

A checkpoint is data someone else may have written. `torch.distributed.checkpoint` unpickles its
`.metadata` file with plain `pickle`, opens whatever path each storage entry names (`relative_path`,
joined to the folder unchecked: `../../other-ckpt/...` or an absolute path works) and loads
non-tensor items with `torch.load(weights_only=False)`. Here:
- every file is opened through `open_confined`: a relative, normalised path below the version
  folder, no symbolic link at any level, a regular file (a FIFO would block, a device never ends)
  of the size meta.json lists, read with that size as the bound;
- `.metadata` goes through an unpickler that builds only DCP's metadata classes and torch's dtype
  and size values, then `check_dcp_metadata` checks every field DCP will use: each storage entry
  names a file meta.json lists, its byte range lies inside that file, and each tensor's chunks lie
  inside the tensor, cover it exactly once and fit in their stored bytes (so a declared shape
  cannot allocate more than the file holds);
- `SafeReader.read_data` (our own, replacing FileSystemReader's) loads each item with
  `torch.load(weights_only=True)` and checks its dtype and shape against the metadata.
Anything else is a HybridError naming the entry. `load` and `export` read through the same reader.
"""
from __future__ import annotations

import errno
import fcntl
import io
import logging
import os
import pickle
import stat
import zlib

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from ..config.files import read_capped
from ..errors import HybridError

META_LIMIT = 64 << 20
"""Largest meta.json or .metadata read (bytes): hybrid writes a few KB per parameter name."""

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


def check_relative(rel) -> str:
    """`rel` as a path inside a folder: relative, normalised, no `..`; else a HybridError."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel or os.path.isabs(rel) \
            or os.path.normpath(rel) != rel or any(p in ("", ".", "..") for p in rel.split("/")):
        raise HybridError(f"names the file {str(rel)[:80]!r}, which is not a relative path inside the checkpoint")
    return rel


def open_confined(root: str, rel: str, size: int | None = None):
    """Open root/rel for binary reading: no symbolic link below `root`, a regular file, of `size`
    bytes when given. HybridError naming `rel` otherwise (never anything about paths outside)."""
    parts = check_relative(rel).split("/")
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    try:       # root is the version folder: a link there could point at another checkpoint
        dfd = os.open(root, flags | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise HybridError(f"the version folder {os.path.basename(root)[:80]} is a symbolic link or not a "
                              "folder; a checkpoint holds only the regular files meta.json lists") from None
        raise HybridError(f"cannot open the checkpoint folder: {e.strerror}") from None
    fd = -1
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            extra = os.O_NOFOLLOW | (os.O_NONBLOCK if last else os.O_DIRECTORY)
            try:
                nfd = os.open(part, flags | extra, dir_fd=dfd)
            except OSError as e:
                what = "/".join(parts[:i + 1])
                if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    raise HybridError(f"{what} is a symbolic link or not a folder; a checkpoint holds only "
                                      "the regular files meta.json lists") from None
                if e.errno == errno.ENOENT:
                    raise HybridError(f"{what} is missing") from None
                raise HybridError(f"cannot open {what}: {e.strerror}") from None
            if last:
                fd = nfd
            else:
                os.close(dfd)
                dfd = nfd
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or \
                stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file"
            raise HybridError(f"{rel} is {kind}; a checkpoint holds only regular files")
        if size is not None and st.st_size != size:
            raise HybridError(f"{rel} has {st.st_size} bytes, meta.json lists {size} (truncated or replaced)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        f = os.fdopen(fd, "rb")
        fd = -1
        return f
    finally:
        os.close(dfd)
        if fd >= 0:
            os.close(fd)


def read_bounded(root: str, rel: str, size: int | None, limit: int = META_LIMIT) -> bytes:
    """The whole of root/rel (opened with open_confined), at most `limit` bytes."""
    with open_confined(root, rel, size) as f:
        return read_capped(f, limit, rel, "hybrid never writes one that large")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which a checkpoint's metadata never needs")


def load_metadata(data: bytes, name: str):
    """Unpickle DCP metadata bytes through the allowlist; HybridError for anything else."""
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:   # noqa: BLE001 - any malformed pickle is the same verdict (RecursionError too)
        raise HybridError(f"refusing to load {name!r}: it is not plain checkpoint metadata "
                          f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__}); "
                          "a checkpoint from an untrusted source may try to run code") from None


def _size(value, what: str, ndim: int | None = None) -> tuple[int, ...]:
    if not isinstance(value, (torch.Size, tuple, list)) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 for v in value):
        raise HybridError(f"{what} is not a list of non-negative integers")
    if ndim is not None and len(value) != ndim:
        raise HybridError(f"{what} has {len(value)} dimensions, the tensor {ndim}")
    return tuple(value)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def check_dcp_metadata(md, files: dict[str, int], max_chunks: int) -> dict:
    """Every field of DCP metadata `md` that a load uses, against `files` (path inside the dcp
    folder -> size, from meta.json); a tensor in at most `max_chunks` pieces (hybrid writes one
    per rank at most: the world size that saved it). Returns {(fqn, offsets): (sizes, dtype)} for
    each tensor chunk. HybridError naming the entry otherwise."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorStorageMetadata)
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise HybridError(f"holds a {type(md).__name__}, not checkpoint metadata")
    if len(md.storage_data) > max_chunks * max(len(md.state_dict_metadata), 1):
        raise HybridError(f"has {len(md.storage_data)} storage entries; hybrid writes at most {max_chunks} per item")
    chunks, stored = {}, {}
    for key, info in md.storage_data.items():
        if not isinstance(key, MetadataIndex) or not isinstance(info, _StorageInfo) or not isinstance(key.fqn, str):
            raise HybridError("has a storage entry that is not DCP's")
        where = f"entry {key.fqn[:80]!r}"
        rel = info.relative_path
        try:
            check_relative(rel)
        except HybridError as e:
            raise HybridError(f"{where} {e}") from None
        if rel not in files:
            raise HybridError(f"{where} names the file {rel[:80]!r}, which meta.json does not list")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length)) \
                or info.offset + info.length > files[rel]:
            raise HybridError(f"{where} reads bytes outside its file {rel!r}")
        if getattr(info, "transform_descriptors", None):
            raise HybridError(f"{where} asks for stream transforms, which hybrid never writes")
        offset = None if key.offset is None else _size(key.offset, where)
        stored[(key.fqn, offset)] = info.length
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise HybridError("has a key that is not a string")
        where = f"entry {fqn[:80]!r}"
        if isinstance(entry, BytesStorageMetadata):
            if (fqn, None) not in stored:
                raise HybridError(f"{where} has no stored bytes")
            continue
        if not isinstance(entry, TensorStorageMetadata) or not isinstance(entry.chunks, list) \
                or not isinstance(getattr(entry.properties, "dtype", None), torch.dtype):
            raise HybridError(f"{where} is neither a tensor nor bytes")
        dtype = entry.properties.dtype
        size = _size(entry.size, f"{where}'s shape")
        if len(entry.chunks) > max_chunks:      # also bounds the pairwise overlap check below
            raise HybridError(f"{where} has {len(entry.chunks)} chunks; hybrid writes at most {max_chunks} (one per "
                              "rank that saved it)")
        covered, boxes = 0, []
        for c in entry.chunks:
            if not isinstance(c, ChunkStorageMetadata):
                raise HybridError(f"{where} has a chunk that is not DCP's")
            off, sz = _size(c.offsets, f"{where}'s chunk", len(size)), _size(c.sizes, f"{where}'s chunk", len(size))
            if any(o + s > d for o, s, d in zip(off, sz, size)):
                raise HybridError(f"{where} has a chunk outside its shape {size}")
            nbytes = _numel(sz) * dtype.itemsize
            if (fqn, off) not in stored:
                raise HybridError(f"{where} has a chunk with no stored bytes")
            if nbytes > stored[(fqn, off)]:
                raise HybridError(f"{where} declares a {nbytes}-byte chunk stored in {stored[(fqn, off)]} bytes")
            covered += _numel(sz)
            boxes.append((off, sz))
            chunks[(fqn, off)] = (sz, dtype)
        if covered != _numel(size) or _overlap(boxes):
            raise HybridError(f"{where}'s chunks do not cover its shape {size} exactly once")
    return chunks


def _overlap(boxes) -> bool:
    """Whether two of the chunks (offsets, sizes) overlap (a sharded tensor has a few per rank)."""
    for i, (o1, s1) in enumerate(boxes):
        for o2, s2 in boxes[i + 1:]:
            if all(a < c + d and c < a + b for a, b, c, d in zip(o1, s1, o2, s2)) and _numel(s1) and _numel(s2):
                return True
    return False


def _load_item(data: bytes, expected, name: str):
    """One stored item: a tensor of the declared dtype and shape (expected=(sizes, dtype)), or plain data."""
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:   # noqa: BLE001 - a crafted or damaged item is refused, never executed
        raise HybridError(f"refusing to load checkpoint item {name!r}: it is not plain data "
                          f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})") from None
    if expected is not None:
        sizes, dtype = expected
        if not isinstance(obj, torch.Tensor) or obj.dtype != dtype or tuple(obj.shape) != sizes:
            got = f"{obj.dtype} {tuple(obj.shape)}" if isinstance(obj, torch.Tensor) else type(obj).__name__
            raise HybridError(f"checkpoint item {name!r} holds {got}, its metadata declares {dtype} {sizes}")
    return obj


class SafeReader(FileSystemReader):
    """FileSystemReader confined to one version folder's dcp/ files as meta.json lists them:
    `root` the version folder, `files` {path inside root: size}; with `sums` ({path: CRC32} of
    whole files) and `items` ({path: [[offset, length, CRC32], ...]}) each item is checked on the
    bytes read for it, and `.metadata` on its bytes: one read of each byte checks and loads it.
    What `read_data` reads is held until `apply`: DCP raises a failure on every rank first, so a
    failed load changes nothing."""

    def __init__(self, root: str, files: dict[str, int], max_chunks: int, sums: dict[str, int] | None = None,
                 items: dict[str, list] | None = None):
        super().__init__(os.path.join(root, "dcp"))
        self.root, self.max_chunks = root, max_chunks
        self.dcp_files = {k[len("dcp/"):]: v for k, v in files.items() if k.startswith("dcp/")}
        self.sums = {k[len("dcp/"):]: v for k, v in (sums or {}).items() if k.startswith("dcp/")} if sums else None
        self.item_sums = None if items is None else {
            k[len("dcp/"):]: {off: (length, crc) for off, length, crc in v} for k, v in items.items()}
        self.chunks: dict = {}
        self.pending: list = []
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        if self._metadata is not None:      # DCP asks again on every rank: it was read and checked once
            return self._metadata
        if ".metadata" not in self.dcp_files:
            raise HybridError("dcp/.metadata is not listed in meta.json")
        data = read_bounded(self.root, "dcp/.metadata", self.dcp_files[".metadata"])
        if self.sums is not None and zlib.crc32(data) != self.sums.get(".metadata"):
            raise HybridError("dcp/.metadata is corrupted: it fails its CRC32 check")
        md = load_metadata(data, "dcp/.metadata")
        try:
            self.chunks = check_dcp_metadata(md, self.dcp_files, self.max_chunks)
        except HybridError as e:
            raise HybridError(f"dcp/.metadata {e}") from None
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        self._metadata = md
        return md

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        # ranks other than the coordinator get the metadata broadcast, unchecked: check it here
        self.chunks = check_dcp_metadata(metadata, self.dcp_files, self.max_chunks)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def items(self, rel: str):
        """(storage index, item info) of every entry stored in dcp/`rel`."""
        return [(k, v) for k, v in self.storage_data.items() if v.relative_path == rel]

    def read_items(self, rel: str, items):
        """Yield (item index, loaded object) for `items` of one file, each checked."""
        with open_confined(self.root, f"dcp/{rel}", self.dcp_files[rel]) as f:
            for index, info in sorted(items, key=lambda kv: kv[1].offset):
                f.seek(info.offset)
                data = f.read(info.length)
                if len(data) != info.length:
                    raise HybridError(f"dcp/{rel} ends inside item {index.fqn!r}")
                self._check_sum(rel, info, data, index.fqn)
                offset = None if index.offset is None else tuple(index.offset)
                yield index, _load_item(data, self.chunks.get((index.fqn, offset)), index.fqn)

    def _check_sum(self, rel: str, info, data: bytes, fqn: str) -> None:
        if self.item_sums is None:          # a checkpoint hashed per file only: check_files did it
            return
        want = self.item_sums.get(rel, {}).get(info.offset)
        if want is None or want[0] != info.length:
            raise HybridError(f"dcp/{rel}: item {fqn[:80]!r} (bytes {info.offset}-{info.offset + info.length}) has no "
                              "CRC32 in meta.json")
        if zlib.crc32(data) != want[1]:
            raise HybridError(f"dcp/{rel} is corrupted: it fails its CRC32 check (item {fqn[:80]!r})")

    def check_all(self, rels: list[str]) -> None:
        """Load every item stored in the given files and check it, without keeping any (the
        pre-pass that lets a load fail before it changes anything)."""
        for rel in rels:
            for _ in self.read_items(rel, self.items(rel)):
                pass

    def read_data(self, plan, planner):
        """Read and check every item of this rank's plan, each byte once; held until `apply`."""
        from torch.futures import Future
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for rel, reqs in per_file.items():
            by_index = {}
            for req in reqs:
                by_index.setdefault(req.storage_index, []).append(req)
            items = [(k, self.storage_data[k]) for k in by_index]
            for index, obj in self.read_items(rel, items):
                for req in by_index[index]:
                    self.pending.append((index, req, obj))
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def apply(self, planner) -> None:
        """Copy what read_data held into the state dict (once every rank's reads succeeded)."""
        from torch.distributed.checkpoint.planner import LoadItemType
        pending, self.pending = self.pending, []
        for index, req, obj in pending:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes_checked(req, obj)
                continue
            part = obj
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                part = part.narrow(dim, start, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != part.size():
                raise HybridError(f"checkpoint item {index.fqn!r} has shape {tuple(part.shape)} where "
                                  f"this job holds {tuple(target.shape)}")
            target.copy_(part)
            planner.commit_tensor(req, target)


class SafePlanner(DefaultLoadPlanner):
    """Non-tensor items arrive already loaded with torch.load(weights_only=True) by SafeReader."""

    def load_bytes_checked(self, read_item, obj) -> None:
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # what DCP itself uses
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.load_bytes_checked(read_item, _load_item(value.getvalue(), None, read_item.dest_index.fqn))


class _NoMetadataTracebacks(logging.Filter):
    """Drops DCP's "Global metadata is not found" / "Rank local metadata is not found" warnings:
    torch 2.13's state_dict_loader logs each with its traceback on the root logger before it raises
    the same failure, which reaches the user as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.pathname.replace(os.sep, "/").endswith("distributed/checkpoint/state_dict_loader.py")
                    and "metadata is not found" in str(record.msg))


def dcp_load(state: dict, reader: SafeReader, no_dist: bool = False) -> None:
    """dcp.load through the confined reader and the safe planner; the values are copied into
    `state` only after every rank read and checked its items."""
    import torch.distributed.checkpoint as dcp
    quiet = _NoMetadataTracebacks()
    logging.getLogger().addFilter(quiet)
    planner = SafePlanner()
    try:
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    finally:
        logging.getLogger().removeFilter(quiet)
    reader.apply(planner)
