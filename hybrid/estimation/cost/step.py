"""Time of one optimizer step (gradient_accumulation micro-batches): compute, plus the
communication that compute cannot hide.

compute   model FLOPs per token (PaLM, arXiv 2204.02311 App. B): 6P + 12*L*h*s for forward and
          backward; full recomputation adds one more forward (8P + 16Lhs); run at `efficiency`
          x the GPU's dense 16-bit peak (fp32 uses TF32 tensor cores at half that rate); plus the
          memory-bound elementwise ops between the matmuls (norms, rotary, activations, residual
          adds, the loss's softmax) at the HBM bandwidth: op by op in eager, fused under
          torch.compile (hybrid/estimation/cost/elementwise.py), run again where checkpointing recomputes.
comm      each family's collectives (hybrid/families/*: `comm`), priced by hybrid/estimation/cost/links.py:
            ddp    all-reduce of the gradients over the world (bucketed), once per window
            fsdp   all-gather params in every forward and again in backward (unless kept),
                   reduce-scatter grads within the shard group once per window; hybrid sharding
                   adds an all-reduce of the shard across replicas
            zero1  reduce-scatter grads once per window, all-gather the updated params after
            zero2  reduce-scatter grads in every micro-batch (partitioned gradients), all-gather after
            zero3  as fsdp over the world, reduce-scatter every micro-batch; hpZ re-gathers in
                   backward inside the node
copies    packing into and out of communication buffers (FSDP2's all-gather copy-in/copy-out and
          reduce-scatter chunk_cat, DeepSpeed's flat buckets, DDP buckets unless grads are bucket
          views): read + write of those bytes at the device memory bandwidth, not hidden.
overlap   collectives issued during forward/backward hide behind that phase's compute up to
          `comm_overlap` (separate CUDA streams: 1.0; CPU gloo ranks share cores: 0); one unit's
          all-gather before the first block and the last reduce-scatter never hide; DeepSpeed's
          post-step all-gather (zero1/2) never hides.
offload   PCIe transfers of what moves between host and GPU, and the host optimizer step.
pipeline  (pp > 1, hybrid/layout/pipeline.py) the busiest rank's share of the FLOPs per micro-batch, run
          m + (pp - 1) / v times (the bubble: pp - 1 idle slots of a stage's micro-batch time,
          v times shorter interleaved; arXiv 2104.04473 sec. 2.2); point-to-point sends of the
          b x s x h boundary activation forward and its gradient backward per micro-batch, on
          the link between stages (the NIC when stages are whole nodes), unhidden while the
          pipeline fills and drains and hidden behind compute in between up to `comm_overlap`;
          the data-parallel terms are the stage's (its parameters, over the stage's ranks).
moe       (ep > 1, expert_parallel_terms) two all-to-alls per MoE layer in forward (dispatch,
          combine) and two in backward, on the links they cross, unhidden; the busiest rank's
          experts compute --moe-imbalance x the mean while the others wait at the combine; the
          experts' FSDP traffic runs over their expert_shard ranks, the dense parts' over all.
host      (hybrid/families/host.py) collective calls and per-parameter-tensor operations per step, each
          at a fixed host time (GPUSpec.collective_overhead, tensor_overhead): 0 in the
          catalogue, fitted by a calibration from measured trials.
step      the optimizer step on the GPU is memory-bound: it reads and writes each local parameter,
          its gradient and its states once, at the device memory bandwidth.
ft        (--fault-tolerant, hybrid/runtime/ft.py) each dp_replicate group is a torchft replica group:
          the data-parallel family runs inside one group (FSDP over dp_shard, no HSDP all-reduce of
          its own); after the window's last backward torchft all-reduces the rank's gradient shard
          (reduce dtype, P / dp_shard elements, one flat buffer) across the R groups, one rank of
          each (replicas: one NIC per ring; DDP's groups of one rank are consecutive ranks), not
          hidden behind compute (it starts when backward has ended); plus QUORUM_S per step for
          the quorum and the commit vote.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...families.catalogue import Strategy
from ...memo import memoised
from ...config.cluster import Cluster
from ...layout.layout import Layout, as_layout
from .links import Links
from ...families.placement import optimizer_state_bytes
from ...layout.pipeline import stage_cluster
from ...model.lora import with_lora
from ...model.profile import ModelProfile
from ..shares import Share, shares
from ...config.spec import TrainSpec

QUORUM_S = 0.0022
"""Seconds per step of torchft's synchronous quorum (start_quorum, 1.81 ms) and commit vote
(should_commit, 0.42 ms): the fastest of 120 steps on loopback, benchmarks/ft_quorum.py
(benchmarks/results/ft_quorum.md), the RPCs' floor (the medians there are this loaded machine's
scheduling); a cluster's network round trips come on top."""

