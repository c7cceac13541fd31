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

from ...families.catalogue import Strategy
from ...config.cluster import Cluster
from ...errors import HybridError
from ...layout.layout import Layout, as_layout
from ...model.lora import with_lora
from ...model.profile import ModelProfile
from ..shares import Share, share_activations, shares, whole_embedding_gradient
from ...config.spec import TrainSpec
from .activations import ActivationTerms, activation_terms, largest_transient
from .breakdown import MemoryBreakdown, fragmentation_floor, overhead_bytes
from ...families.placement import FP32, NotApplicable, reduce_bytes
from .moe import ExpertParallel, expert_parallel

__all__ = ["NotApplicable", "check_job", "estimate", "placement_of"]

def check_job(profile: ModelProfile, spec: TrainSpec) -> None:
    """Input rules that hold whatever the strategy."""
    if profile.trainable_params == 0:
        raise HybridError(f"model {profile.name} has no trainable parameters "
                          "(all requires_grad=False): nothing to optimise or shard")
    mp = profile.max_positions
    if mp is not None and spec.seq_len > mp:
        raise HybridError(f"seq-len {spec.seq_len} is longer than {profile.name}'s maximum positions "
                          f"{mp}; use --seq-len {mp} or less")


def placement_of(strategy: Strategy, profile: ModelProfile, spec: TrainSpec, cluster: Cluster, n: int, stage=None):
    """The family's placement of this job (NotApplicable when it cannot run it at all); `stage`
    (shares.StageShare): the profile is one pipeline rank's."""
    if spec.precision in ("bf16", "bf16-mixed") and cluster.gpu.is_cuda and not cluster.gpu.bf16:
        raise NotApplicable(f"{cluster.gpu.name} has no bf16 (Ampere or newer needed); use fp16-mixed or fp32")
    family = strategy.family_obj
    family.check_device(strategy, spec, cluster.gpu.is_cuda)
    return family.placement(strategy, profile, spec, n, cluster, stage=stage)


def estimate(layout: Layout | Strategy, profile: ModelProfile, spec: TrainSpec, cluster: Cluster,
             rank: int = 0) -> MemoryBreakdown:
    """Per-GPU memory of one rank (`rank` of the pipeline, 0 without one): its share of the model
    and the sequence (shares.shares), the family's placement of it, its activations, and the
    largest of the step's four moments. A bare Strategy stands for its layout on the cluster
    (Layout.of) at the spec's checkpointing."""
    profile = with_lora(profile, spec.lora)
    check_job(profile, spec)
    layout = as_layout(layout, cluster, spec)
    spec = layout.train_spec(spec)
    layout.check(profile)
    problem = layout.dp.family_obj.autocast_experts_problem(layout, spec, profile.grouped_experts,
                                                            cluster.gpu.software)
    if problem is not None:
        raise problem
    sh = shares(profile, layout, spec, rank)
    dims = layout.dims
    priced = layout.dp.family_obj.priced_strategy(layout.dp, sh.applied)
    moe = expert_parallel(priced, sh.profile, sh.spec, cluster, dims.dp_shard, dims.cp, dims.ep, placement_of,
                          staged=sh.stage is not None)
    place = moe.placement if moe else placement_of(priced, sh.profile, sh.spec, cluster, dims.dp_shard * dims.cp,
                                                 sh.stage)
    act, notes = activations(sh, place.autocast)
    if moe:
        act = moe.activations(act, sh.spec, sh.profile.decoder.layers)
    moments = step_moments(sh, place, act, moe)
    phase, parts = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    tensors = place.params + place.optimizer + sum(parts.values())
    transient = largest_transient(profile.decoder, sh.spec, place.autocast, sh.tp) if profile.decoder else 0
    return MemoryBreakdown(
        params=int(place.params), grads=int(parts["grads"]), optimizer=int(place.optimizer),
        activations=(None if profile.decoder is None and profile.activation_bytes_per_sample is None
                     else int(parts["activations"])),
        temporaries=int(parts["temporaries"]), buffers=int(parts["buffers"]),
        overhead=int(overhead_bytes(cluster, tensors, transient)), context=cluster.gpu.cuda_context_bytes,
        floor=fragmentation_floor(cluster, transient), cpu=int(place.cpu), phase=phase,
        notes=tuple(list(place.notes) + notes),
        model_states=int(place.params + place.optimizer + place.grads_end + place.grads_step))


