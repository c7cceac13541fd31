"""Checkpoints that survive strategy changes, world-size changes and crashes.

Layout of a checkpoint directory:
    meta.json            the commit point: written last, atomically (tmp file + os.replace)
    data-<step>-<id>/    this version's files; meta.json names it
        HYBRID_DATA      marks the folder as written by hybrid (only such folders are ever removed)
        dcp/             torch.distributed.checkpoint: model + optimizer state under the model's
                         own parameter names, optimizer state flattened by name (one portable
                         layout whatever the strategy; sharded tensors stay sharded, replicated
                         ones are written once)
        rng-<rank>.pt    each rank's RNG states (tensors and numbers only)
        loop.pt          scheduler and loss-scaler state, step counts (plain data)
A crash before meta.json is replaced leaves the previous version in force; older data folders are
removed only after the switch. Every file's size and CRC32 are in meta.json and checked on load.

Trust: `save` removes only folders it marked as its own and refuses a directory holding anything
else unless `overwrite=True` (which still deletes nothing foreign). `load` never runs code from the
files: JSON, `torch.load(weights_only=True)` and an allowlist unpickler for DCP's metadata
(hybrid/safeio.py); DeepSpeed's own pickled checkpoint format is neither written nor read.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
import zlib

import torch
import torch.distributed as dist

from .errors import HybridError
from .safeio import dcp_load

FORMAT = "hybrid-checkpoint/1"
META = "meta.json"
MARKER = "HYBRID_DATA"


def _crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _rng_state() -> dict:
    """Tensors, ints, strings and tuples only: loadable with torch.load(weights_only=True)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _read_plain(path: str, what: str) -> dict:
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:   # noqa: BLE001 - a crafted or damaged file is refused, never executed
        raise HybridError(f"refusing to load {path!r}: not plain {what} ({str(e).splitlines()[0][:200]})") from None


def _is_ours(path: str, entry: str) -> bool:
    if entry == META:               # another tool's meta.json is not ours to replace
        try:
            with open(os.path.join(path, META)) as f:
                return json.load(f).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            return False
    return (entry.startswith(f".{META}.")
            or (entry.startswith("data-") and os.path.isfile(os.path.join(path, entry, MARKER))))


def _prepare(path: str, name: str, overwrite: bool) -> str | None:
    """Rank 0: check the target and create this version's folder; an error message or None."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"checkpoint path {path!r} is a file; give a directory (it is created if missing)"
    try:
        os.makedirs(path, exist_ok=True)
        foreign = sorted(e for e in os.listdir(path) if not _is_ours(path, e))
        if META in foreign:
            return (f"{path!r} holds a {META} that hybrid did not write; save somewhere else (hybrid's commit "
                    f"point would replace it, overwrite=True or not)")
        if foreign and not overwrite:
            return (f"{path!r} holds files hybrid did not write ({', '.join(foreign[:3])}"
                    f"{', ...' if len(foreign) > 3 else ''}); save into an empty or hybrid-only directory, or "
                    "pass overwrite=True to write beside them (they are never deleted)")
        os.makedirs(os.path.join(path, name))
        with open(os.path.join(path, name, MARKER), "w") as f:
            f.write(FORMAT + "\n")
    except OSError as e:
        return f"cannot write a checkpoint to {path!r}: {e.strerror or e}; choose a writable directory"
    return None


def _model_info(module) -> dict:
    from .presets import DecoderConfig
    cfg = getattr(module, "config", None)
    info = {"class": type(module).__name__}
    if isinstance(cfg, DecoderConfig):
        info["decoder"] = cfg.to_dict()
    elif cfg is not None and hasattr(cfg, "to_dict"):
        info["hf_config"] = cfg.to_dict()
    return info


def _param_table(module) -> dict:
    """name -> [shape, dtype] for every parameter name (tied ones under each name)."""
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        shape = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
        out[name] = [list(shape), str(p.dtype).replace("torch.", "")]
    return out


def _tied(module) -> list[list[str]]:
    from .profile import names_by_param
    return [g for g in names_by_param(module).values() if len(g) > 1]


def _broadcast(obj, rank):
    box = [obj if rank == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _rank0_buffers(module, model_state: dict) -> None:
    """Buffers (BatchNorm statistics...) can differ across ranks under sharded strategies; the
    rule: the checkpoint holds rank 0's. Copies are broadcast, the live buffers are untouched."""
    from torch.distributed.tensor import DTensor
    for name, _ in module.named_buffers():
        t = model_state.get(name)
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            t = t.detach().clone()
            if dist.get_world_size() > 1:
                dist.broadcast(t, src=0)
            model_state[name] = t


