"""GPU catalogue, cluster shape, and detection of the machine we run on (pure until detect())."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from .errors import HybridError, unknown_name
from .units import GiB, MiB, fmt_bytes, parse_bytes

GB = 1e9


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator model. Bandwidths are per GPU, one direction, in bytes/s."""

    name: str
    memory_bytes: int
    """Device memory as the driver reports it (nvidia-smi 'Total'), in bytes."""
    bf16_flops: float
    """Dense bf16 tensor-core peak, FLOP/s (vendor datasheet, without sparsity)."""
    intra_node_bw: float
    """NVLink/PCIe bandwidth between GPUs of one node, per GPU per direction, bytes/s."""
    inter_node_bw: float
    """Network bandwidth across nodes per GPU per direction, bytes/s (typical cluster NICs)."""
    cuda_context_bytes: int = 1 * GiB
    """Device memory taken before the first tensor: CUDA context, cuBLAS/NCCL workspaces.
    ~0.5-1 GiB on Ampere/Hopper with CUDA 12 (nvidia-smi minus torch.cuda.memory_reserved);
    we take the upper end. 0 for the CPU."""
    is_cuda: bool = True
    mem_bw: float = 2.0e12
    """Device memory bandwidth, bytes/s (datasheets: A100-40 1.56 TB/s, A100-80 2.04, H100 SXM
    3.35, H200 4.8, L40S 0.86): prices the copies in and out of communication buffers."""
    host_memory_bytes: int = 2048 * GiB
    """Host (CPU) memory of one node, shared by its ranks; bounds what offload can hold."""
    comm_overlap: float = 1.0
    """Fraction of a phase's compute that collectives can hide behind: 1.0 on GPUs (NCCL runs on
    its own streams), 0 for CPU ranks on gloo (they share the cores that compute)."""

    def __post_init__(self):
        if self.memory_bytes <= 0:
            raise HybridError(f"GPU memory must be positive, got {self.memory_bytes} for {self.name}")


# Memory: nvidia-smi totals (MiB). FLOP/s: NVIDIA datasheets, dense bf16.
# NVLink: A100 NVLink3 600 GB/s and H100/H200 NVLink4 900 GB/s bidirectional per GPU (halved for
# one direction); L40S has no NVLink: PCIe Gen4 x16, 32 GB/s per direction.
# Network: one NIC per GPU as in DGX/HGX reference designs: HDR 200 Gb/s (25 GB/s) for A100,
# NDR 400 Gb/s (50 GB/s) for H100/H200; L40S servers typically share 2x200 Gb/s per 8 GPUs.
# Host memory per node: DGX A100 1 TB, DGX H100/H200 2 TB; a typical 8 x L40S server 1 TB.
GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec("a100-40gb", 40960 * MiB, 312e12, 300 * GB, 25 * GB, mem_bw=1.56e12, host_memory_bytes=1024 * GiB),
        GPUSpec("a100-80gb", 81920 * MiB, 312e12, 300 * GB, 25 * GB, mem_bw=2.04e12, host_memory_bytes=1024 * GiB),
        GPUSpec("h100-80gb", 81559 * MiB, 989e12, 450 * GB, 50 * GB, mem_bw=3.35e12, host_memory_bytes=2048 * GiB),
        GPUSpec("h200-141gb", 143771 * MiB, 989e12, 450 * GB, 50 * GB, mem_bw=4.8e12, host_memory_bytes=2048 * GiB),
        GPUSpec("l40s-48gb", 46068 * MiB, 362e12, 32 * GB, 6.25 * GB, mem_bw=0.86e12, host_memory_bytes=1024 * GiB),
    )
}


def get_gpu(name: str) -> GPUSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise unknown_name("GPU", name, GPUS) from None


@dataclass(frozen=True)
class Cluster:
    """nodes x gpus_per_node identical accelerators."""

    nodes: int = 1
    """Number of machines."""
    gpus_per_node: int = 8
    """Accelerators (ranks) per machine; shard groups never straddle a node unless they span whole nodes."""
    gpu: GPUSpec = field(default_factory=lambda: GPUS["h100-80gb"])
    """The accelerator model (capacity, speed, links)."""

    def __post_init__(self):
        for attr in ("nodes", "gpus_per_node"):
            v = getattr(self, attr)
            if not isinstance(v, int) or v < 1:
                raise HybridError(f"{attr} must be a positive integer, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def capacity_bytes(self) -> int:
        return self.gpu.memory_bytes

    @property
    def host_bytes_per_rank(self) -> int:
        return self.gpu.host_memory_bytes // self.gpus_per_node

    @classmethod
    def build(cls, nodes: int = 1, gpus_per_node: int = 8, gpu: str | GPUSpec = "h100-80gb",
              gpu_memory: str | int | None = None, host_memory: str | int | None = None) -> "Cluster":
        """The boundary constructor: names and memory strings in, validated Cluster out."""
        spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
        if gpu_memory is not None:
            spec = replace(spec, memory_bytes=parse_bytes(gpu_memory))
        if host_memory is not None:
            spec = replace(spec, host_memory_bytes=parse_bytes(host_memory))
        return cls(nodes=nodes, gpus_per_node=gpus_per_node, gpu=spec)

    def describe(self) -> str:
        return (f"{self.nodes} node(s) x {self.gpus_per_node} {self.gpu.name} "
                f"({fmt_bytes(self.gpu.memory_bytes)} each, world size {self.world_size})")


def detect(gpu_memory: str | int | None = None) -> Cluster:
    """The live machine: its CUDA GPUs (matched to the catalogue by name and size) or its CPU.

    World shape comes from torchrun's variables when present (WORLD_SIZE, LOCAL_WORLD_SIZE).
    On a CPU machine the 'GPU' is the host memory split between the local ranks.
    """
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world % local:
        raise HybridError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        spec = replace(_match_cuda(props.name, props.total_memory),
                       host_memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        # Host memory shared by the local ranks; no CUDA context. Loopback gloo ~ a few GB/s.
        spec = GPUSpec("cpu", total // local, 1e11, 5 * GB, 5 * GB, cuda_context_bytes=0, is_cuda=False,
                       mem_bw=10 * GB, host_memory_bytes=total, comm_overlap=0.0)
    if gpu_memory is not None:
        spec = replace(spec, memory_bytes=parse_bytes(gpu_memory))
    return Cluster(nodes=world // local, gpus_per_node=local, gpu=spec)


def _match_cuda(device_name: str, total_memory: int) -> GPUSpec:
    """Pick the catalogue entry whose family matches the device name and whose memory is closest."""
    low = device_name.lower()
    family = next((f for f in ("h200", "h100", "a100", "l40s") if f in low), None)
    candidates = [g for g in GPUS.values() if family and g.name.startswith(family)]
    if not candidates:
        # Unknown GPU: keep its real memory; speed from the H100 entry is only a placeholder for
        # the cost model, and the name says so.
        base = GPUS["h100-80gb"]
        return replace(base, name=f"{device_name} (speed assumed h100)", memory_bytes=total_memory)
    best = min(candidates, key=lambda g: abs(g.memory_bytes - total_memory))
    return replace(best, memory_bytes=total_memory)
