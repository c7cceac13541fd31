"""Closed-form per-GPU memory of one training step, for every strategy family.

The step is modelled as four moments and the peak is the largest:
  loss      the loss gradient is being formed: all activations, logits and their fp32 gradients
            alive, no parameter gradients yet (torch's zero_grad sets them to None);
  blocks    the last block is in backward (recomputed first, with checkpointing), its params
            gathered and its unsharded grads made;
  grads     backward has finished: every gradient alive, activations gone;
  step      optimizer step: states + its scratch (torch's foreach AdamW keeps one temporary the
            size of the parameters it updates).
Family layouts (what each library allocates) are each family's `layout` (hybrid/families/); each
constant cites its source.
"""
from __future__ import annotations

from ..catalogue import Strategy
from ..cluster import Cluster
from ..errors import HybridError
from ..profile import ModelProfile, tp_share
from ..spec import TrainSpec
from .activations import ActivationTerms, activation_terms, largest_transient
from .breakdown import MemoryBreakdown, fragmentation_floor, overhead_bytes
from .cp import local_spec, with_gathered_kv
from .layout import FP32, NotApplicable, reduce_bytes
from .moe import expert_parallel

__all__ = ["NotApplicable", "check_job", "estimate", "layout_of"]

def check_job(profile: ModelProfile, spec: TrainSpec) -> None:
    """Input rules that hold whatever the strategy."""
    if profile.trainable_params == 0:
        raise HybridError(f"model {profile.name} has no trainable parameters "
                          "(all requires_grad=False): nothing to optimise or shard")
    mp = profile.max_positions
    if mp is not None and spec.seq_len > mp:
        raise HybridError(f"seq-len {spec.seq_len} is longer than {profile.name}'s maximum positions "
                          f"{mp}; use --seq-len {mp} or less")


def layout_of(strategy: Strategy, profile: ModelProfile, spec: TrainSpec, cluster: Cluster, n: int):
    """The family's layout of this job (NotApplicable when it cannot run it at all)."""
    if spec.precision in ("bf16", "bf16-mixed") and cluster.gpu.is_cuda and not cluster.gpu.bf16:
        raise NotApplicable(f"{cluster.gpu.name} has no bf16 (Ampere or newer needed); use fp16-mixed or fp32")
    family = strategy.family_obj
    family.check(strategy, spec, cluster.gpu.is_cuda)
    return family.layout(strategy, profile, spec, n, cluster)