SELECTIVE_RECOMPUTE = 0.05
"""Extra step time of selective checkpointing: norms and pointwise ops recomputed in backward are
memory-bound, a few percent of the step (Korthikanti et al. 2022, Table 4: 2.7-4% for theirs)."""


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
    bubble_s: float = 0.0
    """Pipeline idle time of the step (pp > 1)."""
    all_to_all_s: float = 0.0
    """Expert parallelism (ep > 1): the step's all-to-alls, none hidden (in exposed_comm_s)."""
    straggler_s: float = 0.0
    """Expert parallelism: the busiest rank's extra expert compute of the step (in compute_s)."""
    host_s: float = 0.0
    """Host work per step: collective calls and per-tensor operations at the GPU's
    collective_overhead and tensor_overhead (0 unless a calibration fitted them)."""
    fault_tolerance_s: float = 0.0
    """--fault-tolerant: torchft's all-reduce of the gradients across replica groups (in
    exposed_comm_s) plus the step's quorum and vote (QUORUM_S)."""

    @property
    def time_per_token(self) -> float:
        """GPU-seconds per training token: what the planner ranks by (a step's seconds are not
        comparable across tensor-parallel degrees, whose tp ranks share one micro-batch)."""
        return 1.0 / self.tokens_per_s_per_gpu

    def to_dict(self) -> dict:
        return {"step_time_s": self.seconds, "compute_s": self.compute_s, "comm_s": self.comm_s,
                "exposed_comm_s": self.exposed_comm_s, "offload_s": self.offload_s,
                "optimizer_s": self.optimizer_s, "bubble_s": self.bubble_s, "host_s": self.host_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                **({"all_to_all_s": self.all_to_all_s, "straggler_s": self.straggler_s} if self.all_to_all_s else {}),
                **({"fault_tolerance_s": self.fault_tolerance_s} if self.fault_tolerance_s else {})}


def model_flops_per_token(profile: ModelProfile, seq_len: int, recompute: bool = False) -> float:
    """Training FLOPs per token (forward + backward): a decoder's from its anatomy
    (DecoderConfig.flops_per_token: the matmuls a token passes through, an MoE block's top-k experts
    of its E, and each layer's attention; PaLM's 6N + 12LHQT, arXiv 2204.02311 App. B, for a dense
    decoder), 6 per parameter for any other model; +1 forward if recomputed. A frozen weight (a LoRA
    base) costs its forward (2 per weight) and its input's gradient (2) but no weight gradient, the
    attention's core costs all three; this is the MFU reported."""
    return _flops_per_token(profile, seq_len, recompute)


@memoised               # the cost model asks it for every pipeline rank of every candidate
def _flops_per_token(profile: ModelProfile, seq_len: int, recompute: bool) -> float:
    return forward_flops_per_token(profile, seq_len) * (1 if recompute else 0) + _train_flops(profile, seq_len)


def forward_flops_per_token(profile: ModelProfile, seq_len: int) -> float:
    """One forward's FLOPs per token: the decoder's third of flops_per_token and 2 per adapter weight
    (LoRA: the parameters beside a frozen decoder); 2 per parameter for any other model."""
    d = profile.decoder
    if d is None:
        return 2 * profile.params
    return d.flops_per_token(seq_len) / 3 + 2 * _adapters(profile)


def _adapters(profile: ModelProfile) -> int:
    """Trainable weights outside the decoder's own count: a LoRA model's adapters (0 without frozen weights)."""
    d = profile.decoder
    return max(profile.params - d.params, 0) if profile.trainable_params < profile.params else 0


