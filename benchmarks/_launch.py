"""Shared by the benchmarks: run a function on N CPU ranks (gloo) and gather rank 0's result."""
from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.multiprocessing as mp


def _entry(rank, world, port, fn, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import warnings
    warnings.filterwarnings("ignore")
    result = fn(*args)
    if rank == 0:
        torch.save(result, out)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def run(world: int, fn, *args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.pt")
        mp.start_processes(_entry, args=(world, port, fn, args, out), nprocs=world, join=True,
                           start_method="spawn")
        return torch.load(out, weights_only=False)