def estimate(strategy: Strategy, profile: ModelProfile, spec: TrainSpec, cluster: Cluster,
             shard_size: int | None = None, tp: int = 1, cp: int = 1, ep: int = 1) -> MemoryBreakdown:
    """Per-GPU memory of one rank. With tp > 1 the rank holds its tensor-parallel share of the
    model (profile.tp_share) and every per-layer and head activation term is split tp ways
    (sequence parallelism and vocab-parallel logits, Korthikanti et al. arXiv 2205.05198), except
    the two all-gathered block inputs the column-wise matmuls keep whole (what DTensor's
    ColwiseParallel saves for backward). A pipeline rank's share (profile.stage, from
    stage_share) keeps its in-flight micro-batches' activations, the logits only on the last
    stage, the receive buffers, and the moment its backward ends with the other micro-batches
    still in flight. With cp > 1 (memory/cp.py) FSDP shards over dp_shard x cp, every
    per-token term is a sequence S / cp long, and each layer keeps the gathered K and V. With
    ep > 1 (memory/moe.py) the experts are split over ep ranks: their gathered unit, routed
    activations and all-to-all buffers are the busiest rank's."""
    check_job(profile, spec)
    n = strategy.shard_size(cluster, shard_size, tp, cp)
    if tp > 1:
        strategy.family_obj.check_tp(strategy, tp)
        if getattr(spec, "float8", False):
            raise NotApplicable("float8 with tensor parallelism (torchao's Float8ColwiseParallel) is not applied "
                                "here; float8 layouts run at tp 1")
    if cp > 1:
        strategy.family_obj.check_cp(strategy, cp, tp)
        if getattr(spec, "compile", False):
            raise NotApplicable("compile with cp > 1: the K/V all-gather inside a fullgraph-compiled block has not "
                                "run here; use compile with cp 1, or cp without compile")
        if profile.decoder is None:
            raise NotApplicable("context parallelism splits a transformer's sequence; this model has no known "
                                "decoder shape: use cp 1")
    whole, whole_spec = profile, spec
    spec = local_spec(spec, cp)
    profile = tp_share(profile, tp)
    moe = expert_parallel(strategy, profile, spec, cluster, n, cp, ep, layout_of)
    lay = moe.layout if moe else layout_of(strategy, profile, spec, cluster, n * cp)
    notes = list(lay.notes)
    if profile.decoder:
        act = activation_terms(profile.decoder, spec, lay.autocast)
        if tp > 1:
            # the attention and MLP inputs are all-gathered, and the column-wise matmuls keep them
            # whole: in every stored block, or only in the recomputed one under full checkpointing
            gathered = 2 * spec.bytes.compute * whole.decoder.hidden * spec.tokens * (1 - 1 / tp)
            stored, redone = (0, gathered) if spec.activation_checkpointing == "full" else (gathered, 0)
            act = ActivationTerms(per_layer=int(act.per_layer / tp + stored),
                                  recompute=int(act.recompute / tp + redone),
                                  head_forward=int(act.head_forward / tp), head_backward=int(act.head_backward / tp),
                                  autocast_cache=int(act.autocast_cache / tp), layers=act.layers)
            notes.append(f"tensor parallel {tp}: matrices, embedding and head split {tp} ways; sequence-parallel "
                         "activations; vocab-parallel logits")
        if cp > 1:
            act = with_gathered_kv(act, whole.decoder, whole_spec, cp, tp, lay.autocast)
            notes.append(f"context parallel {cp}: each rank holds {whole_spec.seq_len // cp} tokens of each "
                         "sequence and keeps every layer's gathered K/V (or recomputes them with checkpointing)")
        if profile.stage is not None:
            act = _stage_activations(act, profile.stage)
        if moe:
            act = moe.activations(act, spec, profile.decoder.layers)
    elif getattr(spec, "compile", False):
        raise NotApplicable("compile's memory is modelled for decoder blocks (a preset or a decoder config.json); "
                            "this model has no known decoder shape")
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
    recv = _receive_buffers(profile, spec, tp)
    unit = moe.unit if moe else (profile.block_params if profile.num_blocks else profile.largest_layer_params)
    unit_grads = (2 if lay.autocast else spec.bytes.compute) * unit
    moments = {
        "loss": dict(grads=lay.grads_start, activations=acts,
                     temporaries=act.head_backward + act.autocast_cache, buffers=lay.buffers_start),
        # the block being differentiated: recomputed activations and its weight gradients as
        # autograd makes them (compute dtype), before they are reduced or accumulated
        "blocks": dict(grads=lay.grads_start, activations=acts,
                       temporaries=act.recompute + act.autocast_cache + unit_grads + (moe.a2a_buffers if moe else 0),
                       buffers=lay.buffers_mid),
        "grads": dict(grads=lay.grads_end, activations=0, temporaries=0, buffers=lay.buffers_end),
        "step": dict(grads=lay.grads_end + lay.grads_step, activations=0, temporaries=lay.scratch,
                     buffers=lay.buffers_step),
    }
    if cp > 1:     # backends/cp.py scores the loss outside the model's forward: the root regathers after it
        moments["loss"]["buffers"] -= lay.regathered
    st = profile.stage
    staged = st is not None and st.pp > 1
    ends = [act.recompute + unit_grads] if staged else []      # a stage's backward ends in its first block
    if tp > 1 and profile.decoder is not None and (st is None or st.first):
        # DTensor's embedding backward (vocab-sharded weight, replicated ids) makes the whole
        # vocab x hidden gradient, not the shard (seen in the traced runs); where FSDP accumulates
        # unsharded gradients, its reduce-dtype copy is whole too and stays until the step (grads
        # count only the shard's)
        full = whole.decoder.vocab * whole.decoder.hidden
        ends.append(full * spec.bytes.compute)
        if spec.gradient_accumulation > 1 or staged:
            extra = full * reduce_bytes(spec) * (1 - 1 / tp)
            for name in ("loss", "blocks", "grads"):
                moments[name]["grads"] += extra
    moments["grads"]["temporaries"] += max(ends, default=0)
    if staged:
        # ... while its other in-flight micro-batches keep their activations (1F1B: in-flight - 1
        # of them), with every gradient (and, under FSDP, every block's parameters gathered since
        # that backward) present
        moments["grads"]["activations"] = act.per_layer * (st.in_flight_layers - st.blocks)
    for parts in moments.values():
        parts["buffers"] += recv
    phase, parts = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    tensors = lay.params + lay.optimizer + sum(parts.values())
    transient = largest_transient(whole.decoder, spec, lay.autocast, tp) if profile.decoder else 0
    overhead = overhead_bytes(cluster, tensors, transient)
    return MemoryBreakdown(
        params=int(lay.params), grads=int(parts["grads"]), optimizer=int(lay.optimizer),
        activations=(None if profile.decoder is None and profile.activation_bytes_per_sample is None
                     else int(parts["activations"])),
        temporaries=int(parts["temporaries"]), buffers=int(parts["buffers"]), overhead=int(overhead),
        context=cluster.gpu.cuda_context_bytes, floor=fragmentation_floor(cluster, transient), cpu=int(lay.cpu),
        phase=phase, notes=tuple(notes),
        model_states=int(lay.params + lay.optimizer + lay.grads_end + lay.grads_step))


def _stage_activations(act: ActivationTerms, st) -> ActivationTerms:
    """A pipeline rank keeps the activations of its in-flight micro-batches (per the schedule,
    hybrid/pipeline.py) for its blocks only; the logits and loss only on the last stage."""
    return ActivationTerms(per_layer=act.per_layer, recompute=act.recompute,
                           head_forward=act.head_forward if st.last else 0,
                           head_backward=act.head_backward if st.last else 0,
                           autocast_cache=act.autocast_cache, layers=st.in_flight_layers)


def _receive_buffers(profile: ModelProfile, spec: TrainSpec, tp: int) -> int:
    """torch.distributed.pipelining allocates, once, a receive buffer per micro-batch for the
    stage's input activation (all but the first stage) and for its output's gradient (all but the
    last): b x s x h each in the compute dtype (a tp rank's sequence-parallel share)."""
    st = profile.stage
    if st is None or st.pp == 1:
        return 0
    m = spec.gradient_accumulation
    count = m * ((not st.first) + (not st.last))
    return int(count * spec.bytes.compute * spec.tokens * st.boundary_elements / tp)
