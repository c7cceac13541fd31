"""GPU catalogue, cluster shape, and detection of the machine we run on (pure until detect())."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from ..errors import HybridError, short, unknown_name
from ..units import GiB, MiB, fmt_bytes, parse_bytes


LATENCY_INTRA = 10e-6
"""Seconds per log2(n) step of a collective inside a node: the order of NCCL's small-message
all-reduce latency over NVLink (nccl-tests on 8 x H100: ~6 us for 2 GPUs with NVLS, NVIDIA/nccl
issue #1259; ~25 us for 4 GPUs without, NVIDIA/nccl-tests issue #128)."""
LATENCY_INTER = 25e-6
"""... across nodes: an 8-byte all-reduce between 2 A100 nodes on HDR InfiniBand takes ~19-20 us
(nccl-tests, NVIDIA/nccl-tests issue #150)."""
PCIE_BW = 25e9
"""Host<->GPU bytes/s per direction: PCIe Gen4 x16 is 32 GB/s raw, ~25 GB/s sustained (NVIDIA's
bandwidthTest on A100/H100 hosts); Gen5 about twice."""
HOST_STEP_RATE = 1.0e9
"""Parameters per second an optimizer step runs at on the host. Assumption: DeepSpeedCPUAdam-class
AVX code on a many-core server (the ZeRO-Offload paper, arXiv 2101.06840, reports ~1-2 s per step
for 10B parameters); torch's CPU AdamW is slower."""

ALLOCATOR_HEADROOM = 0.28
"""Reserved over allocated with torch's default caching allocator (no expandable segments), as a
fraction of allocated: block rounding and fragmentation by transient buffers of varying size.
Calibrated on published pairs of peak active and peak reserved (benchmarks/public_runs.yaml:
torchtitan PR #165, FSDP2 on Llama-2-7B shape, 8 H100: 22.73 -> 31.02 GiB with full AC (+36%),
49.54 -> 59.41 GiB with per-op SAC (+20%); the mean is taken)."""
EXPANDABLE_HEADROOM = 0.10
"""The same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which maps physical pages into
one growing segment per stream, so freed space is reused whatever the request size. Calibrated on
torchtitan's December 2024 Llama 3.1 8B runs, eager and compiled (expandable segments set by its
launcher), where only reserved is published: the median of published reserved / our allocated, minus one
(`benchmarks/public_runs.py --calibrate`)."""


def headroom(cluster) -> float:
    """Reserved over allocated for this cluster's allocator setting, or its `--headroom`."""
    if cluster.headroom is not None:
        return cluster.headroom
    return EXPANDABLE_HEADROOM if cluster.expandable_segments else ALLOCATOR_HEADROOM


GB = 1e9

DEFAULT_EFFICIENCY = 0.45
"""Achievable fraction of dense peak FLOP/s for GPUs the public-runs corpus has no points for:
published MFU of 40-50% for 7B-70B dense training (Megatron-LM, arXiv 2104.04473, Table 1)."""

# Calibrated by `benchmarks/public_runs.py --calibrate` on benchmarks/public_runs.yaml (the
# median of the efficiencies that reproduce each point's published tokens/s, per GPU type: A100
# on 19 points from torchtitan, fms-fsdp, llm-foundry and Megatron-LM; H100 80 GB on llm-foundry's
# 4; the 96 GB H100 on torchtitan's 9, two compiled and two compiled + float8: with the elementwise traffic
# modelled, hybrid/estimation/cost/elementwise.py, compiled and eager points need the same figure).
# A100 40/80 GB share a chip, as H100 80 GB and H200 do; h100-96gb is the 500 W Grand Teton part
# whose peak torchtitan does not know ("between SXM and NVL"): its factor absorbs that.
A100_EFFICIENCY = 0.65
H100_EFFICIENCY = 0.52
H100_96GB_EFFICIENCY = 0.48


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator model. Bandwidths are per GPU, one direction, in bytes/s."""

    name: str
    memory_bytes: int
    """Device memory as the driver reports it (nvidia-smi 'Total'), in bytes."""
    bf16_flops: float
    """Dense 16-bit tensor-core peak, FLOP/s (vendor datasheet, without sparsity): bf16, or fp16
    on GPUs without bf16 (V100, T4)."""
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
    bf16: bool = True
    """Whether the GPU computes in bf16 (Ampere and newer); without it training runs fp16-mixed."""
    comm_overlap: float = 1.0
    """Fraction of a phase's compute that collectives can hide behind: 1.0 on GPUs (NCCL runs on
    its own streams), 0 for CPU ranks on gloo (they share the cores that compute)."""
    efficiency: float = DEFAULT_EFFICIENCY
    """Fraction of the dense peak a well-tuned eager transformer step reaches on this GPU: the
    cost model's one speed factor. Calibrated on the public runs in benchmarks/public_runs.yaml
    where the corpus has points for the GPU (`benchmarks/public_runs.py --calibrate` fits it:
    one number per GPU type, no per-run factors); DEFAULT_EFFICIENCY elsewhere."""
    intra_node_latency: float = LATENCY_INTRA
    """Seconds per log2(n) step of one collective inside a node (hybrid/estimation/cost/links.py)."""
    inter_node_latency: float = LATENCY_INTER
    """... across nodes. Both are replaced by a calibration's fitted figures (hybrid/estimation/calibration.py)."""
    collective_overhead: float = 0.0
    """Host seconds per collective call whatever its size: launch, dispatch and the ranks meeting
    (hybrid/families/host.py counts the calls). 0 in the catalogue (no measured figure; on GPUs the
    host runs ahead of the kernels); a calibration fits it."""
    tensor_overhead: float = 0.0
    """Host seconds per per-parameter-tensor operation (an optimizer's per-tensor loop, DeepSpeed's
    per-parameter hooks; hybrid/families/host.py counts them). 0 in the catalogue; a calibration fits it."""

    fp8_flops: float = 0.0
    """Dense float8 (e4m3) tensor-core peak, FLOP/s (datasheets: H100 SXM and H200 1,979 TFLOP/s
    without sparsity, twice bf16); 0: no float8 training (tensor cores before Hopper)."""

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
        GPUSpec("a100-40gb", 40960 * MiB, 312e12, 300 * GB, 25 * GB, mem_bw=1.56e12, host_memory_bytes=1024 * GiB,
                efficiency=A100_EFFICIENCY),
        GPUSpec("a100-80gb", 81920 * MiB, 312e12, 300 * GB, 25 * GB, mem_bw=2.04e12, host_memory_bytes=1024 * GiB,
                efficiency=A100_EFFICIENCY),
        GPUSpec("h100-80gb", 81559 * MiB, 989e12, 450 * GB, 50 * GB, mem_bw=3.35e12, host_memory_bytes=2048 * GiB,
                efficiency=H100_EFFICIENCY, fp8_flops=1979e12),
        # Meta's Grand Teton H100: 96 GB HBM2e at 2.4 TB/s, 500 W; torch reports 95.0396 GiB
        # (torchtitan PR #165). Peak: the SXM datasheet figure, as torchtitan's MFU uses.
        GPUSpec("h100-96gb", 97321 * MiB, 989e12, 450 * GB, 50 * GB, mem_bw=2.4e12, host_memory_bytes=2048 * GiB,
                efficiency=H100_96GB_EFFICIENCY, fp8_flops=1979e12),
        GPUSpec("h200-141gb", 143771 * MiB, 989e12, 450 * GB, 50 * GB, mem_bw=4.8e12, host_memory_bytes=2048 * GiB,
                efficiency=H100_EFFICIENCY, fp8_flops=1979e12),
        GPUSpec("l40s-48gb", 46068 * MiB, 362e12, 32 * GB, 6.25 * GB, mem_bw=0.86e12, host_memory_bytes=1024 * GiB),
        # GPUs without bf16 or with less memory (datasheets: V100 SXM2 125 TFLOP/s fp16 tensor,
        # 900 GB/s HBM2, NVLink2 300 GB/s bidirectional; DGX-1: 4 x 100 Gb/s EDR for 8 GPUs, 512 GB;
        # T4 65 TFLOP/s fp16, 320 GB/s, PCIe Gen3 x16 ~16 GB/s; AWS g4dn.12xlarge: 4 T4, 50 Gb/s,
        # 192 GiB). A10G: NVIDIA's A10 datasheet (125 TFLOP/s bf16, 600 GB/s) - AWS's A10G is
        # clocked lower, so its speed is an upper bound; L4 121 TFLOP/s bf16, 300 GB/s; both PCIe
        # Gen4 x16 (32 GB/s); AWS g5/g6.48xlarge: 8 GPUs, 100 Gb/s, 768 GiB.
        GPUSpec("v100-16gb", 16160 * MiB, 125e12, 150 * GB, 6.25 * GB, mem_bw=0.9e12, host_memory_bytes=512 * GiB,
                bf16=False),
        GPUSpec("v100-32gb", 32510 * MiB, 125e12, 150 * GB, 6.25 * GB, mem_bw=0.9e12, host_memory_bytes=512 * GiB,
                bf16=False),
        GPUSpec("t4-16gb", 15360 * MiB, 65e12, 16 * GB, 1.5625 * GB, mem_bw=0.32e12, host_memory_bytes=192 * GiB,
                bf16=False),
        GPUSpec("a10g-24gb", 23028 * MiB, 125e12, 32 * GB, 1.5625 * GB, mem_bw=0.6e12, host_memory_bytes=768 * GiB),
        GPUSpec("l4-24gb", 23034 * MiB, 121e12, 32 * GB, 1.5625 * GB, mem_bw=0.3e12, host_memory_bytes=768 * GiB),
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
    expandable_segments: bool = True
    """Whether torch's caching allocator runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    (auto_wrap sets it on CUDA unless the user set PYTORCH_CUDA_ALLOC_CONF): it decides how far
    reserved memory exceeds allocated (hybrid/estimation/memory/breakdown.py)."""
    headroom: float | None = None
    """Reserved over allocated, as a fraction of allocated (`--headroom`); None = the calibrated
    figure for the allocator setting."""

    def __post_init__(self):
        for attr in ("nodes", "gpus_per_node"):
            v = getattr(self, attr)
            if not isinstance(v, int) or v < 1:
                raise HybridError(f"{attr} must be a positive integer, got {v!r}")
        if self.headroom is not None and not 0 <= self.headroom <= 4:
            raise HybridError(f"headroom must be a fraction of allocated memory in [0, 4], got {self.headroom!r} "
                              "(0.1 = reserved is 10% above allocated)")

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
              gpu_memory: str | int | None = None, host_memory: str | int | None = None,
              headroom: float | None = None, expandable_segments: bool | None = None) -> "Cluster":
        """The boundary constructor: names and memory strings in, validated Cluster out.
        `expandable_segments` None: what auto_wrap will run with (allocator_expandable())."""
        spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
        if gpu_memory is not None:
            spec = replace(spec, memory_bytes=parse_bytes(gpu_memory))
        if host_memory is not None:
            spec = replace(spec, host_memory_bytes=parse_bytes(host_memory))
        if expandable_segments is None:
            expandable_segments = allocator_expandable()
        return cls(nodes=nodes, gpus_per_node=gpus_per_node, gpu=spec, expandable_segments=expandable_segments,
                   headroom=headroom)

    def describe(self) -> str:
        return (f"{self.nodes} node(s) x {self.gpus_per_node} {self.gpu.name} "
                f"({fmt_bytes(self.gpu.memory_bytes)} each, world size {self.world_size})")


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""The variables torch's CUDA caching allocator reads its settings from (the second is the newer,
device-generic name)."""


def allocator_expandable(environ=os.environ) -> bool:
    """Whether the CUDA allocator will use expandable segments: the user's setting where one of
    ALLOC_CONF_VARS is set, else True, because auto_wrap sets it (hybrid/auto.py)."""
    conf = next((environ[v] for v in ALLOC_CONF_VARS if v in environ), None)
    if conf is None:
        return True
    opts = dict(kv.split(":", 1) for kv in conf.replace(" ", "").split(",") if ":" in kv)
    return opts.get("expandable_segments", "False").lower() == "true"


def as_cluster(value) -> "Cluster | None":
    """A Cluster as given (None stays None), or one line naming what was given instead."""
    if value is None or isinstance(value, Cluster):
        return value
    raise HybridError(f"cluster must be a hybrid.Cluster, e.g. hybrid.Cluster.build(8, 8, 'h100-80gb') for 8 "
                      f"nodes of 8 GPUs, got {type(value).__name__} {short(value)}")


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
        spec = cpu_spec(local)
    if gpu_memory is not None:
        spec = replace(spec, memory_bytes=parse_bytes(gpu_memory))
    return Cluster(nodes=world // local, gpus_per_node=local, gpu=spec, expandable_segments=allocator_expandable())


def cpu_spec(local_ranks: int) -> GPUSpec:
    """This machine's CPU as the 'accelerator' of `local_ranks` gloo ranks: host memory shared
    between them, no CUDA context. Speeds are assumptions for the cost model only (loopback gloo
    moves a few GB/s; ~1e11 FLOP/s is a few AVX cores), never used for a GPU decision."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return GPUSpec("cpu", total // local_ranks, 1e11, 5 * GB, 5 * GB, cuda_context_bytes=0, is_cuda=False,
                   mem_bw=10 * GB, host_memory_bytes=total, comm_overlap=0.0)


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else total."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _match_cuda(device_name: str, total_memory: int) -> GPUSpec:
    """Pick the catalogue entry whose family matches the device name and whose memory is closest."""
    low = device_name.lower()
    # (substring of the device name, catalogue prefix); longer names first (A100 before A10)
    families = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("l40s", "l40s"), ("a10", "a10g"),
                ("l4", "l4-"), ("v100", "v100"), ("t4", "t4-"))
    family = next((prefix for sub, prefix in families if sub in low), None)
    candidates = [g for g in GPUS.values() if family and g.name.startswith(family)]
    if not candidates:
        # Unknown GPU: keep its real memory; speed from the H100 entry is only a placeholder for
        # the cost model, and the name says so.
        base = GPUS["h100-80gb"]
        return replace(base, name=f"{device_name} (speed assumed h100)", memory_bytes=total_memory)
    best = min(candidates, key=lambda g: abs(g.memory_bytes - total_memory))
    return replace(best, memory_bytes=total_memory)
