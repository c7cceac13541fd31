"""The README's training loop (docs/training.md), run as written on 2 gloo ranks (torchrun): it prints one line per
optimizer step, at the step, with that step's gradient norm."""
import glob
import os
import re
import subprocess
import sys

import pytest

from hybrid.runtime.launch import free_port

pytestmark = pytest.mark.gloo
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What the README leaves to the reader: a model whose output has .loss, and a loader of
# micro-batches (16 of them: two windows of the README's gradient_accumulation=8).
PRELUDE = '''
import types
import torch


class MyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, input_ids):
        logits = self.head(self.embed(input_ids))
        return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.flatten(0, 1), input_ids.flatten()))


torch.manual_seed(0)
loader = [{"input_ids": torch.randint(0, 64, (1, 32))} for _ in range(16)]
'''


def readme_loop() -> str:
    """The python block under a "## Training loop" heading, in README.md or a file in docs/."""
    docs = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    found = []
    for doc in docs:
        with open(doc) as f:
            found += re.findall(r"^## Training loop\n\n```python\n(.*?)```", f.read(), flags=re.S | re.M)
    assert len(found) == 1, f"one training loop block in README.md and docs/, found {len(found)}"
    block = found[0]
    assert "w.step()" in block and "print(" in block
    return block


def test_the_readme_loop_prints_each_step_once_with_its_norm(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(PRELUDE + readme_loop() + "\nimport hybrid.runtime.mesh\nhybrid.runtime.mesh.shutdown()\n")
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--redirects", "1", "--log-dir", str(logs), str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    outs = sorted(logs.rglob("stdout.log"))
    assert len(outs) == 2
    for out in outs:                      # each rank prints (a plain print) every window once, at its step
        printed = out.read_text()
        steps = re.findall(r"^(\d+) (\S+) \[", printed, flags=re.M)
        assert [int(s) for s, _ in steps] == [1, 2], printed
        assert all(norm != "None" and float(norm) > 0 for _, norm in steps), printed
