"""DeepSpeed's extension cache: which one, its build locks judged before a build waits on them, the build bounded.

torch.utils.cpp_extension (torch 2.13, `_jit_compile`) takes a FileBaton, `<cache>/<op>/lock`,
before it builds or even loads a JIT op: `try_acquire` creates the file (O_CREAT | O_EXCL) and keeps
it open until `release` removes it; every other process spins in `FileBaton.wait` while the file
exists, with no bound and no message. The baton records no pid, so a build killed in between leaves
a lock every later run waits on forever. torch-free (the tests' conftest uses it).
"""
from __future__ import annotations

import glob
import logging
import os
import signal
import subprocess
import sys
import time

from ..errors import HybridError
from ..units import env_seconds

log = logging.getLogger(__name__)     # not log.get_logger: the test conftest imports this before pytest's log capture

BUILD_TIMEOUT_S = 600.0
"""Seconds a build of one op (or a wait on another process's build) may take: HYBRID_BUILD_TIMEOUT
overrides it. DeepSpeed's CPU comm op takes about a minute on 2 cores."""

SHM_OP = "deepspeed_shm_comm"
"""The op DeepSpeed's CPU accelerator JIT-builds when its communication starts (DeepSpeed 0.19, deepspeed.comm.torch
build_shm_op, ShareMemCommBuilder)."""


def extension_cache(environ=None, prefix: str = sys.prefix, base_prefix: str = sys.base_prefix) -> str | None:
    """Where DeepSpeed's JIT-built ops go. torch.utils.cpp_extension builds into TORCH_EXTENSIONS_DIR,
    else one per-user directory (_get_build_directory; get_default_build_root:
    ~/.cache/torch_extensions) that every environment shares, so an op built by another venv's
    torch is rebuilt (about a minute) on each switch. Inside a virtual environment, unless the
    user set it, the cache is the environment's own, <venv>/torch_extensions (as setup.sh builds
    it). Returns the directory in effect (None: torch's default).

    `environ` is the mapping read and set; None is this process's environment about to start
    DeepSpeed (our backend calls it so), and the cache is then made ready too (`ready`)."""
    now = environ is None
    environ = os.environ if now else environ
    if "TORCH_EXTENSIONS_DIR" not in environ and prefix != base_prefix and os.access(prefix, os.W_OK):
        environ["TORCH_EXTENSIONS_DIR"] = own_cache(prefix)
    root = environ.get("TORCH_EXTENSIONS_DIR")
    if now:
        ready(root or default_root(environ), own=is_own(root, prefix), timeout=build_timeout(environ))
        if environ.get("DS_ACCELERATOR") == "cpu":
            build_op(root or default_root(environ), timeout=build_timeout(environ))
    return root


def own_cache(prefix: str = sys.prefix) -> str:
    """The environment's own cache, <venv>/torch_extensions: its locks are ours to clear."""
    return os.path.join(prefix, "torch_extensions")


def is_own(root: str | None, prefix: str = sys.prefix) -> bool:
    """Whether `root` is the environment's own cache."""
    return root is not None and os.path.realpath(root) == os.path.realpath(own_cache(prefix))


def default_root(environ=os.environ) -> str:
    """torch's per-user cache (get_default_build_root: appdirs' user cache dir, ~/.cache on Linux);
    its ops sit one folder down, in <py>_<accelerator>."""
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.realpath(os.path.join(cache, "torch_extensions"))


def build_timeout(environ=os.environ) -> float:
    """BUILD_TIMEOUT_S, or HYBRID_BUILD_TIMEOUT seconds."""
    return env_seconds(environ, "HYBRID_BUILD_TIMEOUT", BUILD_TIMEOUT_S, "600")


def locks(root: str) -> list[str]:
    """The build locks under a cache: <root>/<op>/lock, and <root>/<py>_<acc>/<op>/lock (torch's default)."""
    return sorted(glob.glob(os.path.join(glob.escape(root), "*", "lock"))
                  + glob.glob(os.path.join(glob.escape(root), "*", "*", "lock")))


BUILDERS = ("python", "ninja", "c++", "g++", "gcc", "cc", "cc1plus", "clang", "clang++", "nvcc", "ld", "hipcc")
"""Command names (/proc/<pid>/comm, up to a version suffix) of what can take a baton or build: a
process we cannot inspect that runs none of them (init, another user's shell) is no builder."""


def _may_build(base: str) -> bool:
    try:
        with open(f"{base}/comm", encoding="utf-8") as f:
            comm = f.read().strip()
    except OSError:
        return True
    return comm.rstrip("0123456789.-") in BUILDERS


