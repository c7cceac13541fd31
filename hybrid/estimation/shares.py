"""What one rank of a layout holds and computes (pure, no torch), composed in one place and one
order: its pipeline stage's blocks, then its share of each sequence (context parallel), then of
each matrix (tensor parallel). The memory estimate and the cost model both start here."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from ..errors import HybridError
from ..memo import memoised
from .memory.activations import ActivationTerms
from ..model.profile import ModelProfile
from ..config.spec import TrainSpec
from ..layout.applied import AppliedPlan, applied_plan
from ..layout.program import backward_moments


@dataclass(frozen=True)
class StageShare:
    """What one pipeline rank holds: its blocks, whether it has the embedding (first stage) and
    the final norm + head + loss (last stage), and how many block activations it keeps in flight."""

    rank: int
    pp: int
    blocks: int
    first: bool
    last: bool
    in_flight_layers: int
    """Block activations held at the rank's peak: in-flight micro-batches x its blocks."""
    in_flight: int
    """Micro-batches (interleaved: chunk-micro-batches) in flight."""
    boundary_elements: int = 0
    """Elements per token of one stage boundary's activation (the hidden size): the receive
    buffers torch.distributed.pipelining allocates per micro-batch."""
    boundaries: int = 0
    """Receive buffers per micro-batch over the rank's local stages: each PipelineStage but the
    first receives its input, each but the last its output's gradient (interleaved: two stages)."""
    later: int = 0
    """Micro-batches in flight at the rank's later backwards, beside the gradients the earlier
    ones accumulated (layout/pipeline.in_flight_later)."""
    virtual: int = 1
    """Local stages (chunks) of the rank: 2 under interleaved."""
    pending_sends: int = 0
    """Input gradients of earlier backwards still held at a later backward by the schedule's send ops:
    torch's Schedule1F1B keeps a backward's send ops in a variable it rebinds after the next backward
    (1; measured live on 2 gloo ranks); GPipe keeps every send to the step's end (layout/program.py), but
    an earlier micro-batch's held output is far smaller than the activations its backward freed, so its
    later backwards never peak (0); 0 on the first stage, which sends none, and for interleaved (priced
    by `backwards`)."""
    backwards: tuple = ()
    """Interleaved: each backward of the rank's step as torch's runtime schedule runs it
    (BackwardShare, from layout/program.backward_moments); () for the single-stage schedules."""

    @property
    def received(self) -> int:
        """Of the micro-batches in flight at the rank's first backward, those of a stage that receives its
        input (all of them but on the first stage; interleaved, as its first backward holds them)."""
        if self.backwards:
            return self.backwards[0].received
        return 0 if self.first else self.in_flight

    @property
    def later_layers(self) -> int:
        """Block activations held at the rank's later backwards (counted as in_flight_layers)."""
        return self.later * self.in_flight_layers // max(self.in_flight, 1)


@dataclass(frozen=True)
class BackwardShare:
    """One backward of an interleaved rank's step (layout/program.Backward) as the estimate prices it."""

    last: bool
    """The backward of the last stage (its loss backward first)."""
    live: int
    """Chunk-micro-batches whose activations are held, this one's included."""
    grads: float
    """Fraction of the rank's parameters whose gradients exist unreduced: those of the stages a backward
    of which ran before in the step and whose reduction has not."""
    reduced: float
    """Fraction of the rank's parameters whose gradients the schedule has reduced (their stage's last
    backward ran: _PipelineScheduleRuntime's REDUCE_GRAD)."""
    embedding: bool
    """The first stage's backward ran before (its whole embedding gradient exists)."""
    sends: int
    """Boundary tensors held only by the schedule's send works."""
    received: int = 0
    """Of `live`, those of a stage that receives its input (layout/program.Backward.received)."""


def _stages_params(profile: ModelProfile, pipeline, stages) -> int:
    """Parameters of the given stages: their blocks, the embedding with the first, the final norm
    and head with the last (a tied head a second copy there)."""
    d = profile.decoder
    stages = list(stages)
    first, last = 0 in stages, pipeline.stages - 1 in stages
    embed = d.vocab * d.hidden + (d.max_positions * d.hidden if d.style == "gpt2" else 0)
    head = d.vocab * d.hidden
    norm = max(profile.root_params - embed - (0 if d.tied else head), 0)
    root = (embed if first else 0) + ((norm + head) if last else 0)
    held = d.pick([i for s in stages for i in range(*pipeline.stage_range(s))], head=last)
    blocks = sum(pipeline.blocks[s] for s in stages)
    return (held.params - held.root_params if d.stack else blocks * profile.block_params) + root


