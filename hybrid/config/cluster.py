"""GPU catalogue, cluster shape, and detection of the machine we run on (pure until detect())."""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field, replace

from ..errors import HybridError, short
from ..units import GiB, MiB, fmt_bytes, parse_bytes, parse_rate


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
H100_96GB_EFFICIENCY = 0.46


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
    without sparsity, twice bf16); 0: no float8 training (tensor cores before Ada/Hopper)."""
    mxfp8_flops: float = 0.0
    """Dense MXFP8 peak (float8 elements with one e8m0 scale per 32, the OCP MX format the tensor
    cores scale in hardware), FLOP/s: Blackwell and CDNA 4 run it at their float8 rate; 0: the GPU
    has no block-scaled matmul (Hopper, Ada, CDNA 3), so torchao's MX recipe is refused there."""
    fp4_flops: float = 0.0
    """Dense 4-bit float (NVFP4/MXFP4) peak, FLOP/s, where the GPU has one (Blackwell, CDNA 4):
    listed for comparison; no training recipe here runs at it."""
    scale_up_domain: int = 8
    """GPUs that share the scale-up fabric (NVLink/NVSwitch, Infinity Fabric, PCIe) at
    intra_node_bw: 8 on an HGX board or an 8-GPU server, 72 on a GB200/GB300 NVL72 rack."""
    domain_spans_nodes: bool = False
    """Whether that domain is larger than one node and spans several (an NVL72 rack: 18 trays of 4
    GPUs on one NVSwitch fabric; a --gpu-spec file's domain). False: the domain is the node,
    whatever --gpus-per-node says (the board's NVLink does not reach another machine)."""
    stack: str = "cuda"
    """The software the GPU runs: "cuda" (NVIDIA: NCCL, CUDA) or "rocm" (AMD: RCCL, ROCm/HIP; torch
    exposes it through torch.cuda, so is_cuda stays True)."""

    def __post_init__(self):
        if self.memory_bytes <= 0:
            raise HybridError(f"GPU memory must be positive, got {self.memory_bytes} for {self.name}")
        if self.stack not in ("cuda", "rocm"):
            raise HybridError(f"GPU stack must be cuda or rocm, got {self.stack!r} for {self.name}")

    @property
    def collectives(self) -> str:
        """The collective library the ranks' process group runs on (torch's "nccl" backend is RCCL on ROCm)."""
        return "RCCL" if self.stack == "rocm" else "NCCL" if self.is_cuda else "gloo"

    @property
    def software(self) -> str:
        """The GPU's software stack in words, as a plan names it."""
        return "ROCm" if self.stack == "rocm" else "CUDA" if self.is_cuda else "CPU"


