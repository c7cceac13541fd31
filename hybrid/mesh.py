"""Process group start-up and the named 2D DeviceMesh ("replicate", "shard").

Shard groups are consecutive ranks: torchrun numbers ranks node by node, so a shard size that
divides the GPUs per node keeps every shard group inside one node (NVLink), and a larger one spans
whole nodes. Every shape is validated before any collective is called.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .catalogue import validate_shard_size
from .errors import HybridError


@dataclass(frozen=True)
class Runtime:
    """Where this rank runs: device, backend and the world shape."""

    device: torch.device
    backend: str
    world_size: int
    rank: int
    local_world_size: int

    @property
    def device_type(self) -> str:
        return self.device.type


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float = 600) -> Runtime:
    """Join (or start) the default process group: nccl + the local CUDA device when CUDA is there,
    else gloo on the CPU. Without torchrun's variables this is a world of one."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1, timeout=timeout)
    backend = dist.get_backend()
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return Runtime(device, backend, world, dist.get_rank(), local)


def build_mesh(shard_size: int, runtime: Runtime, gpus_per_node: int | None = None) -> DeviceMesh:
    """A 2D mesh (replicate = world / shard, shard) with named dimensions. Validated first."""
    per_node = gpus_per_node or runtime.local_world_size
    world = runtime.world_size
    if world % per_node:
        raise HybridError(f"world size {world} is not a multiple of {per_node} ranks per node")
    validate_shard_size(shard_size, world, per_node)
    return init_device_mesh(runtime.device_type, (world // shard_size, shard_size),
                            mesh_dim_names=("replicate", "shard"))


def shard_group_ranks(mesh: DeviceMesh) -> list[int]:
    """Global ranks in this rank's shard group (for checks and printing)."""
    return dist.get_process_group_ranks(mesh["shard"].get_group())


def shutdown(timeout_s: float = 60.0) -> None:
    """Leave the job cleanly: a barrier, destroy every process group, then rank 0 waits until the
    others have done so before it returns (rank 0 often hosts the rendezvous store; exiting first
    can abort peers still tearing down - 'terminate called without an active exception')."""
    import time

    if not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _get_default_store

    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        store = _get_default_store()
    except (RuntimeError, ValueError):
        store = None
    dist.barrier()
    dist.destroy_process_group()
    if store is None or world == 1:
        return
    store.add("hybrid/shutdown", 1)
    if rank == 0:
        deadline = time.monotonic() + timeout_s
        while store.add("hybrid/shutdown", 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
