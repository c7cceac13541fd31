"""What torchft adds to a step (hybrid/runtime/ft.py): the quorum before the window's first forward
and the should_commit vote before the optimizer step, on 2 replica groups x 1 CPU rank on this
machine (lighthouse, managers and peers on loopback: the floor of what a cluster's network adds to).
The constant QUORUM_S in hybrid/estimation/cost/step.py is this benchmark's median.

    .venv/bin/python benchmarks/ft_quorum.py          # about a minute on 2 cores
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WARM, STEPS, GROUPS = 5, 60, 2


def group(out: str) -> None:
    """One replica group of one rank: the manager's start_quorum and should_commit timed per step."""
    import torch

    from hybrid import auto_wrap
    from hybrid.model.decoder import build_decoder
    from hybrid.model.presets import DecoderConfig
    from hybrid.runtime.mesh import shutdown
    torch.set_num_threads(1)
    tiny = DecoderConfig("llama", 512, 64, 2, 4, 176, 64, kv_heads=2, tied=True)
    w = auto_wrap(build_decoder(tiny, seed=0), strategy="fsdp", precision="fp32", micro_batch=1, seq_len=16,
                  verbose=False, fault_tolerant=True)
    quorum, commit = [], []
    m = w.ft.manager

    def timed(fn, into):
        def call(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            if w.step_count >= WARM and m.num_participants() == GROUPS:
                into.append(time.perf_counter() - t)
            return out
        return call
    m.start_quorum, m.should_commit = timed(m.start_quorum, quorum), timed(m.should_commit, commit)
    ids = torch.zeros(1, 16, dtype=torch.long)
    while w.step_count < WARM + STEPS:
        w.train_step(ids)
    Path(out).write_text(json.dumps({"quorum": quorum, "commit": commit}))
    w.ft.shutdown()
    shutdown()


def main() -> None:
    from hybrid.runtime.ft import start_lighthouse
    from hybrid.runtime.mesh import free_port
    lighthouse = start_lighthouse(min_replicas=GROUPS)
    procs, outs = [], []
    for g in range(GROUPS):
        outs.append(f"/tmp/ft_quorum.{os.getpid()}.{g}.json")
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse.address(), "REPLICA_GROUP_ID": str(g),
               "NUM_REPLICA_GROUPS": str(GROUPS), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, __file__, "--group", outs[-1]], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        lighthouse.shutdown()
    quorum = [x for o in outs for x in json.loads(Path(o).read_text())["quorum"]]
    commit = [x for o in outs for x in json.loads(Path(o).read_text())["commit"]]
    for o in outs:
        os.remove(o)
    print(f"{GROUPS} replica groups x 1 rank, {len(quorum)} steps with both groups in the quorum, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores:")
    for name, xs in (("quorum (start_quorum)", quorum), ("vote (should_commit)", commit)):
        print(f"  {name:22}  min {min(xs) * 1e3:6.2f} ms  median {statistics.median(xs) * 1e3:6.2f} ms  "
              f"p90 {statistics.quantiles(xs, n=10)[-1] * 1e3:6.2f} ms")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--group"]:
        group(sys.argv[2])
    else:
        main()
