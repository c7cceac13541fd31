"""How long `hybrid.runtime.launch.run_ranks` takes to start 2 local ranks and collect a result, with the
fork server (the default where the platform has it) against spawn (a fresh interpreter that imports
torch again per rank). The gloo tier of the tests launches ranks about a hundred times.

    .venv/bin/python benchmarks/launch_speed.py      # about a minute on 2 cores
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybrid.runtime import launch  # noqa: E402

LAUNCHES = 5


def rank_of(x: int) -> int:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    r = dist.get_rank() + x
    dist.destroy_process_group()
    return r


def timed(method: str) -> float:
    original = launch._start_method
    if method == "spawn":
        launch._start_method = lambda: "spawn"
    try:
        start = time.perf_counter()
        for i in range(LAUNCHES):
            assert launch.run_ranks(2, rank_of, i) == [i, i + 1]
        return (time.perf_counter() - start) / LAUNCHES
    finally:
        launch._start_method = original


if __name__ == "__main__":
    import os
    print(f"load average {os.getloadavg()[0]:.1f}; {LAUNCHES} launches of 2 gloo ranks each")
    for method in ("forkserver", "spawn"):
        print(f"  {method:<10} {timed(method):6.2f} s per launch")
