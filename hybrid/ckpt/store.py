"""Checkpoints that survive strategy changes, world-size changes and crashes.

Layout of a checkpoint directory:
    meta.json            the commit point: written last, atomically (tmp file + os.replace)
    data-<step>-<id>/    this version's files; meta.json names it
        HYBRID_DATA      marks the folder as written by hybrid, and names it
        dcp/             torch.distributed.checkpoint: model + optimizer state under the model's
                         own parameter names, optimizer state flattened by name (one portable
                         layout whatever the strategy; sharded tensors stay sharded, replicated
                         ones are written once)
        rng-<rank>.pt    each rank's RNG states (tensors and numbers only)
        loop.pt          scheduler and loss-scaler state, step counts (plain data)
A crash before meta.json is replaced leaves the previous version in force; older data folders are
removed only after the switch. Every file's size and CRC32, and each DCP item's byte range and
CRC32, are taken as the bytes are written (hybrid/ckpt/writer.py) and listed in meta.json; load
checks each item on the bytes it reads for it, once. An async save (hybrid/ckpt/background.py)
stages the state and runs the same write and commit in the background.

Trust: `save` removes only version folders it can prove it wrote: named in meta.json's `history`
(recorded before the folder is created, so a crashed save's folder is provable too) and carrying a
marker that names the folder itself (a copy the user keeps beside it is never touched). It refuses
a directory holding anything else unless `overwrite=True` (which still deletes nothing foreign).
One job writes a directory at a time: rank 0 holds its lock (hybrid/ckpt/lock.py) from before it
reads the directory until the save ends, so a version folder is deleted only by the save that made
it or, once its writer is gone, by a later one.
`load` never runs code from the files and never reads outside the version folder
(hybrid/ckpt/folder.py, hybrid/ckpt/safeio.py), and checks everything it will apply before it changes the
model, optimizer, scheduler or RNG; DeepSpeed's own pickled checkpoint format is neither written nor read.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import uuid

import torch
import torch.distributed as dist

from ..errors import HybridError
from .folder import (FORMAT, MARKER, META, check_files, check_items, check_loop, check_rng, dcp_files,
                       first_line, plan_load, read_meta, read_plain, reader, short, validate_meta)
from ..log import get_logger
from .lock import BREAK, LOCK, DirLock
from .safeio import dcp_load, read_bounded
from .space import why_write_failed
from .writer import CrcWriter, plain_bytes, write_bytes

log = get_logger(__name__)


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


_TEMP = re.compile(r"\.meta\.json\.[0-9a-f]{8}")


def _marker(path: str, entry: str) -> list[str] | None:
    """The lines of a version folder's marker, or None where there is none (or it is not a file)."""
    try:
        return read_bounded(os.path.join(path, entry), MARKER, None, 4096).decode("utf-8", "replace").splitlines()
    except HybridError:
        return None


def _our_meta(path: str) -> dict | None:
    """The checkpoint's meta.json where hybrid wrote it (and it is intact), else None."""
    try:
        return validate_meta(json.loads(read_bounded(path, META, None)))
    except (HybridError, ValueError, RecursionError):
        return None


def _is_ours(path: str, entry: str) -> bool:
    """Whether `entry` of the checkpoint directory is of hybrid's kinds (not necessarily deletable)."""
    if entry == META:               # another tool's meta.json is not ours to replace
        try:
            meta = json.loads(read_bounded(path, META, None))
        except (HybridError, ValueError, RecursionError):
            return False
        return isinstance(meta, dict) and meta.get("format") == FORMAT
    if _TEMP.fullmatch(entry) or entry == LOCK or BREAK.fullmatch(entry):
        return True
    return entry.startswith("data-") and _marker(path, entry) is not None


def _provably_ours(path: str, entry: str, history: list[str]) -> bool:
    """A version folder save may delete: meta.json's history names it, it is a real folder (not a
    link) and its marker names it (markers before the name was recorded hold only the format line,
    and the history then is only the version meta.json named)."""
    if entry not in history or os.path.islink(os.path.join(path, entry)):
        return False
    lines = _marker(path, entry)
    return lines is not None and (lines[1:2] == [entry] or len(lines) == 1)


