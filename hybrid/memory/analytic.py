"""Closed-form per-GPU memory of one training step, for every strategy family.

The step is modelled as four moments and the peak is the largest:
  loss      the loss gradient is being formed: all activations, logits and their fp32 gradients
            alive, no parameter gradients yet (torch's zero_grad sets them to None);
  blocks    the last block is in backward (recomputed first, with checkpointing), its params
            gathered and its unsharded grads made;
  grads     backward has finished: every gradient alive, activations gone;
  step      optimizer step: states + its scratch (torch's foreach AdamW keeps one temporary the
            size of the parameters it updates).
Family layouts (what each library allocates) are in `_ddp`, `_fsdp`, `_deepspeed`; each constant
cites its source.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..catalogue import Strategy
from ..cluster import Cluster
from ..errors import HybridError
from ..profile import ModelProfile
from ..spec import TrainSpec
from .activations import ActivationTerms, activation_terms
from .breakdown import MemoryBreakdown

ALLOCATOR_HEADROOM = 0.05
"""Caching-allocator slack over live tensors (block rounding, fragmentation): reserved exceeds
allocated by a few percent in steady-state training; assumed 5% until measured on a GPU."""
FP32 = 4


def overhead_bytes(cluster: Cluster, tensors: float) -> float:
    """The runtime's share on top of live tensors: CUDA context and workspaces, allocator slack."""
    return cluster.gpu.cuda_context_bytes + ALLOCATOR_HEADROOM * tensors
SUB_GROUP_SIZE = 1_000_000_000
"""DeepSpeed ZeRO-3 `sub_group_size` default: elements stepped (and fp32 grads made) at a time."""


class NotApplicable(HybridError):
    """This strategy cannot run this job at all (not a matter of memory)."""


@dataclass
class _Layout:
    """Where a family keeps things, bytes per GPU, at each moment of the step."""
    params: float = 0
    optimizer: float = 0
    grads_start: float = 0      # gradients that exist when backward starts (persistent buffers)
    grads_end: float = 0
    grads_step: float = 0       # extra gradient copies made for the step (DeepSpeed fp32 partition)
    buffers_start: float = 0    # communication buffers at the loss backward
    buffers_mid: float = 0      # ... while a block is in backward
    buffers_end: float = 0      # ... when backward finishes
    buffers_step: float = 0
    scratch: float = 0          # optimizer-step temporaries on the GPU
    cpu: float = 0
    autocast: bool = False
    notes: list[str] = field(default_factory=list)


def optimizer_elements(profile: ModelProfile, spec: TrainSpec) -> int:
    """State elements the optimizer keeps for the trainable parameters."""
    P = profile.trainable_params
    if spec.optimizer == "adamw":
        return 2 * P                      # exp_avg, exp_avg_sq (torch.optim.AdamW)
    if spec.optimizer == "sgd":
        return P                          # momentum_buffer (torch.optim.SGD, momentum > 0)
    if profile.factored_state is None:
        raise HybridError(f"optimizer 'adafactor' keeps one row and one column vector per matrix, so it "
                          f"needs the parameter shapes; {profile.name} is a bare count. Give a preset, a "
                          "config.json or a module, or use --optimizer adamw/sgd")
    return profile.factored_state         # torch.optim.Adafactor row_var/col_var (no first moment)


def _scratch_elements(profile: ModelProfile, spec: TrainSpec) -> int:
    # foreach AdamW: torch._foreach_sqrt(exp_avg_sqs) allocates one tensor per parameter;
    # Adafactor builds the full-size variance estimate per parameter; SGD updates in place.
    return {"adamw": profile.trainable_params, "sgd": 0, "adafactor": profile.largest_param}[spec.optimizer]


