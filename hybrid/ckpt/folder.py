"""Reading a checkpoint folder, for `load` and `export` alike: meta.json checked field by field,
every file confined to the version folder and checked against meta.json's size and CRC32, DCP's
metadata checked against both (hybrid/ckpt/safeio.py).

What a checkpoint folder may hold (anything else is never opened):
    meta.json                 JSON, at most 64 MiB, the fields `validate_meta` names
    data-<step>-<id>/         the version meta.json names; below it only the regular files
                              meta.json lists (no symbolic links, FIFOs or devices)
"""
from __future__ import annotations

import json
import os
import random
import re
import zlib

import torch

from ..errors import HybridError, short
from .safeio import META_LIMIT, SafeReader, check_relative, open_confined, read_bounded

FORMAT = "hybrid-checkpoint/1"
META = "meta.json"
MARKER = "HYBRID_DATA"
DATA_NAME = re.compile(r"data-\d{1,20}-[0-9a-f]{1,32}")
_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
           "float8_e4m3fn", "float8_e5m2", "complex64")


def _crc(f) -> int:
    crc = 0
    while chunk := f.read(1 << 24):
        crc = zlib.crc32(chunk, crc)
    return crc


def _is_int(v, lo: int = 0, hi: int = 1 << 62) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi


def _check_items(items, files: dict, bad) -> None:
    """meta.json's `items`: {listed file: [[offset, length, crc32], ...]}, each range inside its file."""
    if not isinstance(items, dict) or not all(rel in files and isinstance(v, list) for rel, v in items.items()):
        raise bad("items", "is not an object of listed file: [[offset, length, crc32], ...]")
    for rel, v in items.items():
        for entry in v:
            if not (isinstance(entry, list) and len(entry) == 3 and _is_int(entry[0]) and _is_int(entry[1])
                    and _is_int(entry[2], 0, 1 << 32) and entry[0] + entry[1] <= files[rel][0]):
                raise bad("items", f"lists {short(rel)} with {short(entry)}, not [offset, length, crc32] inside it")


def validate_meta(meta) -> dict:
    """Every meta.json field load and export use, by type and range; HybridError naming the
    first bad field (its value cut to 80 characters)."""
    def bad(field, rule):
        return HybridError(f"field {field!r} {rule}")

    if not isinstance(meta, dict):
        raise HybridError(f"is a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT:
        raise HybridError(f"has format {short(meta.get('format'))}; this version reads {FORMAT}")
    if not isinstance(meta.get("data"), str) or not DATA_NAME.fullmatch(meta["data"]):
        raise bad("data", f"is {short(meta.get('data'))}, not a version folder name hybrid writes (data-<step>-<id>)")
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        raise bad("files", "is not a non-empty object of file: [size, crc32]")
    for rel, v in files.items():
        try:
            check_relative(rel)
        except HybridError as e:
            raise bad("files", str(e)) from None
        if not (isinstance(v, list) and len(v) == 2 and _is_int(v[0]) and _is_int(v[1], 0, 1 << 32)):
            raise bad("files", f"lists {short(rel)} as {short(v)}, not [size, crc32]")
    _check_items(meta.get("items", {}), files, bad)
    for field, lo in (("step", 0), ("world_size", 1)):
        if not _is_int(meta.get(field), lo):
            raise bad(field, f"is {short(meta.get(field))}, not an integer >= {lo}")
    params = meta.get("params")
    if not isinstance(params, dict) or not params:
        raise bad("params", "is not a non-empty object of parameter: [shape, dtype]")
    for name, v in params.items():
        if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], list) and len(v[0]) <= 8
                and all(_is_int(s) for s in v[0]) and v[1] in _DTYPES):
            raise bad("params", f"lists {short(name)} as {short(v)}, not [shape, dtype]")
    tied = meta.get("tied", [])
    if not isinstance(tied, list) or not all(isinstance(g, list) and g and all(n in params for n in g) for g in tied):
        raise bad("tied", "is not a list of groups of parameter names")
    for field in ("model", "extra"):
        if not isinstance(meta.get(field, {}), dict):
            raise bad(field, f"is {short(meta.get(field))}, not an object")
    model = meta.get("model", {})
    for field in ("decoder", "hf_config"):
        if field in model and not isinstance(model[field], dict):
            raise bad(f"model.{field}", "is not an object")
    for field in ("optimizer", "strategy", "family", "precision"):
        if field in meta and not isinstance(meta[field], str):
            raise bad(field, f"is {short(meta[field])}, not a string")
    history = meta.get("history", [])
    if not isinstance(history, list) or not all(isinstance(h, str) and DATA_NAME.fullmatch(h) for h in history):
        raise bad("history", "is not a list of version folder names")
    return meta


