"""A failed write as one line: the full disk (its mount point and what is free), the quota, the
file-size limit.

torch.save reports a full disk as `[enforce fail at inline_container.cc:...] . PytorchStreamWriter
failed writing file ...` with no errno (torch 2.13); DCP wraps each rank's OSError in a
CheckpointException. Where no errno says why, the file system's free space (os.statvfs) does. No torch here.
"""
from __future__ import annotations

import errno
import os

from ..units import fmt_bytes

FULL_BELOW = 16 << 20
"""Free bytes under which a write that failed without an errno is taken for a full disk."""
_WRITING = ("write", "inline_container", "serializ")
"""Words of a failed write's message where it has no errno (torch.save, DCP, safetensors)."""


def causes(e: BaseException):
    """e, the first cause DCP's CheckpointException carries, and their __cause__/__context__ chains."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict) and failures:
            cause = sorted(failures.items(), key=lambda kv: str(kv[0]))[0][1]
            todo.append(cause[0] if isinstance(cause, tuple) else cause)
        todo += [x.__cause__, x.__context__]


def mount_of(path: str) -> str:
    """The mount point holding `path` (its nearest existing ancestor)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def _free(path: str) -> tuple[int, int] | None:
    try:
        st = os.statvfs(mount_of(path))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def why_write_failed(e: BaseException, path: str) -> str | None:
    """'no space left on the disk ...; free space there ...' where `e` is a full disk, a quota or a
    file-size limit for a write below `path`; None for any other failure."""
    codes = {x.errno for x in causes(e) if isinstance(x, OSError)}
    free = _free(path)
    where = mount_of(path)
    if errno.EDQUOT in codes:
        return f"the disk quota on {where!r} is exhausted; free space within your quota, or save somewhere else"
    if errno.EFBIG in codes:
        return ("a file would pass the file-size limit (`ulimit -f`, or the file system's largest file); raise "
                "the limit, or save somewhere else")
    if errno.ENOSPC in codes or (not codes and free is not None and free[0] < FULL_BELOW and any(
            w in str(x).lower() for x in causes(e) for w in _WRITING)):
        left = f" ({fmt_bytes(free[0])} free of {fmt_bytes(free[1])})" if free else ""
        return f"the disk holding it is full: no space left on {where!r}{left}; free space there, or save " \
               "somewhere else"
    return None