def _ddp(s: Strategy, p: ModelProfile, spec: TrainSpec, n: int, cl: Cluster) -> _Layout:
    b = spec.bytes
    grads = p.trainable_params * b.grad
    lay = _Layout(params=p.params * b.param, optimizer=optimizer_elements(p, spec) * b.state,
                  scratch=_scratch_elements(p, spec) * b.state,
                  autocast=spec.precision in ("bf16-mixed", "fp16-mixed"), grads_end=grads)
    if s.gradient_as_bucket_view:
        lay.grads_start = grads          # grads are views into buckets allocated at DDP init
    else:
        if spec.gradient_accumulation > 1:
            lay.grads_start = grads      # .grad accumulates across the window (no_sync)
        lay.buffers_start = lay.buffers_mid = lay.buffers_end = lay.buffers_step = grads
        lay.notes.append("DDP buckets hold a second gradient copy (gradient_as_bucket_view=False)")
    return lay


def _fsdp(s: Strategy, p: ModelProfile, spec: TrainSpec, n: int, cl: Cluster) -> _Layout:
    b = spec.bytes
    c = b.compute
    rb = FP32 if spec.precision != "bf16" else 2       # MixedPrecisionPolicy(reduce_dtype=fp32)
    P = p.trainable_params
    unit = p.block_params if p.num_blocks else p.params
    root = p.root_params if p.num_blocks else 0
    head = (p.decoder.vocab * p.decoder.hidden) if p.decoder else root
    lay = _Layout()
    sharded = dict(params=p.params * b.param / n, optimizer=optimizer_elements(p, spec) * b.state / n,
                   grads=P * b.grad / n, scratch=_scratch_elements(p, spec) * b.state / n)
    if s.offload_params:
        lay.cpu = sharded["params"] + sharded["optimizer"] + sharded["grads"] + sharded["scratch"]
        lay.notes.append("CPUOffloadPolicy: sharded params, grads and the optimizer step live in host memory")
    else:
        lay.params, lay.optimizer = sharded["params"], sharded["optimizer"]
        lay.grads_end, lay.scratch = sharded["grads"], sharded["scratch"]
    # The root (embeddings, final norm, head) is not resharded after forward (FSDP2 keeps the root
    # gathered for backward); blocks are gathered one at a time plus one prefetched.
    gathered_blocks = 2 * unit if s.reshard_after_forward else p.num_blocks * unit + unit
    lay.buffers_start = c * (root + (unit if s.reshard_after_forward else p.num_blocks * unit))
    # in a block's backward: root params + the head's unsharded grad, two blocks gathered (the
    # block and the prefetched one, whose all-gather output and copy-out overlap it), and the
    # block's reduce-scatter input in the reduce dtype (its grads themselves: unit_grads)
    lay.buffers_mid = c * (root + head + gathered_blocks) + rb * unit
    lay.buffers_end = c * (2 * root) + rb * root
    if spec.gradient_accumulation > 1:
        # FSDP2's no-sync (set_requires_gradient_sync(False)) keeps every unsharded gradient, in
        # the compute dtype, from the window's first backward to its last reduce-scatter
        lay.grads_start += P * c
        lay.grads_end += P * c
        lay.notes.append(f"gradient accumulation: unsharded {('bf16' if c == 2 else 'fp32')} gradients are kept "
                         "between micro-batches (reduce-scatter once per window)")
    return lay


