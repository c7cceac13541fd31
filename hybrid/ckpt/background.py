"""Async saves: the state staged into host memory by DCP's stager, written and committed in the
background, so that training goes on while the files are written.

`AsyncSaver.start` runs on the training thread: it stages (DCP's DefaultStager: a copy of every
tensor into host memory, kept and reused by the next save), checks that every rank staged, and
hands the staged state to `torch.distributed.checkpoint.async_save`. One thread per process then
waits for DCP's upload and commits the version (hybrid/ckpt/store.py `_Version.commit`): the same
commit as a synchronous save, meta.json replaced by rank 0 only after every rank's writes
completed, so a rank killed meanwhile leaves the previous version in force. The background
collectives run on a gloo group of their own (`_group`), never on the one training uses.
`wait` bounds the wait by HYBRID_CKPT_TIMEOUT seconds (default 1800), also the background
group's collective timeout; hybrid.runtime.mesh.shutdown waits for every save in flight.
"""
from __future__ import annotations

import datetime
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import torch.distributed as dist

from ..errors import HybridError
from ..units import env_seconds

_STATE: dict = {"group": None, "world": None, "executor": None}
_IN_FLIGHT: set = set()
_LOCK = threading.Lock()


def wait_timeout() -> float:
    """Seconds a save may take in the background (HYBRID_CKPT_TIMEOUT, default 1800)."""
    return env_seconds(os.environ, "HYBRID_CKPT_TIMEOUT", 1800.0, "3600")


def _group():
    """The gloo group of the background saves (created on every rank by the first async save)."""
    world = dist.group.WORLD
    if _STATE["group"] is None or _STATE["world"] is not world:
        _STATE["group"] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=wait_timeout()))
        _STATE["world"] = world
    return _STATE["group"]


def _executor() -> ThreadPoolExecutor:
    if _STATE["executor"] is None:
        _STATE["executor"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid-ckpt-commit")
    return _STATE["executor"]


def _stager():
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    # pinned host buffers where a GPU copies into them; synchronous staging: start() returns once copied
    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


def _staged_as_is():
    """An AsyncStager for async_save that hands on the state it is given: it is staged already."""
    from torch.distributed.checkpoint.staging import AsyncStager

    class Staged(AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict):
            return state_dict

        def synchronize_staging(self) -> None:
            pass

    return Staged()


class AsyncSaver:
    """One Wrapped's background saves: the stager (its host buffers reused save after save) and
    the save in flight (at most one: `start` is called after `wait`)."""

    def __init__(self):
        self.stager = None
        self.future: Future | None = None
        self.what = ""

    def start(self, state: dict, version) -> None:
        """Stage `state` (collective), start DCP's async save of it, and commit in the background.
        Returns once the staging copy is made on every rank."""
        import torch.distributed.checkpoint as dcp
        from .folder import first_line
        if self.future is not None:
            raise HybridError("an async save is still in flight: wait for it (w.wait_for_checkpoint()) first")
        group = _group()
        error = None
        try:
            if self.stager is None:
                self.stager = _stager()
            staged = self.stager.stage(state)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - a host out of memory on one rank is an error on all
            error = (f"cannot stage checkpoint {version.path!r} in host memory on rank {dist.get_rank()}: "
                     f"{first_line(e)}; the previous version is still in force")
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        if any(errors):
            if version.lock is not None:
                import shutil
                shutil.rmtree(version.data, ignore_errors=True)
            raise HybridError(next(e for e in errors if e))
        upload = dcp.async_save(staged, storage_writer=version.writer, process_group=group,
                                async_stager=_staged_as_is())
        self.what = f"the async save of {version.data!r}"
        self.future = _executor().submit(_finish, upload, version, group)
        with _LOCK:
            _IN_FLIGHT.add(self)

    def wait(self, timeout: float | None = None) -> str | None:
        """Wait (at most `timeout` s, default HYBRID_CKPT_TIMEOUT) for the save in flight to be
        committed; its version folder, or None when none was in flight. HybridError (the same on
        every rank) if it failed, or one line if it did not finish in time."""
        future = self.future
        if future is None:
            return None
        limit = wait_timeout() if timeout is None else timeout
        try:
            return future.result(timeout=limit)
        except FutureTimeout:
            raise HybridError(f"{self.what} has not finished after {limit:g} s (HYBRID_CKPT_TIMEOUT); the previous "
                              "version is still in force: give it longer, or save to faster storage") from None
        finally:
            if future.done():
                self.future = None
                with _LOCK:
                    _IN_FLIGHT.discard(self)

    def close(self, timeout: float | None = None) -> None:
        """Wait for the save in flight, then free the staging buffers."""
        try:
            self.wait(timeout)
        finally:
            if self.stager is not None and self.future is None:
                self.stager.close()
                self.stager = None


def _finish(upload: Future, version, group) -> str:
    """Background: DCP's upload, then the commit; the directory's lock released at the end."""
    from .store import _write_error
    try:
        error = None
        try:
            upload.result(timeout=wait_timeout())
        except FutureTimeout:
            error = f"cannot write checkpoint {version.path!r}: DCP's upload did not finish in {wait_timeout():g} s"
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            error = _write_error(version.path, e)
        return version.commit(error, group)
    finally:
        if version.lock is not None:
            version.lock.release()


def wait_all(timeout: float | None = None) -> None:
    """Wait for every async save in flight in this process (shutdown calls it)."""
    with _LOCK:
        savers = list(_IN_FLIGHT)
    for saver in savers:
        saver.wait(timeout)