# Memory: nvidia-smi totals (MiB) where known, else the datasheet's per-GPU figure read as GiB (HBM
# stacks are binary: the B200's "180 GB" is nvidia-smi's 183,359 MiB = 179 GiB). FLOP/s: the
# vendor's datasheet, dense (the figure without 2:4 sparsity, half the headline one).
# NVLink: A100 NVLink3 600 GB/s and H100/H200 NVLink4 900 GB/s bidirectional per GPU (halved for
# one direction); L40S has no NVLink: PCIe Gen4 x16, 32 GB/s per direction.
# Network: one NIC per GPU as in DGX/HGX reference designs: HDR 200 Gb/s (25 GB/s) for A100,
# NDR 400 Gb/s (50 GB/s) for H100/H200; L40S servers typically share 2x200 Gb/s per 8 GPUs.
# (AWS EFA gives the same per GPU: p5/p5en/p6-b200 have 3,200 Gb/s for 8 GPUs, 400 Gb/s each.)
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
        # H200 datasheet: 141 GB HBM3e at 4.8 TB/s, BF16 1,979 / FP8 3,958 TFLOP/s with sparsity
        # (989 / 1,979 dense), NVLink 900 GB/s; DGX H200: 8 x 400 Gb/s ConnectX-7, 2 TB.
        GPUSpec("h200-141gb", 143771 * MiB, 989e12, 450 * GB, 50 * GB, mem_bw=4.8e12, host_memory_bytes=2048 * GiB,
                efficiency=H100_EFFICIENCY, fp8_flops=1979e12),
        # L40S datasheet: BF16 733 / FP8 1,466 TFLOP/s with sparsity (362 / 733 dense), 864 GB/s.
        GPUSpec("l40s-48gb", 46068 * MiB, 362e12, 32 * GB, 6.25 * GB, mem_bw=0.86e12, host_memory_bytes=1024 * GiB,
                fp8_flops=733e12),
        # GPUs without bf16 or with less memory (datasheets: V100 SXM2 125 TFLOP/s fp16 tensor,
        # 900 GB/s HBM2, NVLink2 300 GB/s bidirectional; DGX-1: 4 x 100 Gb/s EDR for 8 GPUs, 512 GB;
        # T4 65 TFLOP/s fp16, 320 GB/s, PCIe Gen3 x16 ~16 GB/s; AWS g4dn.12xlarge: 4 T4, 50 Gb/s,
        # 192 GiB). A10G: NVIDIA's A10 datasheet (125 TFLOP/s bf16, 600 GB/s) - AWS's A10G is
        # clocked lower, so its speed is an upper bound; L4 121 TFLOP/s bf16 and 242.5 FP8 dense
        # (L4 datasheet: 242 / 485 with sparsity), 300 GB/s; both PCIe Gen4 x16 (32 GB/s); AWS
        # g5/g6.48xlarge: 8 GPUs, 100 Gb/s, 768 GiB.
        GPUSpec("v100-16gb", 16160 * MiB, 125e12, 150 * GB, 6.25 * GB, mem_bw=0.9e12, host_memory_bytes=512 * GiB,
                bf16=False),
        GPUSpec("v100-32gb", 32510 * MiB, 125e12, 150 * GB, 6.25 * GB, mem_bw=0.9e12, host_memory_bytes=512 * GiB,
                bf16=False),
        GPUSpec("t4-16gb", 15360 * MiB, 65e12, 16 * GB, 1.5625 * GB, mem_bw=0.32e12, host_memory_bytes=192 * GiB,
                bf16=False),
        GPUSpec("a10g-24gb", 23028 * MiB, 125e12, 32 * GB, 1.5625 * GB, mem_bw=0.6e12, host_memory_bytes=768 * GiB),
        GPUSpec("l4-24gb", 23034 * MiB, 121e12, 32 * GB, 1.5625 * GB, mem_bw=0.3e12, host_memory_bytes=768 * GiB,
                fp8_flops=242.5e12),
        # Blackwell, HGX B200 datasheet (per GPU = the 8-GPU board's figures / 8): FP16/BF16 36,
        # FP8 72, FP4 144 PFLOP/s with sparsity, i.e. 2.25 / 4.5 / 9 PFLOP/s dense; 1.44 TB HBM3e
        # (180 GB) at 64 TB/s (8 TB/s); NVLink 5 1.8 TB/s per GPU (900 GB/s one way); DGX B200:
        # 8 x 400 Gb/s ConnectX-7, 2 TB. nvidia-smi reports 183,359 MiB (179 GiB; Vultr's HGX B200
        # hardware overview). MXFP8 runs at the FP8 rate (the tensor cores scale blocks of 32 in
        # hardware; torchao's MX recipe calls cuBLAS's mxfp8 GEMM).
        GPUSpec("b200-180gb", 183359 * MiB, 2.25e15, 900 * GB, 50 * GB, mem_bw=8e12, host_memory_bytes=2048 * GiB,
                fp8_flops=4.5e15, mxfp8_flops=4.5e15, fp4_flops=9e15),
        # Blackwell Ultra, HGX B300 datasheet: BF16 and FP8 as B200 (2.25 / 4.5 PFLOP/s dense),
        # FP4 105 PFLOP/s dense per 8 GPUs (13.1 each); 270 GB HBM3e per GPU (2.1 TB per board) at
        # ~8 TB/s; NVLink 5 1.8 TB/s; ConnectX-8 800 Gb/s per GPU (100 GB/s); 2 TB host (DGX B300).
        GPUSpec("b300-270gb", 270 * GiB, 2.25e15, 900 * GB, 100 * GB, mem_bw=8e12, host_memory_bytes=2048 * GiB,
                fp8_flops=4.5e15, mxfp8_flops=4.5e15, fp4_flops=13.125e15),
        # GB200 NVL72 datasheet (rack / 72): FP16/BF16 360, FP8 720, FP4 1,440 PFLOP/s with
        # sparsity (2.5 / 5 / 10 PFLOP/s dense per GPU, the 1,200 W part); 13.4 TB HBM3e (186 GB)
        # at 576 TB/s (8 TB/s); NVLink 5: 130 TB/s over 72 GPUs on one NVSwitch fabric (1.8 TB/s
        # each, 900 GB/s one way), the scale-up domain of 18 compute trays of 4 GPUs and 2 Grace
        # CPUs (480 GB LPDDR5X each: 960 GB host per tray); one 400 Gb/s ConnectX-7 per GPU.
        GPUSpec("gb200-186gb", 186 * GiB, 2.5e15, 900 * GB, 50 * GB, mem_bw=8e12, host_memory_bytes=960 * GB,
                fp8_flops=5e15, mxfp8_flops=5e15, fp4_flops=10e15, scale_up_domain=72, domain_spans_nodes=True),
        # GB300 NVL72 datasheet (rack / 72): BF16 180, FP8 360, FP4 1,080 PFLOP/s dense (2.5 / 5 / 15
        # per GPU); 20 TB HBM3e (279 GB per GPU) at 576 TB/s (8 TB/s); NVLink 5 130 TB/s over 72 GPUs,
        # 18 trays of 4 GPUs and 2 Grace CPUs; one 800 Gb/s ConnectX-8 SuperNIC per GPU (100 GB/s).
        GPUSpec("gb300-279gb", 279 * GiB, 2.5e15, 900 * GB, 100 * GB, mem_bw=8e12, host_memory_bytes=960 * GB,
                fp8_flops=5e15, mxfp8_flops=5e15, fp4_flops=15e15, scale_up_domain=72, domain_spans_nodes=True),
        # AMD Instinct (ROCm). MI300X datasheet: 192 GB HBM3 at 5.3 TB/s, BF16 1,307.4 and FP8
        # 2,614.9 TFLOP/s dense (twice with sparsity); Infinity Fabric: 7 links per GPU to the other
        # 7 of its 8-GPU platform, 896 GB/s aggregate (448 GB/s one way); torch on ROCm reports
        # 191.98 GiB. MI325X datasheet: the same compute and fabric, 256 GB HBM3E at 6 TB/s.
        # MI355X datasheet: 288 GB HBM3E at 8 TB/s, BF16 2.5, FP8 5.0 (OCP MXFP8 at the same rate),
        # MXFP4 10.1 PFLOP/s dense; Infinity Fabric 7 x 153.6 GB/s = 1,075 GB/s aggregate (537.6 one
        # way). Scale-out: one 400 Gb/s NIC per GPU (AMD's reference platforms: Pensando Pollara 400
        # or ConnectX-7); host 2 TiB. Stacks are binary gigabytes (192 GB = 192 GiB of HBM3).
        GPUSpec("mi300x-192gb", 196592 * MiB, 1307.4e12, 448 * GB, 50 * GB, mem_bw=5.3e12,
                host_memory_bytes=2048 * GiB, fp8_flops=2614.9e12, stack="rocm"),
        GPUSpec("mi325x-256gb", 262128 * MiB, 1307.4e12, 448 * GB, 50 * GB, mem_bw=6e12,
                host_memory_bytes=2048 * GiB, fp8_flops=2614.9e12, stack="rocm"),
        GPUSpec("mi355x-288gb", 294896 * MiB, 2516.6e12, 537.6 * GB, 50 * GB, mem_bw=8e12,
                host_memory_bytes=2048 * GiB, fp8_flops=5033.2e12, mxfp8_flops=5033.2e12, fp4_flops=10066.3e12,
                stack="rocm"),
        # GeForce (NVIDIA Ada and Blackwell whitepapers, the FP32-accumulate rates training uses:
        # GeForce halves them against FP16 accumulation). RTX 4090: 24 GB GDDR6X at 1,008 GB/s, BF16
        # 165.2 and FP8 330.3 TFLOP/s dense; nvidia-smi 24,564 MiB. RTX 5090: 32 GB GDDR7 at 1,792
        # GB/s, BF16 209.5, FP8 419, FP4 1,676 TFLOP/s dense; nvidia-smi 32,607 MiB; no MX recipe in
        # torchao for sm_120. No NVLink: PCIe Gen4 (4090, 32 GB/s) and Gen5 (5090, 64 GB/s) x16 one
        # way, an upper bound (GeForce drivers disable peer-to-peer, so NCCL stages through the
        # host). Network: assumed one 100 Gb/s NIC per 8-GPU server (1.56 GB/s per GPU), 512 GiB host.
        GPUSpec("rtx-4090-24gb", 24564 * MiB, 165.2e12, 32 * GB, 1.5625 * GB, mem_bw=1.008e12,
                host_memory_bytes=512 * GiB, fp8_flops=330.3e12),
        GPUSpec("rtx-5090-32gb", 32607 * MiB, 209.5e12, 64 * GB, 1.5625 * GB, mem_bw=1.792e12,
                host_memory_bytes=512 * GiB, fp8_flops=419e12, fp4_flops=1676e12),
    )
}