def _deepspeed(s: Strategy, p: ModelProfile, spec: TrainSpec, n: int, cl: Cluster) -> _Layout:
    if spec.precision == "bf16":
        raise NotApplicable(f"{s.name}: DeepSpeed ZeRO keeps an fp32 master copy; pure bf16 training is "
                            "not one of its modes. Use --precision bf16-mixed, or an fsdp/ddp strategy")
    c = spec.bytes.compute                  # module params/grads: bf16 (bf16.enabled) or fp32
    P, h = p.trainable_params, (p.decoder.hidden if p.decoder else None)
    reduce_bucket = s.reduce_bucket_size or (h * h if h else 500_000_000)
    prefetch = s.prefetch_bucket_size or (int(0.9 * h * h) if h else 50_000_000)
    persist = s.param_persistence_threshold if s.param_persistence_threshold is not None else (10 * h if h else 100_000)
    # fp32 master partition + optimizer states, DeepSpeed's "4_params_32bit + 8_optimizer_states"
    opt = (P * FP32 + optimizer_elements(p, spec) * FP32) / n
    fp32_grad = P * FP32 / n                # single_partition_of_fp32_groups[i].grad at the step
    scratch = _scratch_elements(p, spec) * FP32 / n
    lay = _Layout()
    if s.stage in (1, 2):
        lay.params = p.params * c           # the module's bf16 params, whole on every rank
        # stage 1 keeps full bf16 grads until the step; stage 2 reduces them into a 1/N partition
        lay.grads_end = P * c if s.stage == 1 else P * c / n
        if spec.gradient_accumulation > 1:
            # stage 1 accumulates whole 16-bit grads over the window; stage 2 accumulates its
            # fp32 partition (averaged_gradients) between micro-batches
            lay.grads_start = P * c if s.stage == 1 else P * FP32 / n
        # the IPG reduce bucket; updated partitions are all-gathered in place into the flat params
        lay.buffers_start = lay.buffers_mid = lay.buffers_end = c * reduce_bucket
    else:
        small = _persistent_params(p, persist)
        lay.params = c * (p.params / n + small * (1 - 1 / n))
        # stage3.py allocates grad_partitions_flat_buffer (1/N, 16-bit) once, at init
        lay.grads_start = lay.grads_end = P * c / n
        # ... and makes the fp32 grad one sub-group (sub_group_size, default 1e9) at a time
        fp32_grad = FP32 * min(SUB_GROUP_SIZE, P / n)
        scratch = FP32 * min(SUB_GROUP_SIZE, _scratch_elements(p, spec) / n)
        largest = p.largest_layer_params or p.largest_param
        unit = p.block_params if p.num_blocks else largest
        # Gathered params stay gathered while they are reused within max_reuse_distance fetches:
        # at the forward/backward turn the last blocks (fetched again after 2 x the params in
        # between) and the head are kept; everything is capped by max_live_parameters.
        kept = min(p.params, s.max_live_parameters, largest + s.max_reuse_distance / 2 + prefetch)
        lay.buffers_start = c * (kept + reduce_bucket)
        lay.buffers_mid = c * (min(s.max_live_parameters, kept + unit) + reduce_bucket)
        lay.buffers_end = c * (min(p.params, s.max_live_parameters, largest + prefetch) + reduce_bucket)
        hpz = s.hpz_size(cl)
        if hpz:
            lay.params += c * p.params / hpz   # ZeRO++ hpZ secondary partition (bf16, node-local)
            lay.notes.append(f"hpZ keeps a secondary bf16 partition over {hpz} ranks")
    if s.offload_optimizer:
        lay.cpu += opt + fp32_grad + scratch
        if s.stage == 3:                    # grad_partitions_flat_buffer is pinned host memory then
            lay.cpu += lay.grads_end
            lay.grads_start = lay.grads_end = 0
        lay.notes.append("optimizer states, fp32 master and fp32 grads in host memory")
    else:
        lay.optimizer, lay.grads_step, lay.scratch = opt, fp32_grad, scratch
    if s.offload_params:
        lay.cpu += lay.params
        lay.params = 0
    return lay


def _persistent_params(p: ModelProfile, threshold: int) -> int:
    """ZeRO-3 stage3_param_persistence_threshold: tensors under it are never partitioned."""
    d = p.decoder
    if d is None:
        return 0
    small = [m for m in d.block_matrices() if (m[0] * (m[1] if len(m) == 2 else 1)) < threshold]
    return d.layers * sum(m[0] * (m[1] if len(m) == 2 else 1) for m in small) + d.hidden


_LAYOUTS = {"ddp": _ddp, "fsdp": _fsdp, "deepspeed": _deepspeed}