def activations(sh: Share, autocast: bool) -> tuple[ActivationTerms, list[str]]:
    """The rank's activation terms: a decoder's per layer and head (estimation/memory/activations.py), each
    split tp ways with sequence parallelism and vocab-parallel logits (Korthikanti et al. arXiv
    2205.05198) except the two all-gathered block inputs the column-wise matmuls keep whole (what
    DTensor's ColwiseParallel saves for backward); S / cp long plus the gathered K and V with
    context parallelism (estimation/memory/cp.py); a pipeline rank's in-flight micro-batches' for its blocks.
    Another model's probed bytes per sample; nothing for a bare parameter count."""
    profile, spec = sh.profile, sh.spec
    notes = []
    if profile.decoder is None and spec.compile:
        raise NotApplicable("compile's memory is modelled for decoder blocks (a preset or a decoder config.json); "
                            "this model has no known decoder shape")
    if profile.decoder is None:
        if profile.activation_bytes_per_sample is None:
            return ActivationTerms(0, 0, 0, 0, 0, 0), ["activations unknown: the model is a bare parameter count "
                                                       "(model states only)"]
        # probed in fp32; convolution and norm outputs follow the compute dtype (bf16 under
        # autocast too, where no fp32 residual stream exists)
        scale = spec.bytes.compute / FP32
        per_batch = int(profile.activation_bytes_per_sample * spec.micro_batch * scale)
        if spec.activation_checkpointing != "none":
            notes.append("activation checkpointing is not modelled for non-transformer models (use --method traced)")
        return ActivationTerms(per_batch, 0, 0, 0, 0, 1), notes
    return share_activations(sh, activation_terms(profile.decoder, spec, autocast), autocast, notes)