def _train_flops(profile: ModelProfile, seq_len: int) -> float:
    d = profile.decoder
    if d is None:
        return 4 * profile.params + 2 * profile.trainable_params
    fwd = d.flops_per_token(seq_len) / 3
    frozen = min(profile.params - profile.trainable_params, d.params) / d.params
    return 3 * fwd - frozen * (fwd - d.attention_flops(seq_len)) + 6 * _adapters(profile)


def dequantize_seconds(profile: ModelProfile, spec: TrainSpec, gpu) -> float:
    """One micro-batch's dequantisation of a quantised base (QLoRA): each linear's packed weight
    is read and written back in the compute dtype for its matmul in forward, again in backward
    (bitsandbytes' MatMul4Bit), and in a recomputed forward; memory-bound, at the HBM bandwidth."""
    if not profile.quantized_params:
        return 0.0
    passes = 2 + (spec.activation_checkpointing == "full")
    return passes * (profile.quantized_bytes + spec.bytes.compute * profile.quantized_params) / gpu.mem_bw


def tp_comm_seconds(profile: ModelProfile, spec: TrainSpec, cluster: Cluster, tp: int) -> float:
    """Tensor parallelism with sequence parallelism, per micro-batch: in each block's forward two
    all-gathers (attention and MLP inputs) and two reduce-scatters (their outputs) of the b x s x h
    activation inside the tp group, the same again in backward (Korthikanti et al. 2022, sec. 4.2.2).
    On the critical path: each waits for the matmul before it (no async TP modelled)."""
    if tp == 1 or profile.decoder is None:
        return 0.0
    d = profile.decoder
    nbytes = spec.bytes.compute * spec.micro_batch * spec.seq_len * d.hidden
    return 8 * d.layers * Links(cluster).collective("all_gather", nbytes, tp)


def cp_comm_seconds(profile: ModelProfile, spec: TrainSpec, cluster: Cluster, tp: int, cp: int) -> float:
    """Context parallelism, per micro-batch: every layer all-gathers the sequence's K and V over
    the cp group in forward, reduce-scatters their gradients in backward, and gathers again when
    the block is recomputed (hybrid/estimation/memory/cp.py); issued synchronously by the runtime, so none of
    it hides. A cp group is cp ranks tp apart: inside a scale-up domain while cp x tp fits in one
    (NVLink), else over the NICs (Links on a cluster of tp groups, as the data-parallel terms are priced)."""
    if cp == 1 or profile.decoder is None:
        return 0.0
    from ..memory.cp import kv_collectives_per_layer, kv_exchange_bytes
    groups = cluster.grouped(tp)
    one = Links(groups).collective("all_gather", kv_exchange_bytes(profile.decoder, spec, tp), cp)
    return kv_collectives_per_layer(spec) * profile.decoder.layers * one


def busiest_share(profile: ModelProfile, layout: Layout, spec: TrainSpec) -> Share:
    """The rank's share with the most FLOPs per token: the pipeline rank's with the most (its
    blocks, and the head on the last), the only one without stages."""
    ranks = [shares(profile, layout, spec, r) for r in range(layout.dims.pp)]
    return max(ranks, key=lambda sh: model_flops_per_token(sh.held, spec.seq_len))


def recompute_fraction(profile: ModelProfile, spec: TrainSpec) -> float:
    """Extra compute of the partial checkpointing modes, as a fraction of the step (full
    checkpointing's extra forward is in model_flops_per_token): selective recomputes pointwise ops
    (SELECTIVE_RECOMPUTE); op also the matmuls it does not keep (llama: k, o and up of q, k, v, o,
    gate, up, down; gpt2: all four); layer:N one forward of every N-th block. A forward is a third
    of the step's FLOPs."""
    from ..memory.activations import checkpointed_blocks
    from ...config.spec import layer_every
    mode, d = spec.activation_checkpointing, profile.decoder
    if mode == "selective":
        return SELECTIVE_RECOMPUTE if d is None else 0.0   # a decoder's recomputed pointwise ops: elementwise_seconds
    if mode == "op":
        if d is None:
            return SELECTIVE_RECOMPUTE
        h, kv, f = d.hidden, d.kv_dim, d.ffn
        redone = (kv + h + f) / (2 * h + 2 * kv + 3 * f) if d.style == "llama" else 1.0
        return redone / 3
    every = layer_every(mode)
    if every is not None and d is not None:
        return checkpointed_blocks(d.layers, every) / d.layers / 3
    return 0.0