def check_job(profile: ModelProfile, spec: TrainSpec) -> None:
    """Input rules that hold whatever the strategy."""
    if profile.trainable_params == 0:
        raise HybridError(f"model {profile.name} has no trainable parameters "
                          "(all requires_grad=False): nothing to optimise or shard")
    mp = profile.max_positions
    if mp is not None and spec.seq_len > mp:
        raise HybridError(f"seq-len {spec.seq_len} is longer than {profile.name}'s maximum positions "
                          f"{mp}; use --seq-len {mp} or less")


def estimate(strategy: Strategy, profile: ModelProfile, spec: TrainSpec, cluster: Cluster,
             shard_size: int | None = None) -> MemoryBreakdown:
    check_job(profile, spec)
    n = strategy.shard_size(cluster, shard_size)
    if spec.precision in ("bf16", "bf16-mixed") and cluster.gpu.is_cuda and not cluster.gpu.bf16:
        raise NotApplicable(f"{cluster.gpu.name} has no bf16 (Ampere or newer needed); use fp16-mixed or fp32")
    if spec.precision == "fp16-mixed" and strategy.family == "deepspeed" and not cluster.gpu.is_cuda:
        raise NotApplicable(f"{strategy.name}: DeepSpeed's fp16 mode needs CUDA (its CPU accelerator has no fp16); "
                            "use ddp or fsdp for fp16-mixed on CPU ranks")
    lay = _LAYOUTS[strategy.family](strategy, profile, spec, n, cluster)
    notes = list(lay.notes)
    if profile.decoder:
        act = activation_terms(profile.decoder, spec, lay.autocast)
    elif profile.activation_bytes_per_sample is not None:
        # probed in fp32; convolution and norm outputs follow the compute dtype (bf16 under
        # autocast too, where no fp32 residual stream exists)
        scale = spec.bytes.compute / FP32
        per_batch = int(profile.activation_bytes_per_sample * spec.micro_batch * scale)
        act = ActivationTerms(per_batch, 0, 0, 0, 0, 1)
        if spec.activation_checkpointing != "none":
            notes.append("activation checkpointing is not modelled for non-transformer models "
                         "(use --method traced)")
    else:
        notes.append("activations unknown: the model is a bare parameter count (model states only)")
        act = ActivationTerms(0, 0, 0, 0, 0, 0)
    acts = act.layers * act.per_layer
    unit = profile.block_params if profile.num_blocks else profile.largest_layer_params
    unit_grads = (2 if lay.autocast else spec.bytes.compute) * unit
    moments = {
        "loss": dict(grads=lay.grads_start, activations=acts,
                     temporaries=act.head_backward + act.autocast_cache, buffers=lay.buffers_start),
        # the block being differentiated: recomputed activations and its weight gradients as
        # autograd makes them (compute dtype), before they are reduced or accumulated
        "blocks": dict(grads=lay.grads_start, activations=acts,
                       temporaries=act.recompute + act.autocast_cache + unit_grads, buffers=lay.buffers_mid),
        "grads": dict(grads=lay.grads_end, activations=0, temporaries=0, buffers=lay.buffers_end),
        "step": dict(grads=lay.grads_end + lay.grads_step, activations=0, temporaries=lay.scratch,
                     buffers=lay.buffers_step),
    }
    phase, parts = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    tensors = lay.params + lay.optimizer + sum(parts.values())
    overhead = overhead_bytes(cluster, tensors)
    return MemoryBreakdown(
        params=int(lay.params), grads=int(parts["grads"]), optimizer=int(lay.optimizer),
        activations=(None if profile.decoder is None and profile.activation_bytes_per_sample is None
                     else int(parts["activations"])),
        temporaries=int(parts["temporaries"]), buffers=int(parts["buffers"]), overhead=int(overhead),
        cpu=int(lay.cpu), phase=phase, notes=tuple(notes),
        model_states=int(lay.params + lay.optimizer + lay.grads_end + lay.grads_step))
