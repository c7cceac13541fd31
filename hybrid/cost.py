"""Step time of a strategy on a cluster: compute, plus the communication that compute cannot hide.

compute   model FLOPs per token (PaLM, arXiv 2204.02311 App. B): 6P + 12*L*h*s for forward and
          backward; full recomputation adds one more forward (8P + 16Lhs); run at `efficiency`
          x the GPU's dense bf16 peak (fp32 uses TF32 tensor cores at half that rate).
comm      ring collectives (Patarasuk & Yuan 2009; NCCL's ring): all-reduce moves 2(n-1)/n x S
          bytes per GPU, all-gather and reduce-scatter (n-1)/n x S each, at the bandwidth of the
          slowest link the ring crosses (NVLink inside a node, the NIC across nodes), plus a
          latency of alpha x log2(n) per collective (NCCL's tree/ring start-up). Per family:
            ddp    all-reduce of the gradients over the world (bucketed, in backward)
            fsdp   all-gather params in forward and again in backward (unless kept), reduce-scatter
                   grads within the shard group; hybrid adds an all-reduce of the shard across
                   replicas
            zero1/2 reduce-scatter grads in backward, all-gather the updated params after the step
            zero3  as fsdp over the world; hpZ re-gathers in backward inside the node
copies    packing into and out of communication buffers (FSDP2's all-gather copy-in/copy-out and
          reduce-scatter chunk_cat, DeepSpeed's flat buckets, DDP buckets unless grads are bucket
          views): read + write of those bytes at the device memory bandwidth, not hidden.
overlap   collectives issued during forward/backward hide behind that phase's compute up to
          `comm_overlap` (separate CUDA streams: 1.0; CPU gloo ranks share cores: 0); one unit's
          all-gather before the first block and the last reduce-scatter never hide; DeepSpeed's
          post-step all-gather (zero1/2) never hides.
offload   PCIe transfers of what moves between host and GPU, and the host optimizer step at
          `host_step_rate` parameters per second.
step      the optimizer step on the GPU is memory-bound: it reads and writes each local parameter,
          its gradient and its states once, at the device memory bandwidth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .catalogue import Strategy
from .cluster import Cluster
from .profile import ModelProfile
from .spec import TrainSpec

LATENCY_INTRA = 10e-6
"""Seconds per log2(n) step of a collective inside a node (NCCL over NVLink, order of 10 us)."""
LATENCY_INTER = 25e-6
"""... across nodes (InfiniBand/RoCE, a few times the NVLink latency)."""
PCIE_BW = 25e9
"""Host<->GPU bytes/s per direction (PCIe Gen4 x16 sustained; Gen5 about twice)."""
HOST_STEP_RATE = 1.0e9
"""Parameters per second an optimizer step runs at on the host (DeepSpeedCPUAdam-class AVX code
on a many-core server; torch's CPU AdamW is slower)."""
SELECTIVE_RECOMPUTE = 0.05
"""Extra step time of selective checkpointing: norms and pointwise ops recomputed in backward are
memory-bound, a few percent of the step (Korthikanti et al. 2022, Table 4: 2.7-4% for theirs)."""
EFFICIENCY = 0.45
"""Fraction of dense peak FLOP/s a well-tuned transformer step reaches (MFU of 40-50% reported
for 7B-70B dense training on A100/H100 by Megatron-LM and torchtitan)."""


@dataclass(frozen=True)
class StepCost:
    seconds: float
    compute_s: float
    comm_s: float
    """All communication time, hidden or not."""
    exposed_comm_s: float
    offload_s: float
    optimizer_s: float
    """The optimizer step on the GPU (memory-bound)."""
    tokens_per_s_per_gpu: float
    mfu: float
    """Model FLOPs utilisation: model FLOPs per step / (step time x peak)."""

    def to_dict(self) -> dict:
        return {"step_time_s": self.seconds, "compute_s": self.compute_s, "comm_s": self.comm_s,
                "exposed_comm_s": self.exposed_comm_s, "offload_s": self.offload_s,
                "optimizer_s": self.optimizer_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu}


def model_flops_per_token(profile: ModelProfile, seq_len: int, recompute: bool = False) -> float:
    """Training FLOPs per token (forward + backward), PaLM's 6N + 12LHQT; +1 forward if recomputed."""
    d = profile.decoder
    attn = 12 * d.layers * d.hidden * seq_len if d else 0
    base = 6 * profile.params + attn
    return base * (8 / 6) if recompute else base


def _ring(kind: str, nbytes: float, n: int, bw: float) -> float:
    if n <= 1:
        return 0.0
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return factor * nbytes / bw


class _Links:
    def __init__(self, cluster: Cluster):
        self.c = cluster

    def bw(self, n: int) -> float:
        """A group of n consecutive ranks stays inside a node if n <= GPUs per node."""
        g = self.c.gpu
        return g.intra_node_bw if n <= self.c.gpus_per_node else g.inter_node_bw

    def latency(self, n: int) -> float:
        if n <= 1:
            return 0.0
        lat = LATENCY_INTRA if n <= self.c.gpus_per_node else LATENCY_INTER
        return lat * math.log2(n)

    def collective(self, kind: str, nbytes: float, n: int, count: int = 1) -> float:
        """`count` collectives moving `nbytes` in total over groups of n ranks."""
        return _ring(kind, nbytes, n, self.bw(n)) + count * self.latency(n)

    def across_replicas(self, kind: str, nbytes: float, replicas: int, count: int = 1) -> float:
        """Replica groups take one rank from each shard group: always across nodes when > 1 node."""
        if replicas <= 1:
            return 0.0
        inter = self.c.nodes > 1
        bw = self.c.gpu.inter_node_bw if inter else self.c.gpu.intra_node_bw
        lat = LATENCY_INTER if inter else LATENCY_INTRA
        return _ring(kind, nbytes, replicas, bw) + count * lat * math.log2(replicas)


def step_cost(strategy: Strategy, profile: ModelProfile, spec: TrainSpec, cluster: Cluster,
              shard_size: int, efficiency: float = EFFICIENCY) -> StepCost:
    g, W, N = cluster.gpu, cluster.world_size, shard_size
    R = W // N
    P = profile.trainable_params
    T = spec.micro_batch * spec.seq_len
    recompute = spec.activation_checkpointing == "full"
    flops = model_flops_per_token(profile, spec.seq_len, recompute) * T
    peak = g.bf16_flops * (0.5 if spec.precision == "fp32" else 1.0)
    compute = flops / (peak * efficiency)
    if spec.activation_checkpointing == "selective":
        compute *= 1 + SELECTIVE_RECOMPUTE
    fwd_c, bwd_c = compute / 3, 2 * compute / 3       # backward costs twice the forward
    if recompute:
        fwd_c, bwd_c = compute / 4, 3 * compute / 4
    c = spec.bytes.compute
    units = max(profile.num_blocks, 1) + 1            # blocks + the root
    link = _Links(cluster)
    fwd, bwd, tail, after_step, offload, copied = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    unit_bytes = c * (profile.block_params or profile.params)

    if strategy.family == "ddp":
        grad_bytes = P * spec.bytes.grad
        buckets = max(1, math.ceil(grad_bytes / (strategy.bucket_cap_mb * 1e6)))
        bwd = link.collective("all_reduce", grad_bytes, W, buckets)
        tail = bwd / buckets
        copied = 0.0 if strategy.gradient_as_bucket_view or W == 1 else 2 * grad_bytes
    elif strategy.family == "fsdp":
        rb = 4 if spec.precision != "bf16" else 2      # reduce-scatter in fp32 (reduce_dtype)
        ag = link.collective("all_gather", c * P, N, units)
        fwd = ag
        bwd = (ag if strategy.reshard_after_forward else 0.0) + link.collective("reduce_scatter", rb * P, N, units)
        bwd += link.across_replicas("all_reduce", rb * P / N, R, units)
        tail = link.collective("all_gather", unit_bytes, N) + link.collective("reduce_scatter", unit_bytes, N)
        gathers = 2 if strategy.reshard_after_forward else 1
        copied = gathers * 2 * c * P + 2 * rb * P          # copy-out of each gather, chunk_cat per reduce
        if strategy.offload_params:
            offload = 2 * (spec.bytes.param * P / N) / PCIE_BW + (P / N) / HOST_STEP_RATE
    else:
        if strategy.stage in (1, 2):
            bwd = link.collective("reduce_scatter", c * P, W, units)
            after_step = link.collective("all_gather", c * P, W, 1)
            copied = 2 * c * P                                  # grads into the flat reduce buckets
        else:
            ag = link.collective("all_gather", c * P, W, units)
            hpz = strategy.hpz_size(cluster)
            fwd = ag
            bwd = (link.collective("all_gather", c * P, hpz, units) if hpz else ag)
            bwd += link.collective("reduce_scatter", c * P, W, units)
            tail = link.collective("all_gather", unit_bytes, W) + link.collective("reduce_scatter", unit_bytes, W)
            copied = 2 * 2 * c * P + 2 * c * P                  # two gathers' copy-out, one bucket copy
        if strategy.offload_optimizer:
            # fp32 grads to the host, updated 16-bit params back, and the step on the host
            offload = (4 * P / N + c * P / N) / PCIE_BW + (P / N) / HOST_STEP_RATE
        if strategy.offload_params:
            offload += 2 * (c * P / N) / PCIE_BW
    optimizer = 0.0
    if not strategy.offload_optimizer:
        states = {"adamw": 2, "sgd": 1, "adafactor": 0}[spec.optimizer]
        local = P / (N if strategy.family != "ddp" else 1)
        b = spec.bytes
        step_bytes = 2 * local * (b.param + b.grad + states * b.state)
        if strategy.family == "deepspeed":                # fp32 master -> 16-bit params as well
            step_bytes += local * (4 + c)
        optimizer = step_bytes / g.mem_bw
    hidden = g.comm_overlap
    exposed = (max(fwd - hidden * fwd_c, fwd * (1 - hidden)) + max(bwd - hidden * bwd_c, bwd * (1 - hidden))
               + tail * hidden + after_step)
    exposed = max(exposed, 0.0) + (copied / g.mem_bw if W > 1 else 0.0)
    seconds = compute + exposed + offload + optimizer
    return StepCost(seconds=seconds, compute_s=compute, comm_s=fwd + bwd + after_step, exposed_comm_s=exposed,
                    offload_s=offload, optimizer_s=optimizer, tokens_per_s_per_gpu=T / seconds,
                    mfu=model_flops_per_token(profile, spec.seq_len) * T / (seconds * g.bf16_flops))