GPU_ALIASES: dict[str, str] = {
    "a100": "a100-80gb", "h100": "h100-80gb", "h100-sxm": "h100-80gb", "h200": "h200-141gb", "l40s": "l40s-48gb",
    "v100": "v100-32gb", "t4": "t4-16gb", "a10g": "a10g-24gb", "l4": "l4-24gb",
    "b200": "b200-180gb", "b300": "b300-270gb", "gb200": "gb200-186gb", "gb200-nvl72": "gb200-186gb",
    "gb300": "gb300-279gb", "gb300-nvl72": "gb300-279gb",
    "mi300x": "mi300x-192gb", "mi325x": "mi325x-256gb", "mi355x": "mi355x-288gb",
    "rtx-4090": "rtx-4090-24gb", "rtx4090": "rtx-4090-24gb", "4090": "rtx-4090-24gb",
    "rtx-5090": "rtx-5090-32gb", "rtx5090": "rtx-5090-32gb", "5090": "rtx-5090-32gb",
}
"""Short names: `--gpu h100` is h100-80gb (the common part where a chip comes in several sizes)."""


def gpu_key(name: str) -> str:
    """A GPU name as the catalogue spells it: lower case, '-' for spaces and '_', an 'nvidia-'/'amd-'
    prefix dropped, a short name resolved (`NVIDIA H100` -> h100-80gb)."""
    key = "-".join(str(name).strip().lower().replace("_", " ").split())
    for prefix in ("nvidia-", "amd-", "instinct-", "geforce-"):
        key = key.removeprefix(prefix)
    return GPU_ALIASES.get(key, key)


