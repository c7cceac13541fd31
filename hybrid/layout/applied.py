"""AppliedPlan: what `parallelize` applies to a model, decided before anything is applied (pure,
no torch).

    applied_plan(layout, implementation) -> AppliedPlan

One value per (layout, implementation): which code runs (hybrid's decoder, the transformers
model, a user's module), the data-parallel wrap and its units (FSDP2 units per block plus the
root, whether they reshard after forward, or DDP's buckets), the tensor-parallel styles and
whether sequence parallelism and the vocab-parallel loss are on, each pipeline rank's stages,
expert dispatch, context parallelism, checkpointing, compile and float8. The runtime
(hybrid/runtime/parallelize.py) derives it with this function and applies what it says; the
closed-form estimate (hybrid/estimation/shares.py, memory/analytic.py) and the trace read the
same value, so a runtime choice that changes memory cannot go unpriced.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import HybridError
from ..memo import memoised

IMPLEMENTATIONS = ("hybrid", "transformers", "module")
"""hybrid's own decoder, a transformers decoder, or another module (a user's, a factory's)."""

OUR_TP_STYLES = (("embed", "rowwise: vocab-sharded, sequence-sharded output"),
                 ("blocks.*.norm1, blocks.*.norm2, norm", "sequence parallel"),
                 ("blocks.*.attn, blocks.*.mlp", "input all-gathered from the sequence shard"),
                 ("blocks.*.attn.{q,k,v}_proj, blocks.*.mlp.{gate,up}_proj", "colwise"),
                 ("blocks.*.attn.o_proj, blocks.*.mlp.down_proj", "rowwise: output reduce-scattered on the sequence"),
                 ("lm_head", "colwise: vocab-sharded logits (loss parallel)"))
"""hybrid's decoder under tp (runtime/backends/tp.py _our_plan)."""

HF_TP_STYLES = (("model.embed_tokens", "rowwise: vocab-sharded, replicated output"),
                ("model.layers.0", "input split to this rank's sequence shard"),
                ("model.layers.*.*norm*, model.norm", "sequence parallel"),
                ("model.layers.*.self_attn.{q,k}_norm", "this rank's heads, weight gradient all-reduced"),
                ("model.layers.*.self_attn, model.layers.*.mlp", "input all-gathered from the sequence shard"),
                ("base_model_tp_plan colwise", "colwise"),
                ("base_model_tp_plan rowwise", "rowwise: output reduce-scattered on the sequence"),
                ("lm_head", "colwise: vocab-sharded logits (loss parallel)"))
"""A transformers decoder under tp (runtime/backends/tp.py _hf_plan): the model's own
base_model_tp_plan for the projections, sequence parallelism and the vocab-parallel loss."""

HF_STAGE_TP_STYLES = (("model.embed_tokens", "rowwise: vocab-sharded, sequence-sharded output"),
                      *HF_TP_STYLES[2:])
"""... cut into pipeline stages (runtime/stages.HFDecoderStage, which takes its positions from the token
ids): the embedding's output is this rank's sequence shard, as our decoder's."""


@dataclass(frozen=True)
class AppliedPlan:
    """What runs on each rank of a layout."""

    implementation: str
    """'hybrid', 'transformers' or 'module' (IMPLEMENTATIONS)."""
    wrap: str
    """The data-parallel wrap that runs: 'ddp' (torch's DDP, buckets), 'fsdp' (fully_shard) or
    'deepspeed' (deepspeed.initialize)."""
    units: str
    """'blocks+root' (a fully_shard unit per block, then the root) or 'buckets' (DDP)."""
    reshards: bool | None
    """fully_shard's reshard_after_forward; None when the wrap is not FSDP2's."""
    autocast: bool
    """Mixed precision runs under torch.autocast (DDP) rather than MixedPrecisionPolicy's casts."""
    tp: int = 1
    tp_styles: tuple = ()
    """(module pattern, style) pairs; empty with tp 1."""
    sequence_parallel: bool = False
    """The residual stream, norms and block outputs are sequence-sharded over tp."""
    loss_parallel: bool = False
    """The logits stay vocab-sharded and the loss runs on the shards (torch's loss_parallel)."""
    stages: tuple = ()
    """Per pipeline rank, its stage indices; empty without stages."""
    cp: int = 1
    ep: int = 1
    expert_dispatch: str | None = None
    """'all-to-all' over the ep ranks when ep > 1."""
    checkpointing: str = "none"
    compile: bool = False
    float8: bool = False

    @property
    def staged(self) -> bool:
        return bool(self.stages)

    def describe(self) -> str:
        """One line: what runs."""
        reshard = "" if self.reshards is None else f", reshard after forward: {self.reshards}"
        parts = [self.implementation, f"{self.wrap} ({self.units}{reshard})"]
        if self.tp > 1:
            parts.append(f"tp {self.tp}" + (" + sequence parallel" if self.sequence_parallel else "")
                         + (" + loss parallel" if self.loss_parallel else ""))
        if self.stages:
            parts.append(f"pp {len(self.stages)}: stages {list(map(list, self.stages))}")
        if self.cp > 1:
            parts.append(f"cp {self.cp}")
        if self.ep > 1:
            parts.append(f"ep {self.ep} ({self.expert_dispatch})")
        parts.append(f"checkpointing {self.checkpointing}")
        if self.compile:
            parts.append("compiled" + (" float8" if self.float8 else ""))
        return ", ".join(parts)


def applied_plan(layout, implementation: str = "hybrid", precision: str = "bf16-mixed") -> AppliedPlan:
    """What parallelize applies for `layout` (hybrid.layout.layout.Layout) on `implementation`'s
    module; the family says its wrap (Family.applied_wrap). tp on a module that is neither hybrid's
    decoder nor a transformers decoder has no plan: HybridError, one line."""
    return _applied_plan(layout, implementation, precision)


@memoised               # a plan asks for each layout's many times
def _applied_plan(layout, implementation: str, precision: str) -> AppliedPlan:
    if implementation not in IMPLEMENTATIONS:
        raise HybridError(f"unknown implementation {implementation!r}; use one of {', '.join(IMPLEMENTATIONS)}")
    dims = layout.dims
    staged = dims.pp > 1
    wrap, units, reshard, autocast = layout.dp.family_obj.applied_wrap(layout, staged)
    tp_styles, sp = (), False
    if dims.tp > 1:
        if implementation == "module":
            raise HybridError("tensor parallelism has a plan for hybrid's decoders and transformers decoders with a "
                              "base_model_tp_plan, not for this module: use tp=1")
        hf = HF_STAGE_TP_STYLES if staged else HF_TP_STYLES
        tp_styles, sp = (OUR_TP_STYLES if implementation == "hybrid" else hf), True
    pipe = layout.pipeline
    stages = tuple(tuple(pipe.rank_stages(r)) for r in range(pipe.pp)) if pipe is not None else ()
    return AppliedPlan(
        implementation=implementation, wrap=wrap, units=units, reshards=reshard,
        autocast=autocast and precision in ("bf16-mixed", "fp16-mixed"), tp=dims.tp, tp_styles=tp_styles,
        sequence_parallel=sp, loss_parallel=sp, stages=stages, cp=dims.cp, ep=dims.ep,
        expert_dispatch="all-to-all" if dims.ep > 1 else None, checkpointing=layout.ac, compile=layout.compile,
        float8=layout.float8)