def step_moments(sh: Share, place, act: ActivationTerms,
                 moe: ExpertParallel | None = None) -> dict[str, dict[str, float]]:
    """Grads, activations, temporaries and buffers at each of the step's four moments."""
    profile, spec, st = sh.profile, sh.spec, sh.stage
    acts = act.layers * act.per_layer
    unit = moe.unit if moe else (profile.block_params if profile.num_blocks else profile.largest_layer_params)
    unit = unit * trained_fraction(profile, spec)         # frozen weights make no gradients
    unit_grads = (2 if place.autocast else spec.bytes.compute) * unit
    dequantized = dequantized_weight(profile, spec)
    # a gradient buffer made whole at its first reduction exists through the blocks' backward (ZeRO-2)
    in_backward = place.grads_start + (place.grads_end if place.grads_early else 0)
    moments = {
        "loss": dict(grads=place.grads_start, activations=acts,
                     temporaries=act.head_backward + act.autocast_cache, buffers=place.buffers_start),
        # the block being differentiated: recomputed activations and its weight gradients as
        # autograd makes them (compute dtype), before they are reduced or accumulated; with
        # experts as a unit of their own, the largest of its moments (estimation/memory/moe.py)
        "blocks": max((dict(grads=in_backward, activations=acts,
                            temporaries=(act.recompute - min(freed, act.recompute) + act.autocast_cache
                                         + max((2 if place.autocast else spec.bytes.compute) * u,
                                               act.backward_transient)
                                         + dequantized + (moe.a2a_buffers if moe else 0)),
                            buffers=buf)
                       for buf, u, freed in (moe.block_moments if moe and moe.block_moments
                                             else [(place.buffers_mid, unit, 0)])),
                      key=lambda parts: sum(parts.values())),
        "grads": dict(grads=place.grads_end, activations=0, temporaries=0, buffers=place.buffers_end),
        "step": dict(grads=place.grads_end + place.grads_step, activations=0, temporaries=place.scratch,
                     buffers=place.buffers_step),
    }
    if st is None and act.layers > 1 and profile.num_blocks:
        # ... or the first block, differentiated last: every other block's gradient has been
        # reduced into its shard by then (FSDP2's post_backward per unit; the root's at the end),
        # while only this block's activations are left (with checkpointing its kept input was
        # the smaller of the two: fp32 gradient shards grow faster than block inputs shrink)
        done = (place.grads_end - place.grads_start) * (act.layers - 1) * profile.block_params / profile.params
        end = dict(moments["blocks"], grads=max(place.grads_start + done, in_backward), activations=act.per_layer)
        if sum(end.values()) > sum(moments["blocks"].values()):
            moments["blocks"] = end
    if sh.loss_outside_forward:     # the root's parameters are gathered again after the loss backward
        moments["loss"]["buffers"] -= place.regathered
    full = whole_embedding_gradient(sh)
    # where FSDP accumulates unsharded gradients (a window, a pipeline stage), the whole embedding
    # gradient's reduce-dtype copy is whole too and stays until the step (grads count only the shard's)
    extra = full * reduce_bytes(spec) * (1 - 1 / sh.tp) if spec.gradient_accumulation > 1 or st is not None else 0
    if st is None:
        for name in ("loss", "blocks"):
            moments[name]["grads"] += extra
    else:
        # a stage's first backward of the step holds every in-flight micro-batch's activations and
        # no gradient yet; its later ones hold as many (fewer once the forwards run out:
        # layout/pipeline.in_flight_later) beside the gradients the earlier ones accumulated
        # (the last stage's other in-flight micro-batches keep their head's saved tensors too), and
        # each micro-batch its stage's output until its backward ends (stage_output)
        out = stage_output(sh)
        sent = st.pending_sends * boundary(sh)       # the schedule's earlier input gradients not yet released
        # what each other in-flight micro-batch keeps beside its blocks: on the last stage its head (logits,
        # log-softmax, norm), on another its output; interleaved, a rank holding the last stage runs the
        # others on its earlier chunk (a last-stage chunk-micro-batch's backward follows its forward in
        # torch's order), so they keep that chunk's output
        held = boundary(sh) if st.virtual > 1 or not st.last else act.head_forward
        # a received micro-batch's first block keeps the stage's receive buffer as its input, which
        # receive_buffers counts: not again in its activations
        rin = act.block_input
        for name in ("loss", "blocks"):
            # the last stage's output is the logits: in head_backward for the micro-batch whose loss
            # backward runs
            mine = 0 if st.last and name == "loss" else out
            first = dict(moments[name], grads=0,
                         activations=acts - rin * st.received + held * (st.in_flight - 1) + mine)
            # ... and an earlier backward's whole embedding gradient (a stage differentiates it last)
            later = dict(moments[name], grads=moments[name]["grads"] + extra,
                         activations=(act.per_layer * st.later_layers - rin * (0 if st.first else st.later)
                                      + held * max(st.later - 1, 0) + mine + sent))
            # one micro-batch a step has no later backward (no gradient accumulated before it)
            options = [first, later] if st.later else [first]
            if st.backwards:                # interleaved: each backward of the rank's program, as it holds
                # a reduced stage's gradients are what the step keeps of them (its shards; none on the GPU
                # under CPU offload): grads_end + grads_step, as the step moment counts them
                options = [_interleaved(moments[name], sh, act, name, extra, held, place.grads_end + place.grads_step,
                                        [b for b in st.backwards if b.last or name != "loss" or not st.last])]
            moments[name] = max(options, key=lambda parts: sum(parts.values()))
        if not st.last and sh.tp > 1:
            # a stage without the head can peak at its last warm-up forward's end: every in-flight micro-batch's
            # activations, its gathered units, and the row-wise down projection's whole output waiting for its
            # reduce-scatter (with its chunk-cat copy, the shard and its wait), beside the attention's residual
            # sum and the MLP norm's output, which the block holds while its MLP runs (a tp rank's shards:
            # the traced pp 2 x tp 2 first stage)
            whole = spec.bytes.compute * spec.tokens * st.boundary_elements
            moments["forward"] = dict(grads=0, activations=acts - rin * st.received + out * st.in_flight,
                                      temporaries=whole * (2 + 4 / sh.tp), buffers=place.buffers_start)
    moments["grads"]["grads"] += extra
    ends = [act.recompute + unit_grads] if st is not None else []     # a stage's backward ends in its first block
    if full:
        ends.append(full * spec.bytes.compute)
    moments["grads"]["temporaries"] += max(ends, default=0)
    if st is not None:
        # ... while its other in-flight micro-batches keep their activations (1F1B: in-flight - 1
        # of them), with every gradient (and, under FSDP, every block's parameters gathered since
        # that backward) present
        moments["grads"]["activations"] = (act.per_layer * (st.in_flight_layers - st.blocks) + stage_output(sh)
                                           - rin * max(st.received - 1, 0) + held * (st.in_flight - 1))
    recv = receive_buffers(sh)
    for parts in moments.values():
        parts["buffers"] += recv
    return moments


