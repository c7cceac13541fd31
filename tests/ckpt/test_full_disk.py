"""A full disk during a save is one line naming the disk and the fix (a real tmpfs, a real ENOSPC)."""
import os
import subprocess

import pytest

from hybrid.errors import HybridError
from hybrid.runtime.launch import run_ranks
from tests.ckpt.test_checkpoint import load_bad
from tests.test_safety import _train, _wrap

pytestmark = pytest.mark.gloo


@pytest.fixture
def tiny_disk(tmp_path):
    """A 3 MiB tmpfs: one version of the test model (about 2.1 MB) fits, two do not."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], check=True, timeout=30)
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True, timeout=30)


def save_twice_on_a_full_disk(path, when):
    """A first version, then a second that runs out of space in DCP's shards or (the disk filled
    right after them) in torch.save's RNG file; the second's one-line error."""
    import torch.distributed.checkpoint as dcp
    w = _wrap("ddp")
    _train(w)
    w.save(path)
    _train(w)
    real = dcp.save

    def then_fill(*a, **k):
        out = real(*a, **k)
        with open(os.path.join(os.path.dirname(path), "filler"), "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        return out
    if when == "torch.save":
        dcp.save = then_fill
    try:
        w.save(path)
    except HybridError as e:
        return str(e)
    finally:
        dcp.save = real
        if os.path.exists(os.path.join(os.path.dirname(path), "filler")):
            os.unlink(os.path.join(os.path.dirname(path), "filler"))
    return None


@pytest.mark.parametrize("when", ["dcp", "torch.save"])
def test_a_full_disk_names_the_disk_and_the_fix_and_keeps_the_previous_version(tiny_disk, when):
    path = os.path.join(tiny_disk, "ckpt")
    msg = run_ranks(1, save_twice_on_a_full_disk, path, when)[0]
    assert msg and "\n" not in msg and "inline_container" not in msg and "enforce fail" not in msg, msg
    assert f"the disk holding it is full: no space left on {tiny_disk!r}" in msg, msg
    assert "free space there, or save somewhere else; the previous version is still in force" in msg, msg
    assert len([e for e in os.listdir(path) if e.startswith("data-")]) == 1
    assert not [e for e in os.listdir(path) if e.startswith(".")], os.listdir(path)
    assert run_ranks(1, load_bad, path)[0] is None
