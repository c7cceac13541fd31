"""examples/train_gpt.py resumed at another world size continues its samples exactly (torchrun, CPU ranks)."""
import json
import os
import subprocess
import sys

import pytest

from hybrid.runtime.launch import free_port

pytestmark = pytest.mark.gloo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchrun(nproc, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "examples/train_gpt.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def test_two_one_two_ranks_see_every_sample_once_per_epoch_at_the_same_global_batch(tmp_path):
    log = tmp_path / "samples.jsonl"
    common = ["--strategy", "fsdp", "--precision", "fp32", "--samples", "64", "--save-every", "5", "--layers", "1",
              "--hidden", "64", "--ckpt-dir", str(tmp_path / "ck"), "--resume", "--sample-log", str(log)]
    torchrun(2, *common, "--steps", "10")
    one = torchrun(1, *common, "--steps", "20")
    two = torchrun(2, *common, "--steps", "30")
    assert "1 ranks x 4 x 2 accumulation = global batch 8" in one and "RNG reseeded" in one
    assert "2 ranks x 4 x 1 accumulation = global batch 8" in two and "RNG reseeded" in two
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert [r["world"] for r in rows] == [2] * 10 + [1] * 10 + [2] * 10
    assert all(len(r["ids"]) == 8 for r in rows)                       # the global batch, kept
    epochs: dict = {}
    for r in rows:
        epochs.setdefault(r["epoch"], []).extend(r["ids"])
    for e in (0, 1, 2):                                                # whole epochs: every sample once
        assert sorted(epochs[e]) == list(range(64)), e
    assert len(epochs[3]) == len(set(epochs[3])) == 48