def read_meta(path: str) -> dict:
    """meta.json of the checkpoint at `path`, validated."""
    meta_path = os.path.join(path, META)
    if not os.path.isdir(path):
        raise HybridError(f"checkpoint {path!r} does not exist")
    if not os.path.lexists(meta_path):
        raise HybridError(f"{path!r} is not a hybrid checkpoint: it has no {META} (a directory written by "
                          "Wrapped.save, or its parent)")
    try:
        meta = json.loads(read_bounded(path, META, None, META_LIMIT))
    except HybridError as e:
        raise HybridError(f"checkpoint {path!r}: {e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise HybridError(f"{meta_path} is corrupted: {str(e).splitlines()[0][:120]}") from None
    except RecursionError:
        raise HybridError(f"{meta_path} is corrupted: nested deeper than any meta.json hybrid writes") from None
    try:
        return validate_meta(meta)
    except HybridError as e:
        raise HybridError(f"{meta_path} is malformed: {e}") from None


def check_files(path: str, meta: dict, only: list[str] | None = None) -> None:
    """Sizes and CRC32 of the listed files (a subset with `only`), opened confined."""
    data = os.path.join(path, meta["data"])
    for rel, (size, crc) in meta["files"].items():
        if only is not None and rel not in only:
            continue
        try:
            with open_confined(data, rel, size) as f:
                ok = _crc(f) == crc
        except HybridError as e:
            raise HybridError(f"checkpoint {path!r} is incomplete or altered: {meta['data']}/{e}") from None
        if not ok:
            raise HybridError(f"checkpoint {path!r} is corrupted: {rel} fails its CRC32 check")


def reader(path: str, meta: dict) -> SafeReader:
    """The DCP reader of this version, its metadata read and checked (HybridError naming the entry)."""
    hashed = "items" in meta        # each item's CRC32 listed: checked on the bytes read for it
    r = SafeReader(os.path.join(path, meta["data"]), {k: v[0] for k, v in meta["files"].items()},
                   max_chunks=meta["world_size"], sums={k: v[1] for k, v in meta["files"].items()} if hashed else None,
                   items=meta["items"] if hashed else None)
    try:
        md = r.read_metadata()
    except HybridError as e:
        raise HybridError(f"checkpoint {path!r}: {e}") from None
    r.storage_data = md.storage_data
    r.metadata = md
    return r


def check_items(path: str, r: SafeReader, rels: list[str]) -> None:
    """Load and check every item stored in the given dcp files (paths inside dcp/)."""
    try:
        r.check_all(rels)
    except HybridError as e:
        raise HybridError(f"checkpoint {path!r}: {e}") from None


def read_plain(path: str, meta: dict, rel: str, what: str):
    """A small torch.save'd file of the version (rng-<rank>.pt, loop.pt), confined, size-bounded,
    read once: its CRC32 checked on those bytes, then torch.load(weights_only=True)."""
    import io

    import torch
    size, crc = meta["files"][rel]
    try:
        data = read_bounded(os.path.join(path, meta["data"]), rel, size)
        if zlib.crc32(data) != crc:
            raise HybridError(f"{rel} is corrupted: it fails its CRC32 check")
        return torch.load(io.BytesIO(data), weights_only=True)
    except HybridError as e:
        raise HybridError(f"checkpoint {path!r}: {e}") from None
    except Exception as e:   # noqa: BLE001 - a crafted or damaged file is refused, never executed
        raise HybridError(f"refusing to load {rel!r} of {path!r}: not plain {what} "
                          f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})") from None


def dcp_files(meta: dict) -> list[str]:
    """The data files of the dcp folder (paths inside dcp/), in a fixed order."""
    return sorted(k[4:] for k in meta["files"] if k.startswith("dcp/") and k != "dcp/.metadata")


