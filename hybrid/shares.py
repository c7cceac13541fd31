"""What one rank of a layout holds and computes (pure, no torch), composed in one place and one
order: its pipeline stage's blocks, then its share of each sequence (context parallel), then of
each matrix (tensor parallel). The memory estimate and the cost model both start here."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import HybridError
from .profile import ModelProfile, tp_share
from .spec import TrainSpec


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


def stage_share(profile: ModelProfile, pipeline, rank: int) -> ModelProfile:
    """The profile of pipeline rank `rank` under `pipeline` (hybrid.pipeline.PipelineLayout): its
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
    params = st.blocks * profile.block_params + root
    frac = params / profile.params
    return dataclasses.replace(
        profile, name=f"{profile.name} [pp rank {rank}]", params=params,
        trainable_params=round(profile.trainable_params * frac), param_bytes=round(profile.param_bytes * frac),
        dtype_bytes=tuple((k, round(v * frac)) for k, v in profile.dtype_bytes), num_blocks=st.blocks,
        root_params=root, factored_state=None if profile.factored_state is None else round(profile.factored_state * frac),
        tied_groups=(), decoder=dataclasses.replace(d, layers=st.blocks))


def stage_of(profile: ModelProfile, pipeline, rank: int) -> StageShare:
    """Where pipeline rank `rank` sits: its blocks, first or last, what it keeps in flight."""
    stages = pipeline.rank_stages(rank)
    blocks = sum(pipeline.blocks[i] for i in stages)
    return StageShare(rank, pipeline.pp, blocks, 0 in stages, pipeline.stages - 1 in stages,
                      pipeline.in_flight_layers(rank), pipeline.in_flight(rank),
                      profile.decoder.hidden if profile.decoder else 0)


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
    """The job on this rank: each sequence S / cp long (memory/cp.local_spec)."""
    tp: int
    cp: int

    @property
    def has_head(self) -> bool:
        """The rank computes the logits and the loss (the last stage, or every rank without stages)."""
        return self.stage is None or self.stage.last

    @property
    def has_embedding(self) -> bool:
        return self.stage is None or self.stage.first

    @property
    def loss_outside_forward(self) -> bool:
        """The loss is scored outside the model's forward (context parallelism, backends/cp.py)."""
        return self.cp > 1


def shares(profile: ModelProfile, layout, spec: TrainSpec, rank: int = 0) -> Share:
    """Rank `rank` of the pipeline (0 without one) under `layout`: pipeline stage, then cp, then tp."""
    from .memory.cp import local_spec
    stage, held = None, profile
    if layout.pipeline is not None:
        stage, held = stage_of(profile, layout.pipeline, rank), stage_share(profile, layout.pipeline, rank)
    tp, cp = layout.dims.tp, layout.dims.cp
    return Share(whole=profile, whole_spec=spec, stage=stage, held=held, profile=tp_share(held, tp, stage),
                 spec=local_spec(spec, cp), tp=tp, cp=cp)