def elementwise_seconds(profile: ModelProfile, spec: TrainSpec, gpu, tp: int = 1, has_head: bool = True) -> float:
    """One micro-batch's memory-bound elementwise traffic (hybrid/estimation/cost/elementwise.py) on this rank:
    every block's forward and backward, its forward again where checkpointing recomputes it, and
    the loss where the rank holds the head; split tp ways (sequence parallelism and sharded heads),
    at the GPU's HBM bandwidth."""
    from .elementwise import block_bytes, loss_bytes
    from ..memory.activations import checkpointed_blocks
    from ...config.spec import layer_every
    d = profile.decoder
    if d is None:
        return 0.0
    c = spec.bytes.compute
    fwd, bwd = block_bytes(d, c, spec.compile)
    mode = spec.activation_checkpointing
    every = layer_every(mode)
    redone = 0 if mode == "none" else (checkpointed_blocks(d.layers, every) if every else d.layers)
    total = d.layers * (fwd + bwd) + redone * fwd
    if spec.float8:
        from .elementwise import float8_cast_bytes
        total += d.layers * float8_cast_bytes(d, c, spec.float8_recipe)
    if has_head:
        lf, lb = loss_bytes(d.vocab, c, spec.compile, spec.loss, tp > 1)
        total += lf + lb
    return spec.micro_batch * spec.seq_len * total / tp / gpu.mem_bw


def p2p_seconds(profile: ModelProfile, spec: TrainSpec, cluster: Cluster, tp: int, layout) -> float:
    """Exposed point-to-point time of one step: per micro-batch and boundary the b x s x h
    activation forward and its gradient backward (a tp rank sends its 1/tp share), over the NIC
    when the cluster has several scale-up domains (some stage boundary crosses one), else NVLink."""
    if layout is None or layout.pp == 1 or profile.decoder is None:
        return 0.0
    from .links import LATENCY_INTER, LATENCY_INTRA
    nbytes = spec.bytes.compute * spec.micro_batch * spec.seq_len * profile.decoder.hidden / tp
    inter = cluster.domains > 1
    g = cluster.gpu
    one = nbytes / (g.inter_node_bw if inter else g.intra_node_bw) + (LATENCY_INTER if inter else LATENCY_INTRA)
    m = layout.micro_batches * layout.virtual
    fill_drain = 2 * (layout.pp - 1) * one                # on the critical path
    steady = 2 * max(m - 1, 0) * one * (1 - g.comm_overlap)
    return fill_drain + steady


NS_STEPS = 5
"""Newton-Schulz iterations of torch.optim.Muon (DEFAULT_NS_STEPS, Keller Jordan's recipe)."""


def muon_step_seconds(profile: ModelProfile, cluster: Cluster, n: int, flops_per_s: float) -> float:
    """What Muon adds to the optimizer step: each block matrix (r = min, c = max of its sides)
    orthogonalised in bf16 by NS_STEPS iterations of X X^T (2 r^2 c FLOPs), its quintic polynomial
    (2 r^3) and the product with X (2 r^2 c), every rank of a shard group computing every matrix
    whole; and the gather of each whole matrix's update (bf16) over the n ranks that shard it."""
    d = profile.decoder
    if d is None:
        return 0.0
    mats = [m for m in d.block_matrices() if len(m) == 2]
    flops = d.layers * NS_STEPS * sum(4 * min(m) ** 2 * max(m) + 2 * min(m) ** 3 for m in mats)
    gathered = 0.0 if n == 1 else Links(cluster).collective("all_gather", 2 * d.layers * sum(a * b for a, b in mats),
                                                              n, d.layers * len(mats))
    return flops / flops_per_s + gathered


