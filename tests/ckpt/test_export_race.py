"""Exports that cannot lose a file: OUT is re-checked at the moment the export replaces it."""
import os
import subprocess
import sys
import time

import pytest

from hybrid.errors import HybridError
from hybrid.runtime.launch import run_ranks
from tests.test_safety import save_one
from tests.test_safety_input import _one_line

pytestmark = pytest.mark.gloo
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("export") / "ckpt")
    run_ranks(1, save_one, path)
    return path


def _export_with(monkeypatch, ckpt, out, meanwhile, **kw):
    """export(ckpt, out) with `meanwhile()` run after its files are written, before it places them."""
    import hybrid.ckpt.export as ex
    real = ex._write

    def write_then(*a, **k):
        written = real(*a, **k)
        ex._write = real            # an export run meanwhile runs unhooked
        meanwhile()
        return written
    monkeypatch.setattr(ex, "_write", write_then)
    try:
        ex.export(ckpt, out, **kw)
    except HybridError as e:
        return str(e)
    finally:
        monkeypatch.setattr(ex, "_write", real)
    return None


def _no_temporaries(parent):
    return [e for e in os.listdir(parent) if e.startswith(".")]


@pytest.mark.parametrize("start", ["absent", "empty"])
def test_a_file_created_in_out_during_the_export_survives(ckpt, tmp_path, monkeypatch, start):
    out = tmp_path / "out"
    if start == "empty":
        out.mkdir()

    def user_writes():
        out.mkdir(exist_ok=True)
        (out / "notes.txt").write_text("mine")
    msg = _export_with(monkeypatch, ckpt, str(out), user_writes)
    assert msg and "\n" not in msg and "changed while the export ran" in msg and "'notes.txt'" in msg, msg
    assert "left as it is" in msg and "export to a new directory" in msg, msg
    assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert _no_temporaries(tmp_path) == []


def test_overwrite_never_replaces_an_export_a_file_was_added_to_meanwhile(ckpt, tmp_path, monkeypatch):
    from hybrid.ckpt.export import export
    out = tmp_path / "out"
    first = sorted(export(ckpt, str(out)))
    msg = _export_with(monkeypatch, ckpt, str(out), lambda: (out / "notes.txt").write_text("mine"), overwrite=True)
    assert msg and "'notes.txt'" in msg and "left as it is" in msg, msg
    assert sorted(os.listdir(out)) == sorted([*first, "notes.txt"]) and (out / "notes.txt").read_text() == "mine"
    assert _no_temporaries(tmp_path) == []
    assert _export_with(monkeypatch, ckpt, str(tmp_path / "o2"), lambda: None) is None
    assert _export_with(monkeypatch, ckpt, str(tmp_path / "o2"), lambda: None, overwrite=True) is None   # still works


def test_two_exports_into_one_new_out_one_wins_the_other_refuses(ckpt, tmp_path, monkeypatch):
    from hybrid.ckpt.export import export
    out = str(tmp_path / "out")
    won = []
    msg = _export_with(monkeypatch, ckpt, out, lambda: won.append(export(ckpt, out)))    # B finishes inside A
    assert won and msg and "\n" not in msg and "filled by another export while this one ran" in msg, msg
    assert sorted(os.listdir(out)) == sorted(won[0]) and _no_temporaries(tmp_path) == []


def test_two_cli_exports_at_once_into_one_new_out(ckpt, tmp_path):
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "hybrid.cli", "export", ckpt, out, "--max-shard-size", "8KiB"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    results = [(p.returncode, o, e) for p, (o, e) in zip(procs, outputs)]
    assert sorted(rc for rc, _, _ in results) == [0, 2], results
    assert _one_line(*next(r for r in results if r[0] == 2)), results
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json")) and _no_temporaries(tmp_path) == []


EXPORT_WHILE_SAVED = """
import os, sys, time
sys.path.insert(0, {root!r})
import hybrid.ckpt.export as ex
from hybrid.cli.main import main
real = ex.check_params
def checked_then_wait(*a, **k):
    r = real(*a, **k)
    open({gate!r} + ".held", "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists({gate!r} + ".go") and time.monotonic() < deadline:
        time.sleep(0.01)
    return r
ex.check_params = checked_then_wait
sys.exit(main(["export", {ckpt!r}, {out!r}]))
"""


def test_an_export_racing_a_save_is_one_line(tmp_path):
    ckpt, out, gate = str(tmp_path / "ckpt"), str(tmp_path / "out"), str(tmp_path / "gate")
    run_ranks(1, save_one, ckpt)
    script = EXPORT_WHILE_SAVED.format(root=ROOT, gate=gate, ckpt=ckpt, out=out)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 300
    while not os.path.exists(gate + ".held") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    run_ranks(1, save_one, ckpt)            # a new version replaces the one being exported
    open(gate + ".go", "w").close()
    stdout, stderr = proc.communicate(timeout=300)
    assert _one_line(proc.returncode, stdout, stderr), (proc.returncode, stdout, stderr[-3000:])
    assert "changed while it was exported (a save replaced version" in stderr and "export again" in stderr, stderr
    assert not os.path.exists(out) and [e for e in os.listdir(tmp_path) if e.startswith(".")] == []
