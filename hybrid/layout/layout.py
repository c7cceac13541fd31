"""Layout: the one value a candidate is (pure, no torch).

    Layout(dims, dp, ac, schedule, pipeline, compile, float8)

`dims` says how the world's ranks split (ParallelDims: dp_replicate x dp_shard x cp x tp x pp,
ep inside dp_shard x cp), `dp` is the data-parallel preset (its family and knobs, from the
catalogue), `ac` the activation checkpointing, `schedule` and `pipeline` the pipeline's schedule
and, once judged, its stage split, `compile` and `float8` how the blocks run. Enumeration yields
Layouts, the estimators and the cost model take one, and `simplicity` is the one tie-break.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..errors import HybridError
from .dims import ParallelDims
from .pipeline import SCHEDULES, StageSplit, stage_cluster
from ..config.spec import TrainSpec, checkpointing, layer_every

if TYPE_CHECKING:
    from ..families.catalogue import Strategy
    from ..config.cluster import Cluster

DIMENSIONS = {"tp": "tensor parallelism", "pp": "pipeline stages", "cp": "context parallelism",
              "ep": "expert parallelism"}
"""The model-parallel dimensions of ParallelDims beside data parallelism, in their flags' order
(the order their checks run in), with what each is called in messages."""
AC_ORDER = {"none": 0, "selective": 1, "full": 2}
"""Checkpointing modes the planner searches, simplest first (op and layer:N when asked for)."""


def _ac_rank(mode: str) -> float:
    """none < layer:N < op = selective < full."""
    return AC_ORDER.get(mode, 0.5 if layer_every(mode) is not None else 1)


@dataclass(frozen=True)
class Layout:
    """Everything one candidate is: how the ranks split and how each dimension runs."""

    dims: ParallelDims
    """Ranks per dimension (validated against the cluster by Layout.of)."""
    dp: "Strategy"
    """The data-parallel preset: its family (ddp, fsdp, deepspeed) and that family's knobs."""
    ac: str = "none"
    """Activation checkpointing: none, selective, op, full or layer:N."""
    schedule: str | None = None
    """The pipeline schedule (1f1b, gpipe, interleaved) when dims.pp > 1; None without stages."""
    pipeline: StageSplit | None = None
    """The stage split once judged (planning/stages.stage_split); None before, and without stages."""
    compile: bool = False
    """torch.compile each block (hybrid/runtime/compile.py)."""
    float8: bool = False
    """torchao float8 linears in the blocks (behind compile)."""

    def __post_init__(self):
        object.__setattr__(self, "ac", checkpointing(self.ac))
        staged = self.dims.pp > 1
        if staged != (self.schedule is not None):
            raise HybridError(f"a pipeline schedule goes with pp > 1 (pp {self.dims.pp}, schedule {self.schedule!r})")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise HybridError(f"unknown pipeline schedule {self.schedule!r}; use one of {', '.join(SCHEDULES)}")
        if self.pipeline is not None and (self.pipeline.pp != self.dims.pp or self.pipeline.schedule != self.schedule):
            raise HybridError(f"pipeline {self.pipeline.describe()} does not match pp {self.dims.pp} {self.schedule}")
        if self.float8 and not self.compile:
            raise HybridError("float8 runs behind torch.compile: set compile too")

    @classmethod
    def of(cls, strategy: "Strategy", cluster: "Cluster", spec: TrainSpec | None = None, *,
           shard_size: int | None = None, tp: int = 1, cp: int = 1, pp: int = 1,
           schedule: str | None = None, ep: int = 1) -> "Layout":
        """The layout of `strategy` on `cluster` at these degrees: its shard size (the preset's rule
        on one pipeline stage's ranks, or `shard_size` where the preset leaves it free), the rest of
        the data-parallel ranks replicas; checkpointing, compile and float8 from `spec`."""
        spec = spec or TrainSpec()
        stage = stage_cluster(cluster, pp)
        n = strategy.shard_size(stage, shard_size, tp, cp)
        dims = ParallelDims(dp_replicate=stage.world_size // tp // cp // n, dp_shard=n, cp=cp, tp=tp, pp=pp, ep=ep)
        dims.validate(cluster.world_size, cluster.gpus_per_node, cluster.domain)
        return cls(dims, strategy, spec.activation_checkpointing, (schedule or "1f1b") if pp > 1 else None,
                   None, spec.compile, spec.float8)

    def check(self, profile) -> None:
        """NotApplicable, with the reason, when this layout cannot run the job: its family's rules
        (Family.check), then the combinations not run here."""
        from ..errors import NotApplicable
        d = self.dims
        self.dp.family_obj.check(self)
        if d.tp > 1 and self.float8:
            raise NotApplicable("float8 with tensor parallelism (torchao's Float8ColwiseParallel) is not applied "
                                "here; float8 layouts run at tp 1")
        if d.cp > 1 and self.compile:
            raise NotApplicable("compile with cp > 1: the K/V all-gather inside a fullgraph-compiled block has not "
                                "run here; use compile with cp 1, or cp without compile")
        if d.cp > 1 and profile.decoder is None:
            raise NotApplicable("context parallelism splits a transformer's sequence; this model has no known "
                                "decoder shape: use cp 1")

    def train_spec(self, spec: TrainSpec) -> TrainSpec:
        """The job's spec run under this layout (its checkpointing, compile and float8)."""
        if spec.activation_checkpointing == self.ac and spec.compile is self.compile and spec.float8 is self.float8:
            return spec                 # already so (a judged layout's spec): no copy to validate again
        return replace(spec, activation_checkpointing=self.ac, compile=self.compile, float8=self.float8)

    def with_pipeline(self, pipeline: StageSplit) -> "Layout":
        return replace(self, pipeline=pipeline)

    @property
    def name(self) -> str:
        return self.dp.name

    @property
    def label(self) -> str:
        """fsdp+cp2+tp4+pp2:interleaved+ac:full (the parts that are used)."""
        d = self.dims
        pipe = "" if self.schedule is None else f"+pp{d.pp}" + (      # split or not (a rejected one)
            "" if self.schedule == "1f1b" else f":{self.schedule}")
        return (self.name + ("" if d.cp == 1 else f"+cp{d.cp}") + ("" if d.ep == 1 else f"+ep{d.ep}")
                + ("" if d.tp == 1 else f"+tp{d.tp}")
                + pipe + ("" if self.ac == "none" else f"+ac:{self.ac}"))

    @property
    def simplicity(self) -> tuple:
        """The tie-break, simplest first: no host offload, then fewer model-parallel dimensions
        (pipeline, tensor parallel, then context parallel: tp splits every matrix and adds four
        activation collectives per block, cp leaves the matrices whole and exchanges K/V once per
        layer; then expert parallel: four all-to-alls per MoE layer and a rank's load set by the
        routing), then the simpler preset (its YAML `complexity`, else its family's rank of its
        knobs), less recomputation, the wider shard group."""
        d = self.dims
        return (self.dp.offload, d.pp, d.tp, d.cp, d.ep, self.dp.complexity, _ac_rank(self.ac), -d.dp_shard)

    def used(self) -> dict[str, int]:
        """The model-parallel dimensions this layout splits (degree above 1), in DIMENSIONS' order."""
        return {dim: n for dim in DIMENSIONS if (n := getattr(self.dims, dim)) > 1}

    def local_batch(self, spec: TrainSpec) -> int:
        """Sequences one rank takes per optimizer step window of its schedule: the micro-batch, times
        the pipeline's micro-batches when staged (they run in one schedule step)."""
        return spec.micro_batch * (1 if self.pipeline is None else self.pipeline.micro_batches)

    def pipeline_note(self, bubble: bool = False) -> str:
        """"; <the stage split>" (or its bubble share with `bubble`) for a staged layout, else ""."""
        if self.pipeline is None:
            return ""
        return f"; bubble {self.pipeline.bubble:.0%}" if bubble else f"; {self.pipeline.describe()}"

    def stages_dict(self, stage_memory) -> dict:
        """The JSON contract's "pipeline" entry (the split and each pipeline rank's estimate) for a
        staged layout, else nothing."""
        if self.pipeline is None:
            return {}
        p = self.pipeline
        return {"pipeline": {**p.to_dict(),
                             "stages": [{"rank": r, "blocks": sum(p.blocks[i] for i in p.rank_stages(r)),
                                         "in_flight": p.in_flight(r), "phase": sm.phase, "per_gpu": sm.to_dict()}
                                        for r, sm in enumerate(stage_memory)]}}

    def to_dict(self) -> dict:
        out = {"name": self.name, "family": self.dp.family, "shard_size": self.dims.dp_shard,
               "parallel": self.dims.to_dict(), "activation_checkpointing": self.ac}
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline.to_dict()
        return out


def as_layout(layout, cluster: "Cluster", spec: TrainSpec | None = None) -> Layout:
    """A Layout as given, or a bare Strategy's default layout on the cluster (Layout.of)."""
    return layout if isinstance(layout, Layout) else Layout.of(layout, cluster, spec)
