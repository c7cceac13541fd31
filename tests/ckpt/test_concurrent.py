"""Saves that cannot step on each other: one writer per checkpoint directory (hybrid/ckpt/lock.py)."""
import json
import logging
import os
import random
import signal
import socket
import threading
import time

import pytest

from hybrid.errors import HybridError
from hybrid.runtime.launch import run_ranks
from tests.ckpt.test_checkpoint import load_bad
from tests.test_safety import _train, _wrap

pytestmark = pytest.mark.gloo


def _wait_for(path, seconds=300):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def save_paused(path, gate):
    """A first version, then a second save that stops (lock held, its data written, not yet committed)
    until `gate`.go exists; `gate`.held holds this rank's pid meanwhile."""
    import hybrid.ckpt.store as store
    w = _wrap("ddp")
    _train(w)
    w.save(path)
    real = store._Version.commit

    def pause(self, *args):
        with open(gate + ".part", "w") as f:
            f.write(str(os.getpid()))
        os.replace(gate + ".part", gate + ".held")
        _wait_for(gate + ".go", 120)
        return real(self, *args)
    store._Version.commit = pause
    try:
        w.save(path)
    finally:
        store._Version.commit = real
    return os.getpid()


def save_once(path):
    """This rank's error line (None: saved) and the hybrid.ckpt.lock log lines of the save."""
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    handler = Keep()
    logging.getLogger("hybrid.ckpt.lock").addHandler(handler)
    w = _wrap("ddp")
    _train(w)
    try:
        w.save(path)
    except HybridError as e:
        return str(e), lines
    finally:
        logging.getLogger("hybrid.ckpt.lock").removeHandler(handler)
    return None, lines


def _versions(path):
    return sorted(e for e in os.listdir(path) if e.startswith("data-"))


def _meta(path):
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def _start_paused(path, gate):
    box = {}

    def run():
        try:
            box["a"] = run_ranks(1, save_paused, path, gate)[0]
        except BaseException as e:  # noqa: BLE001 - a killed writer is reported to the test
            box["a_error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    _wait_for(gate + ".held")
    with open(gate + ".held") as f:
        return t, box, int(f.read())


def test_a_save_while_another_job_holds_the_directory_is_refused_in_one_line(tmp_path):
    path, gate = str(tmp_path / "c"), str(tmp_path / "gate")
    t, box, pid = _start_paused(path, gate)
    held = _meta(path)["history"]            # A recorded its version before creating it
    b = run_ranks(2, save_once, path)        # B starts while A holds the directory
    open(gate + ".go", "w").close()
    t.join(300)
    assert "a" in box, box
    (msg0, _), (msg1, _) = b
    assert msg0 is not None and msg0 == msg1 and "\n" not in msg0, b      # every rank, the same one line
    assert f"host {socket.gethostname()!r}, pid {pid}" in msg0 and "being saved by another job" in msg0, msg0
    assert "save there when it has finished, or save elsewhere" in msg0, msg0
    meta = _meta(path)
    assert meta["data"] == held[-1] and _versions(path) == [meta["data"]]     # A's version, nothing orphaned
    assert not os.path.exists(os.path.join(path, ".hybrid-lock"))
    assert run_ranks(1, load_bad, path)[0] is None


def test_a_killed_writer_leaves_a_stale_lock_the_next_save_takes_over(tmp_path):
    path, gate = str(tmp_path / "c"), str(tmp_path / "gate")
    t, box, pid = _start_paused(path, gate)
    killed = _meta(path)["history"][-1]
    os.kill(pid, signal.SIGKILL)
    t.join(300)
    assert "a_error" in box and os.path.exists(os.path.join(path, ".hybrid-lock"))
    assert os.path.isdir(os.path.join(path, killed))
    msg, lines = run_ranks(1, save_once, path)[0]
    assert msg is None, msg
    assert any(f"pid {pid}" in ln and "is gone; taking it over" in ln for ln in lines), lines
    meta = _meta(path)
    assert _versions(path) == [meta["data"]] and killed not in os.listdir(path)     # the dead save's folder reclaimed
    assert not [e for e in os.listdir(path) if e.startswith(".hybrid-lock")]
    assert run_ranks(1, load_bad, path)[0] is None


def save_loop(path, ready, n, seconds, seed):
    """Save repeatedly for `seconds` once `n` writers are ready; (saves that succeeded, refusals)."""
    rng = random.Random(seed)
    w = _wrap("ddp")
    _train(w)
    open(f"{ready}.{seed}", "w").close()
    deadline = time.monotonic() + 120
    while len([f for f in os.listdir(os.path.dirname(ready)) if f.startswith(os.path.basename(ready) + ".")]) < n:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ok, refused = 0, []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        time.sleep(rng.uniform(0, 0.02))
        try:
            w.save(path)
            ok += 1
        except HybridError as e:
            refused.append(str(e))
    return ok, refused


WRITERS, SECONDS = 3, 8


def test_random_concurrent_saves_leave_one_loadable_checkpoint_and_nothing_orphaned(tmp_path):
    path, ready = str(tmp_path / "c"), str(tmp_path / "ready")
    results = [None] * WRITERS

    def run(i):
        results[i] = run_ranks(1, save_loop, path, ready, WRITERS, SECONDS, i)[0]
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert all(results), results
    oks = sum(ok for ok, _ in results)
    refusals = [m for _, ms in results for m in ms]
    assert oks >= 1 and refusals, (oks, len(refusals))        # they did contend
    for m in refusals:
        assert "\n" not in m and "being saved by another job (host " in m, m
    meta = _meta(path)
    assert _versions(path) == [meta["data"]], (_versions(path), meta["data"])     # nothing orphaned
    assert not [e for e in os.listdir(path) if e.startswith((".hybrid-lock", ".meta.json."))], os.listdir(path)
    assert run_ranks(1, load_bad, path)[0] is None


def save_losing_the_lock(path):
    """A first version, then a save whose lock another job (one that could not see this process)
    takes over before the commit; its one-line error."""
    import hybrid.ckpt.store as store
    w = _wrap("ddp")
    _train(w)
    w.save(path)
    real = store._Version.commit

    def taken_over(self, *args):
        lock = os.path.join(path, ".hybrid-lock")
        with open(lock) as f:
            owner = json.load(f)
        with open(lock, "w") as f:
            json.dump(dict(owner, host="node-7", pid=4242, token="cd" * 16), f)
        return real(self, *args)
    store._Version.commit = taken_over
    try:
        w.save(path)
    except HybridError as e:
        return str(e)
    finally:
        store._Version.commit = real


def test_a_save_whose_lock_was_taken_over_commits_nothing(tmp_path):
    path = str(tmp_path / "c")
    msg = run_ranks(1, save_losing_the_lock, path)[0]
    assert msg and "\n" not in msg and "took its lock over while this save ran" in msg, msg
    meta = _meta(path)
    assert _versions(path) == [meta["data"]] and meta["history"][0] == meta["data"]     # the first version
    with open(os.path.join(path, ".hybrid-lock")) as f:
        assert json.load(f)["host"] == "node-7"          # the other job's lock is left as it is
    assert run_ranks(1, load_bad, path)[0] is None