def _interleaved(parts: dict, sh: Share, act, name: str, extra: int, held: int, reduced: float, backwards) -> dict:
    """The largest moment of the backwards (shares.BackwardShare) of an interleaved rank, the first of equal
    ones (a 405B step has a thousand: each priced as two numbers, the moment built once). One backward's
    moment: the activations of its
    live chunk-micro-batches, each other one's stage output, its own (the logits of a last-stage one, in
    head_backward at its loss), the gradients of the stages whose backward ran before (as they accumulate,
    or, once the schedule reduced them, as the step keeps them: `reduced`, the placement's shards; with
    the first stage's, its whole embedding gradient) and the boundary tensors the schedule's sends still
    hold (layout/program.backward_moments); a received chunk-micro-batch's first block input is its stage's
    receive buffer (receive_buffers), not counted again."""
    st = sh.stage
    edge, out = boundary(sh), stage_output(sh)
    rest = sum(v for k, v in parts.items() if k not in ("grads", "activations"))
    best, top = None, None
    for b in backwards:
        mine = 0 if b.last and name == "loss" else out if b.last else edge
        acts = act.per_layer * st.in_flight_layers * b.live // max(st.in_flight, 1)
        grads = round(parts["grads"] * b.grads + reduced * b.reduced) + (extra if b.embedding else 0)
        activations = acts - act.block_input * b.received + held * (b.live - 1) + mine + b.sends * edge
        if top is None or rest + grads + activations > top:
            best, top = (grads, activations), rest + grads + activations
    return dict(parts, grads=best[0], activations=best[1])


def trained_fraction(profile: ModelProfile, spec: TrainSpec) -> float:
    """Of a block's parameters, the fraction that trains: a LoRA model's adapters all sit in its
    blocks; other partly frozen models are taken as evenly frozen; 1 when everything trains."""
    if profile.trainable_params == profile.params:
        return 1.0
    if spec.lora is not None and profile.num_blocks and profile.block_params:
        return min(1.0, profile.trainable_params / (profile.num_blocks * profile.block_params))
    return profile.trainable_params / profile.params


def dequantized_weight(profile: ModelProfile, spec: TrainSpec) -> int:
    """The largest base linear dequantised to the compute dtype for its matmul (bitsandbytes'
    MatMul4Bit runs F.linear on dequantize_4bit(W), forward and backward; int8 likewise
    dequantises its weight for the backward): a transient of the block in backward; 0 without a
    quantised base."""
    if not profile.quantized_params or profile.decoder is None:
        return 0
    from ...model.lora import base_linears
    d = profile.decoder
    mats = [o * i for o, i in base_linears(d)]
    share = profile.quantized_params / (d.layers * sum(mats))       # a tensor-parallel rank's share
    return int(spec.bytes.compute * max(mats) * share)


def stage_output(sh: Share) -> int:
    """Bytes of one micro-batch's stage output, which torch.distributed.pipelining keeps from its forward
    to the end of its backward (PipelineStage.fwd_cache, then backward_one_chunk's local `stage_output`
    while the backward runs): b x s x h in the compute dtype (a tp rank's sequence-parallel share), on
    the last stage the logits (the compute dtype; vocab-sharded under tp). 0 without stages."""
    st, spec = sh.stage, sh.spec
    if st is None:
        return 0
    width = sh.whole.decoder.vocab if st.last else st.boundary_elements
    return int(spec.bytes.compute * spec.tokens * width / sh.tp)


def boundary(sh: Share) -> int:
    """Bytes of one micro-batch's activation (or its gradient) at a stage boundary: b x s x h in the
    compute dtype, a tp rank's sequence-parallel share."""
    return int(sh.spec.bytes.compute * sh.spec.tokens * sh.stage.boundary_elements / sh.tp)


def receive_buffers(sh: Share) -> int:
    """torch.distributed.pipelining allocates, once per PipelineStage (each of the rank's local
    stages), a receive buffer per micro-batch for the stage's input activation (all but the first
    stage) and for its output's gradient (all but the last): b x s x h each in the compute dtype (a
    tp rank's sequence-parallel share)."""
    st, spec = sh.stage, sh.spec
    if st is None:
        return 0
    count = spec.gradient_accumulation * st.boundaries
    return int(count * spec.bytes.compute * spec.tokens * st.boundary_elements / sh.tp)