def step_cost(layout: Layout | Strategy, profile: ModelProfile, spec: TrainSpec, cluster: Cluster,
              efficiency: float | None = None) -> StepCost:
    """With tp > 1 each rank computes 1/tp of the FLOPs, the families' data-parallel traffic is
    priced on the rank's tensor-parallel share over groups of tp groups (a cluster whose 'GPUs' are
    tp groups), and the tp collectives are added, unhidden. With a pipeline layout (pp > 1) the
    busiest rank's share of the model and the stage's ranks take their place, and the bubble and
    point-to-point sends are added. With cp > 1 each rank computes 1/cp of every sequence's
    FLOPs (the chunk layout balances the causal attention), FSDP's shard group is dp_shard x cp,
    and the K/V exchange (cp_comm_seconds) is added, unhidden. A bare Strategy stands for its
    layout on the cluster (Layout.of)."""
    profile = with_lora(profile, spec.lora)
    layout = as_layout(layout, cluster, spec)
    spec = layout.train_spec(spec)
    strategy, shard_size, tp, cp, pp, ep = (layout.dp, layout.dims.dp_shard, layout.dims.tp, layout.dims.cp,
                                            layout.dims.pp, layout.dims.ep)
    pipe = layout.pipeline
    efficiency = efficiency or cluster.gpu.efficiency
    whole = profile
    p2p = p2p_seconds(profile, spec, cluster, tp, pipe)
    cluster = stage_cluster(cluster, pp)
    sh = busiest_share(profile, layout, spec)
    g, N = cluster.gpu, shard_size * cp
    stage, profile = sh.held, sh.profile
    tp_time = tp_comm_seconds(stage, sh.spec, cluster, tp) + cp_comm_seconds(stage, spec, cluster, tp, cp)
    cluster = cluster.grouped(tp)
    W = cluster.world_size
    T = spec.micro_batch * spec.seq_len
    recompute = spec.activation_checkpointing == "full"
    flops = model_flops_per_token(stage, spec.seq_len, recompute) * T / tp / cp
    # fp32 matmuls run on TF32 tensor cores at half the dense bf16 rate (A100 datasheet: 156 vs
    # 312 TFLOP/s; H100 SXM: 495 vs 989); V100/T4 have no TF32, an upper bound there
    peak = g.bf16_flops * (0.5 if spec.precision == "fp32" else 1.0)
    compute = flops / (peak * efficiency)
    if spec.loss == "chunked" and sh.has_head and stage.decoder is not None:
        # the chunked loss recomputes each chunk's head matmul in backward (hybrid/runtime/loss.py)
        compute += 2 * stage.decoder.vocab * stage.decoder.hidden * T / tp / cp / (peak * efficiency)
    from ..float8 import float8_peak
    peak8 = float8_peak(g, spec)
    if spec.float8 and stage.decoder is not None and peak8:
        # the converted block linears (6 FLOPs per weight per token) at the recipe's peak instead
        from ..float8 import linear_params
        lin = 6 * linear_params(stage.decoder) * T / tp / cp * (8 / 6 if recompute else 1)
        compute -= lin / (peak * efficiency) - lin / (peak8 * efficiency)
    compute *= 1 + recompute_fraction(stage, spec)
    compute += elementwise_seconds(stage, sh.spec, g, tp, sh.has_head)     # a cp rank streams S / cp tokens
    compute += dequantize_seconds(profile, sh.spec, g)
    # the forward's share of the compute: a third (backward costs twice the forward), a quarter
    # with recomputation; a LoRA base's backward makes no weight gradients, so about a half
    fwd_share = forward_flops_per_token(stage, spec.seq_len) / model_flops_per_token(stage, spec.seq_len, recompute)
    fwd_c, bwd_c = fwd_share * compute, (1 - fwd_share) * compute
    ft_comm = 0.0
    if spec.fault_tolerant:     # the family runs inside one replica group; torchft reduces across them
        cluster, ft_comm = fault_tolerant_terms(profile, spec, cluster, N)
    comm = strategy.family_obj.comm(strategy, profile, spec, cluster, N, Links(cluster))
    moe_s = straggler = 0.0
    if ep > 1:
        comm, straggler, moe_s = expert_parallel_terms(strategy, profile, spec, cluster, N, ep, peak * efficiency,
                                                        cp)
        compute += straggler
        fwd_c, bwd_c = fwd_share * compute, (1 - fwd_share) * compute
    fam = strategy.family_obj
    P = profile.trainable_params
    optimizer = 0.0
    if not strategy.config.optimizer_on_host:
        local = P / (N if fam.sharded_optimizer(strategy) else 1)
        b = spec.bytes
        step_bytes = 2 * (local * (b.param + b.grad) + optimizer_state_bytes(profile, spec) * local / P)
        if fam.keeps_master_copy:                       # fp32 master -> 16-bit params as well
            step_bytes += local * (4 + spec.bytes.compute)
        optimizer = step_bytes / g.mem_bw
        if spec.optimizer == "muon":
            optimizer += muon_step_seconds(profile, cluster, N if fam.sharded_optimizer(strategy) else 1,
                                           peak * efficiency)
    hidden = g.comm_overlap

    def exposed(fwd: float, bwd: float) -> float:
        return max(fwd - hidden * fwd_c, fwd * (1 - hidden)) + max(bwd - hidden * bwd_c, bwd * (1 - hidden))

    ga = spec.gradient_accumulation
    micro = exposed(comm.fwd, comm.bwd) + comm.tail * hidden
    last = exposed(comm.fwd, comm.bwd + comm.sync_bwd) + (comm.tail + comm.sync_tail) * hidden
    copies = (ga * comm.copied_micro + comm.copied_sync) / g.mem_bw if W > 1 else 0.0
    exposed_s = max((ga - 1) * micro + last + comm.after_step, 0.0) + copies + ga * (tp_time + moe_s) + p2p + ft_comm
    ft_s = ft_comm + QUORUM_S if spec.fault_tolerant else 0.0
    bubble_s = (pp - 1) / pipe.virtual * (compute + tp_time) if pp > 1 else 0.0
    host_s = 0.0
    if g.collective_overhead or g.tensor_overhead:      # hybrid/families/host.py; 0 in the catalogue
        host = fam.host(strategy, profile, spec, cluster, N, sh.stage)
        host_s = host.calls * g.collective_overhead + host.tensors * g.tensor_overhead
    seconds = ga * compute + bubble_s + exposed_s + comm.offload + optimizer + host_s + (ft_s - ft_comm)
    tokens = ga * T / tp / pp / cp             # tp, cp groups and a pipeline share their micro-batches
    return StepCost(seconds=seconds, compute_s=ga * compute, bubble_s=bubble_s,
                    comm_s=(ga * comm.fwd + (ga * comm.bwd + comm.sync_bwd) + comm.after_step + ga * (tp_time + moe_s)
                            + p2p + ft_comm),
                    exposed_comm_s=exposed_s, offload_s=comm.offload, optimizer_s=optimizer, host_s=host_s,
                    tokens_per_s_per_gpu=tokens / seconds, all_to_all_s=ga * moe_s, straggler_s=ga * straggler,
                    fault_tolerance_s=ft_s,
                    mfu=model_flops_per_token(whole, spec.seq_len) * tokens / (seconds * g.bf16_flops))