_QUIET_ALIASES = ("h100-sxm", "gb200-nvl72", "gb300-nvl72", "rtx4090", "rtx5090", "4090", "5090")
"""Short names accepted but not listed (spellings of a listed one)."""


def gpu_names() -> str:
    """The catalogue's names with their short forms, as `--help` lists them."""
    short_of: dict[str, list[str]] = {}
    for alias, name in GPU_ALIASES.items():
        if alias not in _QUIET_ALIASES:
            short_of.setdefault(name, []).append(alias)
    return ", ".join(f"{n} ({'/'.join(short_of[n])})" if n in short_of else n for n in GPUS)


def get_gpu(name: str) -> GPUSpec:
    """The catalogue entry of `name` (any case, a short name, an 'NVIDIA ' prefix), or one line
    naming the closest names and every valid one."""
    key = gpu_key(name)
    if key in GPUS:
        return GPUS[key]
    known = list(GPUS) + list(GPU_ALIASES)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f": did you mean {close[0]}?" if close else "."
    names = ", ".join(sorted(GPUS))
    aliases = ", ".join(a for a in GPU_ALIASES if a not in _QUIET_ALIASES)
    raise HybridError(f"unknown GPU {short(name)}{hint} Available: {names} (short names: {aliases}); or describe "
                      "one with --gpu-spec FILE.yaml")


