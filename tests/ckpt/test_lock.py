"""The one-writer lock of a checkpoint directory (hybrid/ckpt/lock.py): no torch."""
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from hybrid.ckpt.lock import GRACE_S, LOCK, DirLock, _start_time
from hybrid.errors import HybridError

pytestmark = pytest.mark.unit


def _plant(d, **owner):
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()),
             "token": "ab" * 16, **owner}
    (d / LOCK).write_text(json.dumps(owner))
    return owner


def _gone_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_held_lock_refuses_a_second_writer_and_release_leaves_nothing(tmp_path):
    lock = DirLock.acquire(str(tmp_path))
    owner = json.loads((tmp_path / LOCK).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    with pytest.raises(HybridError, match=rf"being saved by another job \(host {socket.gethostname()!r}, "
                                          rf"pid {os.getpid()}\); save there when it has finished"):
        DirLock.acquire(str(tmp_path))
    lock.release()
    assert os.listdir(tmp_path) == []


def test_a_lock_of_another_host_is_refused_naming_it_and_the_fix(tmp_path):
    _plant(tmp_path, host="node-7", pid=4242)
    with pytest.raises(HybridError, match=r"another job \(host 'node-7', pid 4242\).*if that job is gone, remove"):
        DirLock.acquire(str(tmp_path))
    assert json.loads((tmp_path / LOCK).read_text())["host"] == "node-7"     # left as it is


@pytest.mark.parametrize("how", ["pid gone", "pid reused"])
def test_a_stale_lock_of_this_host_is_taken_over_with_a_log_line(tmp_path, caplog, how):
    if how == "pid gone":
        _plant(tmp_path, pid=_gone_pid())
    else:           # our own pid, but the process that wrote the lock started at another time
        if _start_time(os.getpid()) is None:
            pytest.skip("no /proc/<pid>/stat here")
        _plant(tmp_path, start="1")
    with caplog.at_level(logging.INFO, logger="hybrid.ckpt.lock"):
        lock = DirLock.acquire(str(tmp_path))
    assert any("is gone; taking it over" in r.getMessage() for r in caplog.records), caplog.text
    assert json.loads((tmp_path / LOCK).read_text())["token"] == lock.token
    lock.release()
    assert os.listdir(tmp_path) == []


def test_many_writers_taking_over_one_stale_lock_leave_exactly_one_owner(tmp_path):
    _plant(tmp_path, pid=_gone_pid())
    won, refused = [], []
    start = threading.Barrier(8)

    def writer():
        start.wait()
        try:
            won.append(DirLock.acquire(str(tmp_path)))
        except HybridError as e:
            refused.append(str(e))
    threads = [threading.Thread(target=writer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(won) == 1 and len(refused) == 7, (won, refused)
    assert all("being saved by another job" in m for m in refused), refused
    assert json.loads((tmp_path / LOCK).read_text())["token"] == won[0].token
    assert sorted(os.listdir(tmp_path)) == [LOCK]           # no take-over file left


def test_a_lock_file_we_did_not_write_is_one_line_within_the_grace(tmp_path):
    (tmp_path / LOCK).write_text("not json")
    t = time.monotonic()
    with pytest.raises(HybridError, match="is not a lock hybrid writes.*if no save is running in that directory"):
        DirLock.acquire(str(tmp_path))
    assert time.monotonic() - t < GRACE_S + 2
    assert (tmp_path / LOCK).read_text() == "not json"


def test_release_never_removes_a_lock_that_is_no_longer_ours(tmp_path, caplog):
    lock = DirLock.acquire(str(tmp_path))
    other = _plant(tmp_path, host="node-7", token="cd" * 16)
    with caplog.at_level(logging.WARNING, logger="hybrid.ckpt.lock"):
        lock.release()
    assert json.loads((tmp_path / LOCK).read_text()) == other
    assert "no longer this save's" in caplog.text


def test_a_lock_of_another_pid_namespace_is_never_taken_for_stale(tmp_path):
    from hybrid.ckpt.lock import _pid_namespace
    if _pid_namespace() is None:
        pytest.skip("no /proc/self/ns/pid here")
    pid = _gone_pid()           # gone here; in another namespace (a container) the same number may be alive
    _plant(tmp_path, pid=pid, ns="pid:[1]")
    with pytest.raises(HybridError, match=rf"another job \(host .*, pid {pid}\).*if that job is gone, remove"):
        DirLock.acquire(str(tmp_path))