def save(wrapped, path: str, extra: dict | None = None, overwrite: bool = False) -> str:
    """Write a new version of the checkpoint at `path` (collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.abspath(path)
    name = f"data-{wrapped.step_count:08d}-{uuid.uuid4().hex[:8]}"
    name, error = _broadcast((name, _prepare(path, name, overwrite) if rank == 0 else None), rank)
    if error:
        raise HybridError(error)
    data = os.path.join(path, name)
    engine = wrapped.engine
    state = engine.checkpoint_state()
    _rank0_buffers(wrapped.module, state["model"])
    dcp.save(state, checkpoint_id=os.path.join(data, "dcp"))
    torch.save(_rng_state(), os.path.join(data, f"rng-{rank}.pt"))
    if rank == 0:   # scheduler, loss scaler, step counts: plain data
        torch.save(wrapped.loop_state(), os.path.join(data, "loop.pt"))
    dist.barrier()
    # every file's size and CRC, hashed by the ranks in turn, committed by rank 0
    files = _broadcast(_files(data), rank)
    mine = {f: [os.path.getsize(os.path.join(data, f)), _crc(os.path.join(data, f))]
            for i, f in enumerate(files) if i % world == rank}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        meta = {"format": FORMAT, "data": name, "step": wrapped.step_count, "world_size": world,
                "strategy": wrapped.strategy.name, "family": wrapped.strategy.family,
                "shard_size": wrapped.chosen.shard_size, "precision": wrapped.chosen.spec.precision,
                "optimizer": type(engine.user_optimizer).__name__,
                "model": _model_info(wrapped.module), "params": _param_table(wrapped.module),
                "tied": _tied(wrapped.module),
                "files": {k: v for g in gathered for k, v in g.items()}, "extra": extra or {}}
        tmp = os.path.join(path, f".{META}.{uuid.uuid4().hex[:8]}")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, META))          # the commit
        for old in os.listdir(path):        # superseded versions (ours only), after the switch
            if old.startswith("data-") and old != name and _is_ours(path, old):
                shutil.rmtree(os.path.join(path, old), ignore_errors=True)
    dist.barrier()
    return data


def read_meta(path: str) -> dict:
    meta_path = os.path.join(path, META)
    if not os.path.isdir(path):
        raise HybridError(f"checkpoint {path!r} does not exist")
    if not os.path.isfile(meta_path):
        raise HybridError(f"{path!r} is not a hybrid checkpoint: it has no {META} (a directory written by "
                          "Wrapped.save, or its parent)")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HybridError(f"{meta_path} is corrupted: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise HybridError(f"{path!r} has format {got!r}; this version reads {FORMAT}")
    # a crafted meta.json must not point reads outside its own version folder
    files = meta.get("files")
    if (not isinstance(meta.get("data"), str) or not re.fullmatch(r"data-\d+-[0-9a-f]+", meta["data"])
            or not isinstance(files, dict)
            or any(os.path.isabs(f) or ".." in f.split("/") for f in files)):
        raise HybridError(f"{meta_path} is malformed: its data folder or file list is not one hybrid writes")
    return meta


def check_files(path: str, meta: dict, only: list[str] | None = None) -> None:
    """Sizes and CRC32 of the files against meta.json (a subset with `only`)."""
    data = os.path.join(path, meta["data"])
    for rel, (size, crc) in meta["files"].items():
        if only is not None and rel not in only:
            continue
        f = os.path.join(data, rel)
        if not os.path.isfile(f):
            raise HybridError(f"checkpoint {path!r} is incomplete: {rel} is missing")
        if os.path.getsize(f) != size:
            raise HybridError(f"checkpoint {path!r} is truncated: {rel} has {os.path.getsize(f)} bytes, "
                              f"expected {size}")
        if _crc(f) != crc:
            raise HybridError(f"checkpoint {path!r} is corrupted: {rel} fails its CRC32 check")


def check_model(meta: dict, module) -> None:
    """The same parameter names and shapes, whatever the strategy."""
    want, have = meta["params"], _param_table(module)
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or unexpected:
        raise HybridError(f"checkpoint is of a different model: parameters only in the checkpoint "
                          f"{missing[:5]}, only in this model {unexpected[:5]}")
    for name, (shape, _) in want.items():
        if list(have[name][0]) != list(shape):
            raise HybridError(f"checkpoint is of a different model: parameter {name!r} has shape "
                              f"{tuple(shape)} in the checkpoint and {tuple(have[name][0])} in this model")


def _first_line(e: BaseException) -> str:
    """DCP's CheckpointException carries {rank: (exception, traceback)}: the first cause's line."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, cause = sorted(failures.items())[0]
        cause = cause[0] if isinstance(cause, tuple) else cause
        return f"rank {rank}: {type(cause).__name__}: {str(cause).splitlines()[0][:300] if str(cause) else ''}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def load(wrapped, path: str) -> dict:
    """Restore model, optimizer, step and RNG from `path`, whatever strategy and world size wrote
    it (collective). Returns the `extra` dict given to save. Raises HybridError on a bad
    checkpoint on every rank alike; nothing on disk is changed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.abspath(path)
    meta = read_meta(path)
    check_model(meta, wrapped.module)
    files = sorted(meta["files"])
    error = None
    try:
        check_files(path, meta, [f for i, f in enumerate(files) if i % world == rank])
    except HybridError as e:
        error = str(e)
    errors = [None] * world
    dist.all_gather_object(errors, error)
    if any(errors):
        raise HybridError(next(e for e in errors if e))
    data = os.path.join(path, meta["data"])
    engine = wrapped.engine
    mine = type(engine.user_optimizer).__name__
    if meta.get("optimizer", mine) != mine:
        raise HybridError(f"checkpoint {path!r} holds {meta['optimizer']} optimizer state and this job "
                          f"uses {mine}; build the same optimizer as the run that saved it")
    state = engine.checkpoint_template()
    try:
        dcp_load(state, os.path.join(data, "dcp"))
    except HybridError:
        raise
    except Exception as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise HybridError(f"cannot load {path!r} into this job ({wrapped.strategy.name}, optimizer {mine}): "
                          f"{_first_line(e)}") from None
    engine.load_checkpoint_state(state)
    rng = os.path.join(data, f"rng-{rank}.pt")
    if meta["world_size"] == world and os.path.exists(rng):
        _set_rng_state(_read_plain(rng, "RNG state"))
    wrapped.step_count = meta["step"]
    loop = os.path.join(data, "loop.pt")
    if os.path.exists(loop):
        wrapped.load_loop_state(_read_plain(loop, "training-loop state"))
    dist.barrier()
    return meta["extra"]
