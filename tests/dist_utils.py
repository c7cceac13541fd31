"""Run a function on N real ranks (CPU, gloo) and collect what each returns: the one place tests
spawn processes."""
from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, local_world, fn, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local_world),
                      LOCAL_WORLD_SIZE=str(local_world), GROUP_RANK=str(rank // local_world),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    import torch.distributed as dist
    try:
        result = fn(*args)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException as e:  # noqa: BLE001 - reported to the parent test
        torch.save({"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()},
                   os.path.join(out_dir, f"{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, local_world: int | None = None) -> list:
    """fn(*args) on `world` ranks; returns the per-rank results, or raises with the first error."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(world, free_port(), local_world or world, fn, args, out),
                           nprocs=world, join=True, start_method="spawn")
        results = [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        if "error" in res:
            raise RuntimeError(f"rank {r} failed: {res['error']}\n{res['tb']}")
    return [res["ok"] for res in results]
