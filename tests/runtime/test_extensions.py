"""DeepSpeed's extension cache: stale build locks cleared (ours) or named in one line, builds bounded."""
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest

from hybrid.errors import HybridError
from hybrid.runtime.extensions import extension_cache, ready

HOLD = "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); time.sleep(60)"


def _plant(root, op="deepspeed_shm_comm"):
    """A lock as torch's FileBaton leaves it when its build is killed: an empty file, no pid."""
    (root / op).mkdir(parents=True)
    lock = root / op / "lock"
    lock.write_bytes(b"")
    return lock


@pytest.mark.unit
def test_a_stale_lock_in_our_own_cache_is_cleared_in_one_line(tmp_path):
    env = {}
    root = extension_cache(env, prefix=str(tmp_path), base_prefix="/usr")
    assert root == f"{tmp_path}/torch_extensions"
    lock = _plant(tmp_path / "torch_extensions")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hybrid.runtime.extensions").addHandler(handler)
    try:
        start = time.monotonic()
        ready(root, own=True, timeout=30)
    finally:
        logging.getLogger("hybrid.runtime.extensions").removeHandler(handler)
    assert not lock.exists() and time.monotonic() - start < 5
    [line] = [r.getMessage() for r in records]
    assert line.startswith(f"cleared a stale DeepSpeed build lock {lock} ") and "\n" not in line


@pytest.mark.unit
def test_a_stale_lock_elsewhere_is_one_line_naming_it_and_the_fix_and_is_kept(tmp_path):
    lock = _plant(tmp_path / "py311_cpu")        # torch's per-user layout: <root>/<py>_<acc>/<op>/lock
    start = time.monotonic()
    with pytest.raises(HybridError, match=rf"stale DeepSpeed build lock {lock} .*remove it \(rm {lock}\)") as e:
        ready(str(tmp_path), own=False, timeout=30)
    assert time.monotonic() - start < 5 and "\n" not in str(e.value)
    assert lock.exists()


@pytest.mark.unit
def test_a_live_build_is_waited_for_within_its_bound_then_one_line(tmp_path):
    """A process holding the baton (as FileBaton.try_acquire does) is a live build: never cleared,
    waited for at most the bound."""
    (tmp_path / "deepspeed_shm_comm").mkdir()
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(HybridError, match=rf"build of deepspeed_shm_comm \(lock {lock}, pid {holder.pid}\) "
                                              r"has not finished within 1 s"):
            ready(str(tmp_path), own=True, timeout=1)
        assert 1 <= time.monotonic() - start < 5
        assert lock.exists()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.unit
def test_a_process_working_in_the_build_folder_is_a_live_build(tmp_path):
    """ninja and the compiler run in the op's folder; the lock is theirs until they end."""
    lock = _plant(tmp_path)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"], cwd=lock.parent)
    try:
        time.sleep(0.3)
        with pytest.raises(HybridError, match=f"pid {worker.pid}"):
            ready(str(tmp_path), own=True, timeout=0.5)
        assert lock.exists()
        worker.wait()
        ready(str(tmp_path), own=True, timeout=5)       # the worker ended without releasing: stale now
        assert not lock.exists()
    finally:
        worker.kill()


@pytest.mark.torch
def test_our_backend_reports_a_stale_lock_in_a_few_seconds_instead_of_waiting_forever(tmp_path):
    """Before the check, deepspeed.comm's shm op build spun in FileBaton.wait on this lock forever."""
    lock = _plant(tmp_path)
    script = textwrap.dedent("""
        from hybrid.runtime.mesh import init_distributed, shutdown
        from hybrid.runtime.backends.deepspeed import _deepspeed
        init_distributed()
        try:
            _deepspeed()
        finally:
            shutdown()
    """)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu"}
    env.pop("WORLD_SIZE", None)
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert f"HybridError: stale DeepSpeed build lock {lock} (" in last, out.stderr[-2000:]
    assert f"rm {lock}" in last and lock.exists()
    assert elapsed < 60, elapsed


@pytest.mark.torch
def test_an_op_build_past_its_bound_is_killed_and_fails_in_one_line(tmp_path, monkeypatch):
    """A 2 s bound on an empty cache: the build (a minute) is stopped, its lock not left behind."""
    from hybrid.runtime.extensions import build_op
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(HybridError, match=r"deepspeed_shm_comm op build did not finish within 2 s \(killed\)"):
        build_op(str(tmp_path), timeout=2)
    assert time.monotonic() - start < 10
    assert not list(tmp_path.glob("*/lock"))


WRITABLE_VENV = sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK)


@pytest.mark.unit
@pytest.mark.skipif(not WRITABLE_VENV, reason="torch's per-user cache is in effect outside a writable venv")
def test_the_test_processes_build_in_this_environments_cache():
    """Set by tests/conftest.py, so tests that start deepspeed or the HF Trainer themselves inherit it."""
    from hybrid.runtime.extensions import own_cache
    assert os.environ["TORCH_EXTENSIONS_DIR"] == own_cache()


def _cache_in_rank():
    return os.environ.get("TORCH_EXTENSIONS_DIR")


@pytest.mark.torch
@pytest.mark.skipif(not WRITABLE_VENV, reason="torch's per-user cache is in effect outside a writable venv")
def test_ranks_run_ranks_starts_build_in_this_environments_cache(monkeypatch):
    """A rank that calls deepspeed itself (not through our backend) still builds in <venv>/torch_extensions."""
    from hybrid.runtime.extensions import own_cache
    from hybrid.runtime.launch import run_ranks
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert run_ranks(1, _cache_in_rank) == [own_cache()]
    assert "TORCH_EXTENSIONS_DIR" not in os.environ        # the caller's environment is left as it was