def _backwards(profile: ModelProfile, pipeline, rank: int) -> tuple:
    """The interleaved rank's backwards (layout/program.backward_moments) priced: () otherwise."""
    if pipeline.schedule != "interleaved" or profile.decoder is None:
        return ()
    whole = _stages_params(profile, pipeline, pipeline.rank_stages(rank))
    fracs: dict = {}

    def frac(stages) -> float:
        if stages not in fracs:
            fracs[stages] = _stages_params(profile, pipeline, stages) / whole if stages else 0.0
        return fracs[stages]
    # equal moments priced once (a step of m micro-batches repeats a handful of them), in program order
    moments = dict.fromkeys((b.stage == pipeline.stages - 1, b.live, b.done - b.reduced, b.reduced, 0 in b.done,
                             b.sends, b.received) for b in backward_moments(pipeline, rank))
    return tuple(BackwardShare(last, live, frac(unreduced), frac(reduced), embedding, sends, received)
                 for last, live, unreduced, reduced, embedding, sends, received in moments)


def stage_share(profile: ModelProfile, pipeline, rank: int) -> ModelProfile:
    """The profile of pipeline rank `rank` under `pipeline` (hybrid.layout.pipeline.StageSplit): its
    blocks' parameters, the embedding on the first rank, the final norm and head on the last (a
    tied head is a second copy there, kept in step by an all-reduce of its gradient)."""
    d = profile.decoder
    if d is None:
        raise HybridError(f"pipeline parallelism splits a transformer's blocks; {profile.name} has no known "
                          "decoder shape: use pp 1")
    st = stage_of(profile, pipeline, rank)
    embed = d.vocab * d.hidden + (d.max_positions * d.hidden if d.style == "gpt2" else 0)
    head = d.vocab * d.hidden
    norm = max(profile.root_params - embed - (0 if d.tied else head), 0)
    root = (embed if st.first else 0) + ((norm + head) if st.last else 0)
    held = d.pick([i for s in pipeline.rank_stages(rank) for i in range(*pipeline.stage_range(s))], head=st.last)
    params = (held.params - held.root_params if d.stack else st.blocks * profile.block_params) + root
    frac = params / profile.params
    return dataclasses.replace(
        profile, name=f"{profile.name} [pp rank {rank}]", params=params,
        trainable_params=round(profile.trainable_params * frac), param_bytes=round(profile.param_bytes * frac),
        dtype_bytes=tuple((k, round(v * frac)) for k, v in profile.dtype_bytes), num_blocks=st.blocks,
        root_params=root,
        factored_state=None if profile.factored_state is None else round(profile.factored_state * frac),
        optim_shapes=None if profile.optim_shapes is None else profile.optim_shapes.scaled(frac),
        quantized_params=profile.quantized_params * st.blocks // max(profile.num_blocks, 1),
        quantized_bytes=profile.quantized_bytes * st.blocks // max(profile.num_blocks, 1),
        tied_groups=(), decoder=held)


def stage_of(profile: ModelProfile, pipeline, rank: int) -> StageShare:
    """Where pipeline rank `rank` sits: its blocks, first or last, what it keeps in flight."""
    stages = pipeline.rank_stages(rank)
    blocks = sum(pipeline.blocks[i] for i in stages)
    return StageShare(rank, pipeline.pp, blocks, 0 in stages, pipeline.stages - 1 in stages,
                      pipeline.in_flight_layers(rank), pipeline.in_flight(rank),
                      profile.decoder.hidden if profile.decoder else 0,
                      sum((i != 0) + (i != pipeline.stages - 1) for i in stages), pipeline.later(rank),
                      pipeline.virtual,
                      int(pipeline.schedule == "1f1b" and 0 not in stages and pipeline.micro_batches > 1),
                      _backwards(profile, pipeline, rank))


@dataclass(frozen=True)
class Share:
    """One rank's share of the job under a layout."""

    whole: ModelProfile
    """The model."""
    whole_spec: TrainSpec
    """The job, whole sequences."""
    stage: StageShare | None
    """The rank's pipeline position; None without stages."""
    held: ModelProfile
    """What its pipeline stage holds (the whole model without stages)."""
    profile: ModelProfile
    """... of which its tensor-parallel share: what the rank stores."""
    spec: TrainSpec
    """The job on this rank: each sequence S / cp long (local_spec)."""
    tp: int
    cp: int
    applied: AppliedPlan | None = None
    """What the runtime applies for the layout (hybrid/layout/applied.py): sequence and loss
    parallelism, the data-parallel wrap."""

    @property
    def sequence_parallel(self) -> bool:
        return self.applied is not None and self.applied.sequence_parallel

    @property
    def loss_parallel(self) -> bool:
        return self.applied is not None and self.applied.loss_parallel

    @property
    def has_head(self) -> bool:
        """The rank computes the logits and the loss (the last stage, or every rank without stages)."""
        return self.stage is None or self.stage.last

    @property
    def has_embedding(self) -> bool:
        return self.stage is None or self.stage.first

    @property
    def loss_outside_forward(self) -> bool:
        """The loss is scored outside the model's forward: context parallelism (runtime/backends/cp.py),
        and a pipeline's last stage (the schedule's loss_fn on the stage's output)."""
        return self.cp > 1 or (self.stage is not None and self.stage.last)