def fault_tolerance_problem(layout: Layout):
    """NotApplicable when --fault-tolerant cannot run this layout (hybrid/runtime/ft.py): one
    replica group is the whole job (dp_replicate 1: nothing to fail over to), its family reduces
    gradients inside its own library, or it has pipeline stages. None when it can."""
    from ...errors import NotApplicable
    d = layout.dims
    if not layout.dp.family_obj.fault_tolerant:
        return NotApplicable(f"--fault-tolerant: {layout.dp.name} reduces its gradients inside its own library; "
                             "torchft averages gradients that torch's DDP or FSDP2 reduced within a replica group")
    if d.dp_replicate == 1:
        return NotApplicable("--fault-tolerant: dp_replicate 1 is one replica group, nothing to fail over to; "
                             "replicate over groups of ranks (a shard size below the world)")
    if d.pp > 1:
        return NotApplicable(f"--fault-tolerant with pp {d.pp}: torchft's quorum and all-reduce do not wrap a "
                             "pipeline's schedule here; use pp 1", "pp")
    return None


def fault_tolerant_terms(profile: ModelProfile, spec: TrainSpec, cluster: Cluster, n: int):
    """(the cluster of one replica group, the seconds of torchft's gradient all-reduce across the
    groups) for a rank whose family shards over n ranks (the docstring's `ft`). A group of whole
    nodes is those nodes; a smaller one is one node's n GPUs."""
    from ...families.placement import reduce_bytes
    per = cluster.gpus_per_node
    replicas = cluster.world_size // n
    group = replace(cluster, nodes=n // per) if n >= per else replace(cluster, nodes=1, gpus_per_node=n)
    nbytes = reduce_bytes(spec) * profile.trainable_params / n
    links = Links(cluster)
    if n == 1:           # groups of one rank (ddp): the ring runs over consecutive ranks, NICs side by side
        return group, links.collective("all_reduce", nbytes, replicas)
    return group, links.across_replicas("all_reduce", nbytes, replicas)


def expert_parallel_terms(strategy: Strategy, profile: ModelProfile, spec: TrainSpec, cluster: Cluster, N: int,
                          ep: int, flops_per_s: float, cp: int = 1):
    """What ep > 1 changes in one micro-batch: (the family's Comm, the straggler's extra compute
    seconds, the all-to-all seconds).

    Comm: the dense parts' collectives over the N = dp_shard x cp ranks as before, plus the rank's
    experts/ep experts' over their N / ep expert_shard ranks, one rank from each ep group
    (estimation/memory/moe.ep_cluster: torchtitan's dp_shard_mod_ep mesh; its traffic crosses the NICs when
    the ep groups fill nodes). Compute: the busiest rank's experts run imbalance x the mean of
    6 x layers x top_k x expert params FLOPs per token (8 with full recomputation), and every rank
    waits for it at the combine. All-to-all: dispatch and combine in forward, their gradients in
    backward (again forward's two where the block is recomputed: torchtitan's selective policy
    saves all_to_all_single's output), each moving tokens x top_k x hidden in the compute dtype, a
    fraction (ep - 1) / ep off the rank; the busiest receiver takes imbalance x that. Inside a scale-up
    domain (a node, or an NVL72 rack) it rides NVLink; an ep group of whole domains sends (ep - GPUs
    per domain) / ep of it through the
    rank's own NIC while the rest rides NVLink (rail-optimised nodes: one NIC per GPU; DeepEP's
    README measures its internode normal kernels at 43-58 GB/s per H800 over 50 GB/s CX7 NICs,
    NIC-bound), whichever is slower. Not hidden: the experts wait for the dispatch and the next
    block for the combine (no overlap modelled, as torchtitan runs it)."""
    from dataclasses import fields
    from ...families.base import Comm
    from ..memory.activations import checkpointed_blocks
    from ..memory.moe import ep_cluster, expert_split
    from ...config.spec import layer_every
    d = profile.decoder
    fam = strategy.family_obj
    dense, experts = expert_split(profile, ep)
    ecl = ep_cluster(cluster, ep)
    a = fam.comm(strategy, dense, spec, cluster, N, Links(cluster))
    b = fam.comm(strategy, experts, spec, ecl, N // ep, Links(ecl))
    comm = Comm(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(Comm)})
    imb = min(spec.moe_imbalance, ep)
    mode = spec.activation_checkpointing
    every = layer_every(mode)
    redone = 1.0 if mode == "full" else (checkpointed_blocks(d.layers, every) / d.layers if every else 0.0)
    cp_tokens = spec.micro_batch * spec.seq_len / cp      # a cp rank routes its S / cp tokens
    expert_flops = 6 * d.moe_layers * d.top_k * d.expert_params * (1 + redone / 3)
    straggler = (imb - 1) * expert_flops * cp_tokens / flops_per_s
    g, per = cluster.gpu, cluster.domain
    nbytes = spec.bytes.compute * cp_tokens * d.top_k * d.hidden
    inside = min(ep, per)
    one = imb * nbytes * max((inside - 1) / ep / g.intra_node_bw, (ep - inside) / ep / g.inter_node_bw)
    one += Links(cluster).latency(ep)
    return comm, straggler, (4 + 2 * redone) * d.moe_layers * one
