"""Checkpoints that survive strategy changes, world-size changes and crashes.

Layout of a checkpoint directory:
    meta.json            the commit point: written last, atomically (tmp file + os.replace)
    data-<step>-<id>/    this version's files; meta.json names it
        dcp/             torch.distributed.checkpoint: model + optimizer state under the model's
                         own parameter names, optimizer state flattened by name (one portable
                         layout whatever the strategy; sharded tensors stay sharded, replicated
                         ones are written once)
        rng-<rank>.pt    each rank's RNG states
        deepspeed/       DeepSpeed's own checkpoint (DeepSpeed strategies), used to resume the
                         same strategy on the same world size
A crash before meta.json is replaced leaves the previous version in force; older data folders are
removed only after the switch. Every file's size and CRC32 are in meta.json and checked on load.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import uuid
import zlib

import torch
import torch.distributed as dist

from .errors import HybridError

FORMAT = "hybrid-checkpoint/1"
META = "meta.json"


def _crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
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
        np.random.set_state(state["numpy"])


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
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def _broadcast(obj, rank):
    box = [obj if rank == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def save(wrapped, path: str, extra: dict | None = None) -> str:
    """Write a new version of the checkpoint at `path` (collective: every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.abspath(path)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    name = _broadcast(f"data-{wrapped.step_count:08d}-{uuid.uuid4().hex[:8]}", rank)
    data = os.path.join(path, name)
    engine = wrapped.engine
    dcp.save(engine.checkpoint_state(), checkpoint_id=os.path.join(data, "dcp"))
    torch.save(_rng_state(), os.path.join(data, f"rng-{rank}.pt"))
    engine.save_native(os.path.join(data, "deepspeed"))
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
                "model": _model_info(wrapped.module), "params": _param_table(wrapped.module),
                "tied": _tied(wrapped.module),
                "files": {k: v for g in gathered for k, v in g.items()}, "extra": extra or {}}
        tmp = os.path.join(path, f".{META}.{uuid.uuid4().hex[:8]}")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, META))          # the commit
        for old in os.listdir(path):                       # superseded versions, after the switch
            if old.startswith("data-") and old != name:
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
    if meta.get("format") != FORMAT:
        raise HybridError(f"{path!r} has format {meta.get('format')!r}; this version reads {FORMAT}")
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


def load(wrapped, path: str) -> dict:
    """Restore model, optimizer, step and RNG from `path`, whatever strategy and world size wrote
    it (collective). Returns the `extra` dict given to save. Raises HybridError on a bad
    checkpoint on every rank alike; nothing on disk is changed."""
    import torch.distributed.checkpoint as dcp

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
    same_run = (meta["strategy"] == wrapped.strategy.name and meta["world_size"] == world
                and os.path.isdir(os.path.join(data, "deepspeed")))
    if not (same_run and engine.load_native(os.path.join(data, "deepspeed"))):
        state = engine.checkpoint_template()
        try:
            dcp.load(state, checkpoint_id=os.path.join(data, "dcp"))
        except Exception as e:  # DCP wraps per-rank failures; say what does not match
            raise HybridError(f"cannot load {path!r} into this job ({wrapped.strategy.name}, optimizer "
                              f"{type(wrapped.optimizer).__name__}): {str(e).splitlines()[0][:400]}") from e
        engine.load_checkpoint_state(state)
    rng = os.path.join(data, f"rng-{rank}.pt")
    if meta["world_size"] == world and os.path.exists(rng):
        _set_rng_state(torch.load(rng, weights_only=False))
    wrapped.step_count = meta["step"]
    dist.barrier()
    return meta["extra"]