GPU_SPEC_KEYS = {"name": "str", "memory": "bytes", "bf16_flops": "FLOP/s", "fp8_flops": "FLOP/s",
                 "memory_bandwidth": "B/s", "scale_up_bandwidth": "B/s", "scale_up_domain": "int",
                 "scale_out_bandwidth": "B/s", "mxfp8_flops": "FLOP/s", "fp4_flops": "FLOP/s", "host_memory": "bytes",
                 "stack": "str"}
"""A --gpu-spec file's keys and what each holds; REQUIRED_GPU_SPEC_KEYS must be there."""
REQUIRED_GPU_SPEC_KEYS = ("name", "memory", "bf16_flops", "memory_bandwidth", "scale_up_bandwidth", "scale_up_domain",
                          "scale_out_bandwidth")
GPU_SPEC_EXAMPLE = {"memory": "96GiB", "FLOP/s": "1.2PFLOP/s", "memory_bandwidth": "4TB/s",
                    "scale_up_bandwidth": "900GB/s", "scale_out_bandwidth": "400Gb/s"}


def load_gpu_spec(path: str) -> GPUSpec:
    """A GPU described in a YAML file (`--gpu-spec`, job key gpu_spec), read through config/files'
    bounded reader; every figure with its unit (`96GiB`, `1.2PFLOP/s`, `4TB/s`, `400Gb/s`: bits),
    each wrong key, missing key or unit one line. scale_up_bandwidth is the datasheet's figure,
    both directions together (NVLink 4: 900GB/s), halved for one; scale_out_bandwidth is a NIC's
    line rate, one direction (NDR: 400Gb/s). Its domain may span nodes (scale_up_domain 72 with
    --gpus-per-node 4: 18 nodes on one fabric). Speed factor: DEFAULT_EFFICIENCY."""
    from .files import read_yaml, key_lines
    doc, text = read_yaml(path, "GPU spec", "a GPU spec is a few lines of figures")
    label = f"GPU spec {str(path)[:200]!r}"
    if not isinstance(doc, dict):
        raise HybridError(f"{label} must be a mapping of keys to figures, e.g. name: my-gpu, memory: 96GiB")
    lines = key_lines(text)
    for k in doc:
        if k not in GPU_SPEC_KEYS:
            where = f"{str(path)[:200]}:{lines.get(k, '?')}"
            raise HybridError(f"{where}: unknown key {short(k)} in a GPU spec. Allowed: {', '.join(GPU_SPEC_KEYS)}")
    missing = [k for k in REQUIRED_GPU_SPEC_KEYS if k not in doc]
    if missing:
        raise HybridError(f"{label} lacks {', '.join(missing)}; a GPU spec needs {', '.join(REQUIRED_GPU_SPEC_KEYS)}")
    v = {k: _spec_value(k, doc[k], f"{str(path)[:200]}:{lines.get(k, '?')}: {k}") for k in doc}
    return GPUSpec(v["name"], v["memory"], v["bf16_flops"], v["scale_up_bandwidth"] / 2, v["scale_out_bandwidth"],
                   mem_bw=v["memory_bandwidth"], fp8_flops=v.get("fp8_flops", 0.0),
                   mxfp8_flops=v.get("mxfp8_flops", 0.0), fp4_flops=v.get("fp4_flops", 0.0),
                   host_memory_bytes=v.get("host_memory", 2048 * GiB), scale_up_domain=v["scale_up_domain"],
                   domain_spans_nodes=True, stack=v.get("stack", "cuda"))