def shares(profile: ModelProfile, layout, spec: TrainSpec, rank: int = 0, implementation: str = "hybrid") -> Share:
    """Rank `rank` of the pipeline (0 without one) under `layout`: pipeline stage, then cp, then tp;
    `implementation` (hybrid.layout.applied.IMPLEMENTATIONS): the code the runtime applies it to."""
    tp, cp = layout.dims.tp, layout.dims.cp
    stage, held, local = _rank_profiles(profile, layout.pipeline, rank, tp)
    return Share(whole=profile, whole_spec=spec, stage=stage, held=held, profile=local,
                 spec=local_spec(spec, cp), tp=tp, cp=cp, applied=applied_plan(layout, implementation, spec.precision))


@memoised               # a plan asks for the same rank of the same split many times
def _rank_profiles(profile: ModelProfile, pipeline, rank: int, tp: int) -> tuple:
    """(the rank's StageShare or None, what its stage holds, its tensor-parallel share of that)."""
    stage, held = None, profile
    if pipeline is not None:
        stage, held = stage_of(profile, pipeline, rank), stage_share(profile, pipeline, rank)
    return stage, held, tp_share(held, tp, stage)


def tp_share(profile: ModelProfile, tp: int, stage=None) -> ModelProfile:
    """The profile one tensor-parallel rank holds: every block matrix, the embedding and the head
    split tp ways (Megatron-LM's layout, as runtime/backends/tp.py applies it); norms replicated. `stage`
    (shares.StageShare): the profile is a pipeline rank's, holding the embedding and/or head."""
    if tp == 1:
        return profile
    d = profile.decoder
    if d is None:
        raise HybridError(f"tensor parallelism needs a transformer's dimensions; {profile.name} has none: use tp 1")
    import dataclasses
    matrices = sum(m[0] * m[1] for m in d.block_matrices() if len(m) == 2)      # the largest block's
    blocks = d.block_matmul_params
    if d.stack:      # read from a module: what its plan splits, layer by layer (model/tp_plan.py)
        from ..model.tp_plan import split_elements
        largest = max(set(d.stack), key=lambda ly: ly.params(d.hidden))
        matrices = split_elements(largest, d.hidden, d.tp_plan)
        blocks = sum(split_elements(ly, d.hidden, d.tp_plan) for ly in d.stack)
    if stage is None:
        head = d.vocab * d.hidden * (1 if d.tied else 2)      # embedding and (untied) head
    else:                                                      # a pipeline rank's embedding and/or head
        head = d.vocab * d.hidden * (stage.first + stage.last)
    sharded = blocks + head
    cut = sharded - sharded // tp
    frac = (profile.params - cut) / profile.params
    return dataclasses.replace(
        profile, params=profile.params - cut, trainable_params=round(profile.trainable_params * frac),
        param_bytes=round(profile.param_bytes * frac),
        dtype_bytes=tuple((k, round(v * frac)) for k, v in profile.dtype_bytes),
        block_params=profile.block_params - matrices + matrices // tp,
        root_params=profile.root_params - head + head // tp,
        largest_layer_params=max(1, profile.largest_layer_params // tp),
        largest_param=max(1, profile.largest_param // tp),
        factored_state=None if profile.factored_state is None else profile.factored_state // tp,
        optim_shapes=None if profile.optim_shapes is None else dataclasses.replace(
            profile.optim_shapes.scaled(frac, split=True), block_matrices=profile.optim_shapes.block_matrices // tp),
        quantized_params=profile.quantized_params // tp, quantized_bytes=profile.quantized_bytes // tp)


def local_spec(spec: TrainSpec, cp: int) -> TrainSpec:
    """The spec one cp rank's blocks see: S / cp tokens per sequence, causal SDPA attention (the
    CP attention is SDPA whatever the model's own attention setting)."""
    if cp == 1:
        return spec
    return replace(spec, seq_len=spec.seq_len // cp, attention="sdpa")


def share_activations(sh: Share, act: ActivationTerms, autocast: bool, notes: list[str]):
    """A decoder's activation terms (estimation/memory/activations.py) as this rank keeps them: split tp ways
    with sequence parallelism and vocab-parallel logits (Korthikanti et al. arXiv 2205.05198)
    except the two all-gathered block inputs the column-wise matmuls keep whole (what DTensor's
    ColwiseParallel saves for backward); S / cp long plus the gathered K and V with context
    parallelism (estimation/memory/cp.py); a pipeline rank's in-flight micro-batches' for its blocks.
    Returns (the terms, notes)."""
    from .memory.cp import with_gathered_kv
    from .memory.activations import checkpointed_blocks
    from ..config.spec import layer_every
    spec, tp, cp = sh.spec, sh.tp, sh.cp
    if tp > 1 and not (sh.sequence_parallel and sh.loss_parallel):
        raise HybridError(f"tensor parallel {tp} without sequence parallelism or the vocab-parallel loss is not "
                          "priced (the runtime applies both: hybrid/layout/applied.py); use tp 1")
    if tp > 1:
        # the attention and MLP inputs are all-gathered, and the column-wise matmuls keep them
        # whole: in every stored block, or only in the recomputed one under full checkpointing
        gathered = 2 * spec.bytes.compute * sh.whole.decoder.hidden * spec.tokens * (1 - 1 / tp)
        # without checkpointing the two gathered inputs are kept, under full they are recomputed; the
        # selective and per-op policies recompute them too (the all-gather is not in their saved set) but
        # keep matmul outputs, whole for the row-wise o and down projections before their reduce-scatter:
        # selective both (o's is popped by the recomputation), per-op down's (traced: pp 2 x tp 2,
        # tests/measure/test_matrix.py)
        stored, redone = {"none": (gathered, 0), "selective": (gathered, gathered / 2),
                          "op": (gathered / 2, gathered)}.get(spec.activation_checkpointing, (0, gathered))
        every = layer_every(spec.activation_checkpointing)
        if every is not None:        # layer:N: kept by the blocks it leaves whole (per_layer is their mean)
            layers = sh.profile.decoder.layers
            stored, redone = gathered * (layers - checkpointed_blocks(layers, every)) / layers, gathered
        # a read stack's attention: the mask each rank keeps whole, k and v views where a rank holds one kv head
        from .memory.activations import read_tp_terms
        whole, again = read_tp_terms(sh.profile.decoder, spec, autocast, tp)
        stored, redone = stored + whole, redone + again
        # the loss on the vocab shards in place of the replicated one (loss_terms' vocab_parallel:
        # torch's loss_parallel, or Megatron-LM's fused cross-entropy in place of Liger's), the
        # LoRA model's frozen-norm saving kept; the head's column-wise matmul keeps its input whole
        from .memory.activations import loss_terms
        plain, split = (loss_terms(sh.whole.decoder, spec, autocast, vocab_parallel=vp) for vp in (False, True))
        head_f, head_b = (act.head_forward + split[0] - plain[0], act.head_backward + split[1] - plain[1])
        head_in = gathered / 2
        act = replace(act, per_layer=int(act.per_layer / tp + stored), recompute=int(act.recompute / tp + redone),
                      head_forward=int(head_f / tp + head_in), head_backward=int(head_b / tp + head_in),
                      autocast_cache=int(act.autocast_cache / tp), backward_transient=int(act.backward_transient / tp),
                      block_input=int(act.block_input / tp))
        notes.append(f"tensor parallel {tp}: matrices, embedding and head split {tp} ways; sequence-parallel "
                     "activations; vocab-parallel logits")
    if cp > 1:
        act = with_gathered_kv(act, sh.whole.decoder, sh.whole_spec, cp, tp, autocast)
        notes.append(f"context parallel {cp}: each rank holds {sh.whole_spec.seq_len // cp} tokens of each "
                     "sequence and keeps every layer's gathered K/V (or recomputes them with checkpointing)")
    if sh.stage is not None:
        # a pipeline rank keeps the activations of its in-flight micro-batches (per the schedule,
        # hybrid/layout/pipeline.py) for its blocks only; the logits and loss only on the last stage
        act = replace(act, head_forward=act.head_forward if sh.has_head else 0,
                      head_backward=act.head_backward if sh.has_head else 0, layers=sh.stage.in_flight_layers)
    return act, notes


def whole_embedding_gradient(sh: Share) -> int:
    """Elements of the whole vocab x hidden gradient a tensor-parallel rank holding the embedding
    makes in its backward: DTensor's embedding backward (vocab-sharded weight, replicated ids)
    makes the whole gradient, not the shard (seen in the traced runs). 0 otherwise."""
    d = sh.whole.decoder
    return d.vocab * d.hidden if sh.tp > 1 and d is not None and sh.has_embedding else 0