def _write_meta(path: str, meta: dict) -> None:
    """meta.json replaced atomically (the commit); the temporary file removed on failure."""
    tmp = os.path.join(path, f".{META}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, META))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _prepare(path: str, name: str, overwrite: bool) -> tuple[str | None, list[str], DirLock | None]:
    """Rank 0: check the target, take its lock, record `name` in the history and create this
    version's folder. (error message or None, the history of version folders this save may delete,
    the lock held: released by the caller; on an error it is released here)."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"checkpoint path {path!r} is a file; give a directory (it is created if missing)", [], None
    lock = None
    try:
        os.makedirs(path, exist_ok=True)
        lock = DirLock.acquire(path)        # one writer: what follows sees no other save's half-made folder
        foreign = sorted(e for e in os.listdir(path) if not _is_ours(path, e))
        if META in foreign:
            lock.release()
            return (f"{path!r} holds a {META} that hybrid did not write; save somewhere else (hybrid's commit "
                    f"point would replace it, overwrite=True or not)"), [], None
        if foreign and not overwrite:
            lock.release()
            return (f"{path!r} holds files hybrid did not write ({', '.join(short(f, 40) for f in foreign[:3])}"
                    f"{', ...' if len(foreign) > 3 else ''}); save into an empty or hybrid-only directory, or "
                    "pass overwrite=True to write beside them (they are never deleted)"), [], None
        for entry in os.listdir(path):      # temporary files of our own saves that crashed
            if _TEMP.fullmatch(entry) and os.path.isfile(os.path.join(path, entry)) \
                    and not os.path.islink(os.path.join(path, entry)):
                os.unlink(os.path.join(path, entry))
        meta = _our_meta(path)
        history = []
        if meta is not None:
            history = [h for h in [meta["data"], *meta.get("history", [])] if h != name and
                       os.path.isdir(os.path.join(path, h))]
            _write_meta(path, dict(meta, history=[*dict.fromkeys(history), name]))   # before the folder
        os.makedirs(os.path.join(path, name))
        with open(os.path.join(path, name, MARKER), "w") as f:
            f.write(f"{FORMAT}\n{name}\n")
    except BaseException as e:
        if lock is not None:
            lock.release()
        if not isinstance(e, (OSError, HybridError)):
            raise
        if isinstance(e, HybridError):
            return str(e), [], None
        why = why_write_failed(e, path) or f"{e.strerror or e}; choose a writable directory"
        if os.path.isfile(os.path.join(path, "meta.json")):   # meta.json is replaced whole or not at all
            return f"cannot write checkpoint {path!r}: {why}; the previous version is still in force", [], None
        return f"cannot write a checkpoint to {path!r}: {why}", [], None
    return None, list(dict.fromkeys(history)), lock


def _model_info(module) -> dict:
    from ..model.presets import DecoderConfig
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
    from ..model.profile import names_by_param
    return [g for g in names_by_param(module).values() if len(g) > 1]


def _broadcast(obj, rank, group=None):
    box = [obj if rank == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0, group=group)
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


def _write_error(path: str, e: BaseException) -> str:
    why = why_write_failed(e, path)
    if why:
        return f"cannot write checkpoint {path!r}: {why}; the previous version is still in force"
    return (f"cannot write checkpoint {path!r}: {first_line(e)}; the previous version is still in force "
            "(free space, or save somewhere else)")


def save(wrapped, path: str, extra: dict | None = None, overwrite: bool = False, saver=None) -> str:
    """Write a new version of the checkpoint at `path` (collective: every rank calls it); one job
    at a time per directory (hybrid/ckpt/lock.py). With `saver` (hybrid/ckpt/background.py) the
    state is staged into host memory and written in the background: this returns once it is
    staged, and `saver.wait()` returns when the version is committed. Returns the version folder."""
    rank = dist.get_rank()
    path = os.path.abspath(path)
    name = f"data-{wrapped.step_count:08d}-{uuid.uuid4().hex[:8]}"
    error, history, lock = _prepare(path, name, overwrite) if rank == 0 else (None, [], None)
    try:
        name, error = _broadcast((name, error), rank)     # a refusal (the lock's owner...) is raised on every rank
        if error:
            raise HybridError(error)
        version = _Version(wrapped, path, name, history, extra, lock)
        state = wrapped.engine.checkpoint_state()
        _rank0_buffers(wrapped.module, state["model"])
        if saver is None:
            return version.write(state)
        saver.start(state, version)         # from here on the background commit releases the lock
        lock = None
        return version.data
    finally:
        if lock is not None:            # on success and on any failure; a killed writer leaves it stale
            lock.release()


class _Version:
    """One version being written: what it records (taken when the save starts, so an async save
    commits the state of that step) and the commit, with the directory's lock held by rank 0."""

    def __init__(self, wrapped, path: str, name: str, history: list[str], extra: dict | None, lock: DirLock | None):
        rank, world = dist.get_rank(), dist.get_world_size()
        self.path, self.name, self.history, self.lock = path, name, history, lock
        self.data = os.path.join(path, name)
        self.writer = CrcWriter(os.path.join(self.data, "dcp"))
        self.plain = {f"rng-{rank}.pt": plain_bytes(_rng_state())}
        self.meta = None
        if rank == 0:   # scheduler, loss scaler, step counts, tracked data state: plain data
            self.plain["loop.pt"] = plain_bytes(wrapped.loop_state())
            engine = wrapped.engine
            self.meta = {"format": FORMAT, "data": name, "step": wrapped.step_count, "world_size": world,
                         "strategy": wrapped.strategy.name, "family": wrapped.strategy.family,
                         "shard_size": wrapped.chosen.shard_size, "precision": wrapped.chosen.spec.precision,
                         "optimizer": type(engine.user_optimizer).__name__,
                         "model": _model_info(wrapped.module), "params": _param_table(wrapped.module),
                         "tied": _tied(wrapped.module), "extra": extra or {}, "history": [name, *history]}

    def write(self, state: dict, group=None) -> str:
        """DCP's save of `state`, then the plain files and the commit (collectives on `group`)."""
        import torch.distributed.checkpoint as dcp
        error = None
        try:
            dcp.save(state, storage_writer=self.writer, process_group=group)   # raises on every rank if one fails
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            error = _write_error(self.path, e)
        return self.commit(error, group)

    def commit(self, error: str | None, group=None) -> str:
        """The plain files, every rank's sizes and CRCs (hashed as they were written) gathered,
        meta.json replaced by rank 0 only once every rank's writes are complete, superseded versions
        removed. HybridError on every rank if any rank failed (the previous version stays)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        files, items = {}, {}
        if error is None:
            try:
                files = {f"dcp/{k}": v for k, v in self.writer.files.items()}
                items = {f"dcp/{k}": v for k, v in self.writer.items.items()}
                for rel, buf in self.plain.items():
                    files[rel] = write_bytes(self.data, rel, buf)
            except OSError as e:
                error = _write_error(self.path, e)
        gathered = [None] * world
        dist.all_gather_object(gathered, (error, files, items), group=group)
        errors = [g[0] for g in gathered if g[0]]
        if errors:
            if rank == 0:       # the unfinished version is ours: it was created by this call
                shutil.rmtree(self.data, ignore_errors=True)
            raise HybridError(errors[0])
        error = self._commit_on_rank0(gathered) if rank == 0 else None
        error = _broadcast(error, rank, group)
        if error:
            raise HybridError(error)
        return self.data

    def _commit_on_rank0(self, gathered) -> str | None:
        path, meta = self.path, dict(self.meta)
        meta["files"] = {k: v for _, fs, _ in gathered for k, v in fs.items()}
        meta["items"] = {k: v for _, _, its in gathered for k, v in its.items()}
        try:
            if not self.lock.held():     # taken over meanwhile (by a job that could not see this one): commit nothing
                raise HybridError(f"checkpoint directory {path!r}: another job took its lock over while this save "
                                  "ran (one that cannot see this process: another PID namespace?); this version was "
                                  "not committed: save one job at a time into a directory")
            _write_meta(path, meta)          # the commit
        except (OSError, HybridError) as e:
            shutil.rmtree(self.data, ignore_errors=True)
            return str(e) if isinstance(e, HybridError) else _write_error(path, e)
        for old in self.history:        # superseded versions this save can prove it wrote, after the switch
            if _provably_ours(path, old, self.history):
                shutil.rmtree(os.path.join(path, old), ignore_errors=True)
        return None


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




def _agreed(fn, *args):
    """fn(*args) on every rank; a HybridError on any rank is raised on all (no rank waits for a
    peer that gave up)."""
    result, error = None, None
    try:
        result = fn(*args)
    except HybridError as e:
        error = str(e)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - an I/O error, MemoryError or DCP's CheckpointException (a
        # BaseException) on one rank must not leave its peers waiting
        error = f"cannot read the checkpoint on rank {dist.get_rank()}: {first_line(e)}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if any(errors):
        raise HybridError(next(e for e in errors if e))
    return result


def _cause(e: BaseException):
    """The first rank's exception inside DCP's CheckpointException (or `e` itself)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        cause = sorted(failures.items())[0][1]
        return cause[0] if isinstance(cause, tuple) else cause
    return e


def load(wrapped, path: str) -> dict:
    """Restore model, optimizer, step and RNG from `path`, whatever strategy and world size wrote
    it (collective). Returns the checkpoint's meta.json (its `extra`: the dict given to save).
    Raises HybridError on a bad checkpoint on every rank alike, before anything of the job is
    changed; nothing on disk is changed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.abspath(path)
    engine = wrapped.engine
    mine = type(engine.user_optimizer).__name__

    def check_meta():
        meta = read_meta(path)
        check_model(meta, wrapped.module)
        if meta.get("optimizer", mine) != mine:
            raise HybridError(f"checkpoint {path!r} holds {meta['optimizer'][:40]} optimizer state and this "
                              f"job uses {mine}; build the same optimizer as the run that saved it")
        return meta

    meta = _agreed(check_meta)
    template = engine.checkpoint_template()         # collective on some engines: every rank, in step

    def check_data():
        if "items" not in meta:     # hashed per file only (hybrid before async saves): whole files checked first
            files = sorted(meta["files"])
            check_files(path, meta, [f for i, f in enumerate(files) if i % world == rank])
        r = reader(path, meta)
        if "items" not in meta:
            check_items(path, r, [f for i, f in enumerate(dcp_files(meta)) if i % world == rank])
        plan = plan_load(path, template, r.metadata)
        rng = f"rng-{rank}.pt"
        rng = read_plain(path, meta, rng, "RNG state") if meta["world_size"] == world and rng in meta["files"] \
            else None
        loop = read_plain(path, meta, "loop.pt", "training-loop state") if "loop.pt" in meta["files"] else None
        try:
            if rng is not None:
                check_rng(rng)
            if loop is not None:
                check_loop(wrapped, loop)
        except HybridError as e:
            raise HybridError(f"checkpoint {path!r}: {e}") from None
        return r, plan, rng, loop

    r, (to_load, fresh, notes), rng, loop = _agreed(check_data)
    try:        # each item read once, checked on those bytes, applied once every rank's reads succeeded
        dcp_load(to_load, r)
    except HybridError as e:
        raise HybridError(f"checkpoint {path!r}: {e}") from None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        cause = _cause(e)
        if isinstance(cause, HybridError):      # a damaged item: DCP raised it on every rank
            raise HybridError(f"checkpoint {path!r}: {cause}") from None
        raise HybridError(f"cannot load {path!r} into this job ({wrapped.strategy.name}, optimizer {mine}): "
                          f"{first_line(e)}; nothing of this job was changed: load again or restart") from None
    for top, values in fresh.items():
        to_load[top].update(values)
    engine.load_checkpoint_state(to_load)
    if rank == 0:
        for note in notes:
            log.info("%s", note)
    if rng is not None:
        _set_rng_state(rng)
    wrapped.step_count = meta["step"]
    if loop is not None:
        wrapped.load_loop_state(loop)
    dist.barrier()
    return meta