def _spec_value(key: str, value, label: str):
    kind = GPU_SPEC_KEYS[key]
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
            raise HybridError(f"{label} must be a whole number of GPUs (8 on an HGX board, 72 on NVL72), got "
                              f"{short(value)}")
        return value
    if kind == "str":
        if not isinstance(value, str) or not value.strip() or len(value) > 100:
            raise HybridError(f"{label} must be a short name, got {short(value)}")
        if key == "stack" and value not in ("cuda", "rocm"):
            raise HybridError(f"{label} must be cuda or rocm, got {short(value)}")
        return value.strip()
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise HybridError(f"{label} must be a figure with its unit, got {short(value)}")
    example = GPU_SPEC_EXAMPLE.get(key) or GPU_SPEC_EXAMPLE.get(kind) or GPU_SPEC_EXAMPLE["memory"]
    if not isinstance(value, str) or value.strip().replace(".", "", 1).replace("e", "", 1).isdigit():
        raise HybridError(f"{label} {short(value)} has no unit: write it with one, e.g. {key}: {example}")
    if kind == "bytes":
        try:
            return parse_bytes(value, flag=key)
        except HybridError as e:
            raise HybridError(f"{label}: {e}") from None
    return parse_rate(value, label, kind)


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
    scale_up_domain: int | None = None
    """GPUs of one scale-up domain (`--scale-up-domain`): consecutive ranks on one NVLink/NVSwitch
    fabric, a whole number of nodes (72 = one NVL72 rack of 18 trays of 4); None = the GPU's
    (GPUSpec.scale_up_domain where it spans nodes, else the node)."""

    def __post_init__(self):
        for attr in ("nodes", "gpus_per_node"):
            v = getattr(self, attr)
            if not isinstance(v, int) or v < 1:
                raise HybridError(f"{attr} must be a positive integer, got {v!r}")
        if self.headroom is not None and not 0 <= self.headroom <= 4:
            raise HybridError(f"headroom must be a fraction of allocated memory in [0, 4], got {self.headroom!r} "
                              "(0.1 = reserved is 10% above allocated)")
        size, spans = self._domain_setting()
        if spans and size % self.gpus_per_node:
            fits = ", ".join(str(d) for d in range(1, 9) if size % d == 0)
            raise HybridError(f"a scale-up domain of {size} GPUs ({self.gpu.name}) is not a whole number of "
                              f"{self.gpus_per_node}-GPU nodes: use --gpus-per-node {fits} (an NVL72 tray has 4), or "
                              f"--scale-up-domain a multiple of {self.gpus_per_node}")

    def _domain_setting(self) -> tuple[int, bool]:
        """(the domain's GPUs as set, whether it may span nodes)."""
        if self.scale_up_domain is not None:
            if isinstance(self.scale_up_domain, bool) or not isinstance(self.scale_up_domain, int) \
                    or self.scale_up_domain < 1:
                raise HybridError(f"scale_up_domain must be a positive integer of GPUs, got {self.scale_up_domain!r}")
            return self.scale_up_domain, True
        g = self.gpu
        spans = g.domain_spans_nodes and g.scale_up_domain > self.gpus_per_node
        return (g.scale_up_domain, True) if spans else (self.gpus_per_node, False)

    @property
    def domain(self) -> int:
        """GPUs of one scale-up domain in this cluster: consecutive ranks that reach each other over
        the scale-up fabric (intra_node_bw), a whole number of nodes. The node on HGX-class and PCIe
        machines; 72 on NVL72 racks of 4-GPU trays (fewer where the cluster has fewer nodes than a
        rack: the largest whole number of nodes dividing both, so domains tile the world)."""
        size, spans = self._domain_setting()
        if not spans or size <= self.gpus_per_node:
            return self.gpus_per_node
        return self.gpus_per_node * math.gcd(self.nodes, size // self.gpus_per_node)

    @property
    def domains(self) -> int:
        """Scale-up domains in the world (their traffic crosses the scale-out network)."""
        return self.world_size // self.domain

    @property
    def domain_word(self) -> str:
        """How messages name the domain: "node" where it is the node, else "NVLink domain"."""
        return "node" if self.domain == self.gpus_per_node else "NVLink domain"

    def grouped(self, k: int) -> "Cluster":
        """The cluster whose 'GPUs' are groups of k consecutive ranks (tp or ep groups): a group
        of its ranks takes one rank from each of k-rank groups, so it is priced and laid out as a
        group of these. Its domain is the domain's k-rank groups (1 where k spans domains)."""
        if k == 1:
            return self
        per = self.gpus_per_node
        if per % k == 0:
            return replace(self, gpus_per_node=per // k, scale_up_domain=self.domain // k)
        if k % per == 0 and self.nodes % (k // per) == 0:
            return replace(self, nodes=self.nodes // (k // per), gpus_per_node=1,
                           scale_up_domain=max(self.domain // k, 1))
        raise HybridError(f"a group of {k} ranks neither divides the {per} GPUs per node nor is a whole number of "
                          "nodes")

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
              headroom: float | None = None, expandable_segments: bool | None = None,
              gpu_spec: str | None = None, scale_up_domain: int | None = None) -> "Cluster":
        """The boundary constructor: names and memory strings in, validated Cluster out.
        `expandable_segments` None: what auto_wrap will run with (allocator_expandable()).
        `gpu_spec`: a YAML file describing the GPU (load_gpu_spec), in place of `gpu`. Memory
        strings need their unit (`80GiB`); an int is bytes."""
        if gpu_spec is not None:
            spec = load_gpu_spec(gpu_spec)
        else:
            spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
        if gpu_memory is not None:
            spec = replace(spec, memory_bytes=parse_bytes(gpu_memory, flag="--gpu-memory"))
        if host_memory is not None:
            spec = replace(spec, host_memory_bytes=parse_bytes(host_memory, flag="--host-memory"))
        if expandable_segments is None:
            expandable_segments = allocator_expandable()
        return cls(nodes=nodes, gpus_per_node=gpus_per_node, gpu=spec, expandable_segments=expandable_segments,
                   headroom=headroom, scale_up_domain=scale_up_domain)

    def describe(self) -> str:
        domain = f", NVLink domains of {self.domain} GPUs" if self.domain != self.gpus_per_node else ""
        stack = f", {self.gpu.software}/{self.gpu.collectives}" if self.gpu.stack != "cuda" else ""
        return (f"{self.nodes} node(s) x {self.gpus_per_node} {self.gpu.name} "
                f"({fmt_bytes(self.gpu.memory_bytes)} each, world size {self.world_size}{domain}{stack})")


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


def detect(gpu_memory: str | int | None = None, world: int | None = None, local: int | None = None) -> Cluster:
    """The live machine: its CUDA GPUs (matched to the catalogue by name and size) or its CPU.

    World shape: `world` ranks, `local` per node, as given (the ranks a command is about to start), else
    torchrun's variables when present (WORLD_SIZE, LOCAL_WORLD_SIZE). On a CPU machine the 'GPU' is the
    host memory split between the local ranks.
    """
    import torch

    world = world if world is not None else int(os.environ.get("WORLD_SIZE", "1"))
    local = local if local is not None else int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
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
    families = (("gb300", "gb300"), ("gb200", "gb200"), ("b300", "b300"), ("b200", "b200"), ("h200", "h200"),
                ("h100", "h100"), ("a100", "a100"), ("l40s", "l40s"), ("a10", "a10g"), ("l4", "l4-"),
                ("v100", "v100"), ("t4", "t4-"), ("mi300x", "mi300x"), ("mi325x", "mi325x"), ("mi355x", "mi355x"),
                ("4090", "rtx-4090"), ("5090", "rtx-5090"))
    family = next((prefix for sub, prefix in families if sub in low), None)
    candidates = [g for g in GPUS.values() if family and g.name.startswith(family)]
    if not candidates:
        # Unknown GPU: keep its real memory; speed from the H100 entry is only a placeholder for
        # the cost model, and the name says so.
        base = GPUS["h100-80gb"]
        return replace(base, name=f"{device_name} (speed assumed h100)", memory_bytes=total_memory)
    best = min(candidates, key=lambda g: abs(g.memory_bytes - total_memory))
    return replace(best, memory_bytes=total_memory)