def first_line(e: BaseException) -> str:
    """DCP's CheckpointException carries {rank: (exception, traceback)}: the first cause's line
    (a HybridError's message as it is)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, cause = sorted(failures.items())[0]
        cause = cause[0] if isinstance(cause, tuple) else cause
        if isinstance(cause, HybridError):
            return str(cause)
        text = str(cause).strip()
        return f"rank {rank}: {type(cause).__name__}: {text.splitlines()[0][:200] if text else ''}"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


# --- what load applies, checked before anything of the job changes ---------------------------------
def _same_kind(saved, live, depth: int = 0) -> bool:
    """Whether a saved scheduler/scaler value has the shape of the live one (numbers for numbers,
    equally long lists, the same keys), so that applying it cannot fail later."""
    if depth > 8:
        return False
    if isinstance(live, bool) or live is None:
        return saved is None or isinstance(saved, type(live)) or live is None
    if isinstance(live, (int, float)):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool)
    if isinstance(live, (list, tuple)):
        return isinstance(saved, (list, tuple)) and len(saved) == len(live) and all(
            _same_kind(s, v, depth + 1) for s, v in zip(saved, live))
    if isinstance(live, dict):
        return isinstance(saved, dict) and set(saved) <= set(live) and all(
            _same_kind(saved[k], live[k], depth + 1) for k in saved)
    if isinstance(live, torch.Tensor):
        return isinstance(saved, torch.Tensor) and saved.shape == live.shape and saved.dtype == live.dtype
    return isinstance(saved, type(live))


def check_loop(wrapped, state) -> None:
    if not isinstance(state, dict):
        raise HybridError(f"loop.pt holds a {type(state).__name__}, not the loop state hybrid writes")
    for key in ("optimizer_steps", "skipped_steps"):
        v = state.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise HybridError(f"loop.pt: {key} is {short(v)}, not a count")
    tracked = state.get("tracked", {})
    if not isinstance(tracked, dict) or not all(isinstance(k, str) for k in tracked):
        raise HybridError(f"loop.pt: tracked is {short(tracked)}, not an object of name: state")
    live = {"scheduler": wrapped.scheduler.state_dict() if wrapped.scheduler is not None else None,
            "scaler": wrapped.engine.scaler_state()}
    for key, now in live.items():
        saved = state.get(key)
        if saved is not None and now is not None and not _same_kind(saved, now):
            raise HybridError(f"loop.pt: the saved {key} state does not match this job's {key} "
                              f"({type(getattr(wrapped, key, None) or wrapped.engine).__name__}); build the same "
                              f"{key} as the run that saved it")


def check_rng(state) -> None:
    """Apply the saved RNG states to scratch generators: what fails here would fail on the real ones."""
    if not isinstance(state, dict) or "python" not in state or "torch" not in state:
        raise HybridError("the RNG state is not the dict hybrid writes")
    try:
        random.Random().setstate(state["python"])
        torch.Generator().set_state(state["torch"])
        if "cuda" in state and not (isinstance(state["cuda"], torch.Tensor) and state["cuda"].dtype == torch.uint8):
            raise TypeError("cuda state is not a byte tensor")
        if "numpy" in state:
            import numpy as np
            kind, keys, pos, has_gauss, cached = state["numpy"]
            np.random.RandomState().set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    except Exception as e:  # noqa: BLE001 - any malformed state is the same verdict
        raise HybridError(f"the RNG state is malformed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:80] if str(e) else ''})") from None


def plan_load(path: str, template: dict, md) -> tuple[dict, dict, list[str]]:
    """What DCP will load: the template less the optimizer entries the checkpoint lacks (they start
    fresh), every other entry present with this job's shape. (to load, fresh values, log lines)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # the keys DCP uses
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat, mappings = flatten_state_dict(template)
    stored = md.state_dict_metadata
    fresh, kinds = set(), {}
    for key, value in flat.items():
        entry = stored.get(key)
        where = mappings[key]
        if entry is None:
            if len(where) >= 2 and where[0] == "optim" and str(where[1]).startswith(("state.", "param_groups.")):
                fresh.add(where[:2])
                kind = str(where[1]).rsplit(".", 1)[-1]
                kinds.setdefault(kind, set()).add(str(where[1]))
                continue
            raise HybridError(f"checkpoint {path!r} has no value for {short(key)}, which this job holds; it is of "
                              "a different model (or a model with other buffers)")
        if isinstance(value, torch.Tensor) != isinstance(entry, TensorStorageMetadata):
            raise HybridError(f"checkpoint {path!r} stores {short(key)} as "
                              f"{'a tensor' if isinstance(entry, TensorStorageMetadata) else 'plain data'}; this "
                              f"job holds {'a tensor' if isinstance(value, torch.Tensor) else 'plain data'} there")
        if isinstance(value, torch.Tensor) and tuple(entry.size) != tuple(value.shape):
            raise HybridError(f"checkpoint {path!r} has {short(key)} of shape {tuple(entry.size)}; this job holds "
                              f"{tuple(value.shape)}")
    notes = []
    state_kinds = {k: len(v) for k, v in kinds.items() if any(n.startswith("state.") for n in v)}
    if state_kinds:
        notes.append(f"hybrid: checkpoint {path} has no optimizer state "
                     f"{', '.join(f'{k} ({n} parameters)' for k, n in sorted(state_kinds.items()))}: the run that "
                     "saved it kept none (SGD without momentum, or frozen parameters); it starts fresh")
    unused = sorted({k.rsplit(".", 1)[-1] for k in stored if k.startswith("optim.state.") and k not in flat})
    if unused:
        notes.append(f"hybrid: checkpoint {path} holds optimizer state this job does not use "
                     f"({', '.join(unused[:5])}; frozen parameters or another optimizer setting): ignored")
    to_load = {k: dict(v) if isinstance(v, dict) else v for k, v in template.items()}
    values = {}
    for top, key in fresh:
        values.setdefault(top, {})[key] = to_load[top].pop(key)
    return to_load, values, notes
