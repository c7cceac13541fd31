"""setup.sh says what it does at each step, and DeepSpeed's extension cache is per environment."""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_setup_says_what_it_does():
    """Re-run where the set-up is complete (it then installs and builds nothing): every step is a line."""
    venv = ROOT / ".venv"
    stamp = venv / ".hybrid-setup"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    if Path(sys.prefix).resolve() != venv.resolve() or not stamp.exists() or stamp.read_text().strip() != want:
        pytest.skip("runs only in the worktree's own, complete .venv (it must not install during tests)")
    if not list((venv / "torch_extensions").glob("**/deepspeed_shm_comm/*.so")):
        pytest.skip("DeepSpeed's op is not built in .venv/torch_extensions: setup would build it (a minute)")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    r = subprocess.run(["bash", "setup.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines and all(line.startswith("setup: ") for line in lines), r.stdout
    text = r.stdout
    assert ".venv exists" in text and "setup: torch 2." in text and "installed (pyproject.toml unchanged)" in text
    assert f"op is built (in {venv}/torch_extensions)" in text and text.rstrip().endswith("pytest -q")
