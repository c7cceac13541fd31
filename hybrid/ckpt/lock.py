"""One writer per checkpoint directory: a lock file naming its owner (host, pid).

`.hybrid-lock` is created with O_CREAT|O_EXCL (atomic on local file systems and NFSv3+) and holds
one JSON line: host, pid, the process's start time (Linux: /proc/<pid>/stat, so a reused pid is not
taken for the owner), its PID namespace and a random token. A lock whose owner is on this host, in
this PID namespace, and no longer runs is stale: the next writer takes it over with a log line.
Taking over is itself exclusive: the breaker first creates `.hybrid-lock.break-<token of the stale
lock>` with O_EXCL, so two writers that find the same stale lock cannot remove a fresh one. A live
owner, or one on another host or in another PID namespace (a container: its liveness cannot be
proven from here), is a one-line refusal naming it and the fix. Nothing waits longer than
`GRACE_S`. No torch here.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid

from ..errors import HybridError, short
from ..log import get_logger

log = get_logger(__name__)

LOCK = ".hybrid-lock"
BREAK = re.compile(r"\.hybrid-lock\.break-[0-9a-f]{32}")
"""The files of a lock take-over (see the module docstring)."""
GRACE_S = 2.0
"""Seconds a lock file may stay empty or partly written (its writer between create and write)."""
_LIMIT = 4096
"""Largest lock file read (bytes): one JSON line of host, pid, start time and token."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc/<pid>/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(_LIMIT).decode("ascii", "replace")
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_namespace() -> str | None:
    """This process's PID namespace (Linux /proc/self/ns/pid), or None."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _alive(pid: int, start: str | None) -> bool:
    """Whether process `pid` of this host runs and (where its start time is known) is the same process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass                        # it exists, under another user
    now = _start_time(pid)
    return start is None or now is None or now == start


def _read(path: str) -> dict | None:
    """The lock's owner, or None while its file is missing; HybridError if it is not a lock we write."""
    deadline = time.monotonic() + GRACE_S
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise HybridError(f"cannot read the checkpoint lock {path!r}: {e.strerror}; if no save is running "
                              "there, remove it") from None
        try:
            raw = os.read(fd, _LIMIT + 1)
        finally:
            os.close(fd)
        try:
            owner = json.loads(raw)
            if isinstance(owner, dict) and isinstance(owner.get("host"), str) and isinstance(owner.get("pid"), int) \
                    and isinstance(owner.get("token"), str) and re.fullmatch(r"[0-9a-f]{32}", owner["token"]):
                return owner
        except ValueError:
            pass
        if time.monotonic() > deadline:      # not a half-written lock: not one we can reason about
            raise HybridError(f"{path!r} is not a lock hybrid writes (host, pid): {short(raw[:60])}; if no save "
                              "is running in that directory, remove it")
        time.sleep(0.05)


class DirLock:
    """The one-writer lock of a checkpoint directory, held by this process until `release`."""

    def __init__(self, directory: str, token: str):
        self.path = os.path.join(directory, LOCK)
        self.token = token

    @classmethod
    def acquire(cls, directory: str) -> DirLock:
        """Take the lock of `directory` or raise HybridError naming its live owner; at most a few
        attempts (one per stale lock taken over), each bounded by GRACE_S."""
        path = os.path.join(directory, LOCK)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()),
              "ns": _pid_namespace(), "token": uuid.uuid4().hex}
        for _ in range(4):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                owner = _read(path)
                if owner is not None:
                    _take_over_or_refuse(directory, path, owner, me["host"])
                continue
            try:
                os.write(fd, (json.dumps(me) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            return cls(directory, me["token"])
        raise HybridError(f"could not take the checkpoint lock {path!r}: other saves keep taking it; save one job "
                          "at a time into a directory")

    def held(self) -> bool:
        """Whether the lock file still holds this lock's token (no other writer took it over)."""
        try:
            owner = _read(self.path)
        except HybridError:
            return False
        return owner is not None and owner["token"] == self.token

    def release(self) -> None:
        """Remove the lock if it is still ours (a lock another writer holds is never removed)."""
        try:
            owner = _read(self.path)
        except HybridError as e:
            log.warning("not removing the checkpoint lock: %s", e)
            return
        if owner is not None and owner["token"] == self.token:
            try:
                os.unlink(self.path)
            except OSError as e:
                log.warning("cannot remove the checkpoint lock %s: %s", self.path, e.strerror)
        else:
            log.warning("the checkpoint lock %s was no longer this save's; left as it is", self.path)


def _take_over_or_refuse(directory: str, path: str, owner: dict, host: str) -> None:
    """Remove a stale lock (its owner on this host, gone), exclusively; HybridError for a live one."""
    who = f"host {short(owner['host'], 60)}, pid {owner['pid']}"
    ns = _pid_namespace()
    if owner["host"] != host or (isinstance(owner.get("ns"), str) and ns is not None and owner["ns"] != ns):
        raise HybridError(f"checkpoint directory {directory!r} is being saved by another job ({who}); "
                          f"save there when it has finished, or elsewhere (if that job is gone, remove {path!r})")
    start = owner.get("start") if isinstance(owner.get("start"), str) else None
    if _alive(owner["pid"], start):
        raise HybridError(f"checkpoint directory {directory!r} is being saved by another job ({who}); "
                          "save there when it has finished, or save elsewhere: one job writes a directory at a time")
    breaker = os.path.join(directory, f"{LOCK}.break-{owner['token']}")
    try:
        fd = os.open(breaker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:       # another writer is taking this stale lock over: wait for it, bounded
        deadline = time.monotonic() + GRACE_S
        while os.path.lexists(breaker) and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.path.lexists(breaker) and (_read(path) or {}).get("token") == owner["token"]:
            raise HybridError(f"{breaker!r} is left by a save that died while taking over a stale lock; if no "
                              "save is running in that directory, remove it and the lock") from None
        return
    os.close(fd)
    try:
        current = _read(path)
        if current is not None and current["token"] == owner["token"]:     # only the breaker may remove it now
            os.unlink(path)
            log.info("checkpoint lock %s: its owner (%s) is gone; taking it over", path, who)
    finally:
        os.unlink(breaker)