def holders(lock: str) -> tuple[list[int], bool]:
    """Processes that hold `lock` open (the baton's owner keeps its fd) or work in its build folder
    (ninja and the compiler run there), from /proc; and whether every process that may build could
    be inspected (another user's cannot; without /proc none can)."""
    try:
        st = os.stat(lock)
    except FileNotFoundError:
        return [], True
    folder = os.path.dirname(os.path.realpath(lock))
    if not os.path.isdir("/proc/self/fd"):
        return [], False
    found, complete = [], True
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        base = f"/proc/{pid}"
        try:
            cwd = os.readlink(f"{base}/cwd")
            fds = os.listdir(f"{base}/fd")
        except FileNotFoundError:
            continue            # exited meanwhile
        except PermissionError:
            complete = complete and not _may_build(base)
            continue
        if cwd == folder or cwd.startswith(folder + os.sep):
            found.append(int(pid))
            continue
        for fd in fds:
            try:
                f = os.stat(f"{base}/fd/{fd}")
            except OSError:
                continue
            if (f.st_dev, f.st_ino) == (st.st_dev, st.st_ino):
                found.append(int(pid))
                break
    return found, complete


def ready(root: str, own: bool, timeout: float = BUILD_TIMEOUT_S, poll_s: float = 0.2) -> None:
    """Judge each build lock under `root` before DeepSpeed's op builder waits on it. A lock with no
    live builder (no process holds it or works in its folder; where some processes cannot be seen,
    also older than `timeout`) is stale: cleared in our own cache (one WARNING line), else a
    HybridError naming the file and the fix. A live build is waited for at most `timeout` seconds."""
    for lock in locks(root):
        op = os.path.basename(os.path.dirname(lock))
        deadline = time.monotonic() + timeout
        while True:
            pids, complete = holders(lock)
            try:
                age = time.time() - os.stat(lock).st_mtime
            except FileNotFoundError:
                break               # the build finished
            if not pids and (complete or age > timeout):
                if own:
                    _remove(lock)
                    log.warning("cleared a stale DeepSpeed build lock %s (%.0f s old, no process building "
                                "%s): an earlier build was interrupted", lock, age, op)
                    break
                raise HybridError(f"stale DeepSpeed build lock {lock} ({age:.0f} s old, no process building {op}): "
                                  f"an earlier build was interrupted and every DeepSpeed run would wait on it; "
                                  f"remove it (rm {lock}) and run again")
            if pids and time.monotonic() > deadline:
                raise HybridError(f"DeepSpeed's build of {op} (lock {lock}, pid {', '.join(map(str, pids))}) has "
                                  f"not finished within {timeout:g} s: stop that process and remove the lock "
                                  "(HYBRID_BUILD_TIMEOUT sets the bound)")
            time.sleep(poll_s)


def _remove(lock: str) -> None:
    try:
        os.remove(lock)
    except FileNotFoundError:
        pass


_BUILD = """
from deepspeed.accelerator import get_accelerator
import deepspeed.ops
b = get_accelerator().create_op_builder("ShareMemCommBuilder")
if b is not None and deepspeed.ops.__compatible_ops__.get(b.NAME, False):
    b.load(verbose=False)
"""


def built(root: str, op: str = SHM_OP) -> bool:
    """Whether the op's library is in the cache (torch still takes its baton to load it: a quick ninja no-op)."""
    return bool(glob.glob(os.path.join(glob.escape(root), op, f"{op}*.so"))
                or glob.glob(os.path.join(glob.escape(root), "*", op, f"{op}*.so")))


_TRIED: set[str] = set()


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` (the build child started one): ninja runs each compile
    in a process group of its own, which killpg of the child's group does not reach; they stay in
    its session. /proc/PID/stat's sixth field is the session id."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in (p for p in os.listdir("/proc") if p.isdigit()) if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue            # exited meanwhile, or not ours to kill


def build_op(root: str, timeout: float = BUILD_TIMEOUT_S) -> None:
    """Build DeepSpeed's CPU comm op in a child process bounded by `timeout` seconds, if it is not
    built yet, so that no rank builds it unbounded inside deepspeed.comm.init_distributed; the child
    inherits TORCH_EXTENSIONS_DIR, so `root` is where it is in effect. A build past the bound is
    killed (its lock, which our child wrote, removed) and fails in one line."""
    if built(root) or root in _TRIED:
        return
    log.info("building DeepSpeed's %s op into %s (about a minute, once)", SHM_OP, root)
    child = subprocess.Popen([sys.executable, "-c", _BUILD], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)
    try:
        _, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(child.pid)
        child.wait()
        deadline = time.monotonic() + 2.0       # the killed group's compilers may take a moment to exit
        for lock in locks(root):
            if os.path.basename(os.path.dirname(lock)) != SHM_OP:
                continue
            while holders(lock)[0] and time.monotonic() < deadline:
                time.sleep(0.05)
            if not holders(lock)[0]:
                _remove(lock)
        raise HybridError(f"DeepSpeed's {SHM_OP} op build did not finish within {timeout:g} s (killed); "
                          f"build it once with setup.sh, or raise HYBRID_BUILD_TIMEOUT") from None
    if child.returncode:
        last = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1][:300]
        raise HybridError(f"DeepSpeed's {SHM_OP} op build into {root} failed (exit {child.returncode}): {last}")
    _TRIED.add(root)            # an op DeepSpeed finds incompatible here (no compiler) is never built: try once
