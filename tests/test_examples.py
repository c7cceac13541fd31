"""The examples run for real at tiny size (torchrun on CPU ranks)."""
import os
import subprocess
import sys

import torch

from hybrid.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(*args, nproc=2, restarts=0, timeout=300):
    # c10d rendezvous: a restarted round gets a fresh store (static rendezvous would hand the new
    # workers the dead ones' addresses)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", str(restarts),
           *args]
    # torchrun's shared rendezvous store can hand a restarted worker its dead peer's address
    # (pytorch/pytorch#135712, #167288): a fresh store per restart avoids it
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def test_crash_mid_epoch_restarts_and_ends_where_an_uninterrupted_run_ends(tmp_path):
    common = ["examples/train_gpt.py", "--strategy", "fsdp", "--precision", "fp32", "--steps", "12",
              "--samples", "64", "--save-every", "4"]
    torchrun(*common, "--ckpt-dir", str(tmp_path / "a"), "--out", str(tmp_path / "a.pt"))
    log = torchrun(*common, "--ckpt-dir", str(tmp_path / "b"), "--resume", "--crash-at-step", "6",
                   "--out", str(tmp_path / "b.pt"), restarts=1)
    assert "resumed from" in log and "at step 4" in log               # the second attempt resumed
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
