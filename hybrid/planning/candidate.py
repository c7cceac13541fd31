"""The values a plan is made of: a Candidate (a Layout with its estimates and verdict) and the
Plan (every candidate, the choice and why). Pure; the planner (hybrid/planning/planner.py) makes them."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..estimation.calibration import MODEL_ERROR
from ..families.catalogue import Strategy
from ..config.cluster import Cluster
from ..estimation.cost.step import StepCost
from ..layout.layout import Layout
from ..estimation.memory.breakdown import MemoryBreakdown
from ..layout.dims import ParallelDims
from ..layout.pipeline import StageSplit
from ..model.profile import ModelProfile
from ..config.spec import TrainSpec
from .goodput import Goodput, Reliability

TIE = MODEL_ERROR
"""Predicted speeds within the model's error of the fastest are a tie, broken by simplicity."""


@dataclass(frozen=True)
class BatchChoice:
    """How one layout trains the global batch."""

    global_batch: int
    """Sequences per optimizer step over every data-parallel rank."""
    micro_batch: int
    """Sequences per rank per forward: the chosen one (or the pinned one)."""
    gradient_accumulation: int
    """Micro-batches per optimizer step on each data-parallel rank."""
    max_micro_batch: int | None
    """The largest micro-batch that fits among those the global batch allows on this layout;
    None when not even the smallest fits."""
    pinned: bool = False
    """The micro-batch was given (--micro-batch), not searched."""

    def describe(self) -> str:
        """`4 x 2 (max 8)`: micro-batch x accumulation, and the largest micro-batch that fits."""
        top = "-" if self.max_micro_batch is None else str(self.max_micro_batch)
        return f"{self.micro_batch} x {self.gradient_accumulation} (max {top})"

    def to_dict(self) -> dict:
        return {"global_batch": self.global_batch, "micro_batch": self.micro_batch,
                "gradient_accumulation": self.gradient_accumulation, "max_micro_batch": self.max_micro_batch,
                "micro_batch_pinned": self.pinned}


@dataclass(frozen=True)
class Candidate:
    """One layout with its estimates."""

    layout: Layout
    spec: TrainSpec
    """The job as this layout runs it (its checkpointing, compile and float8; at a global batch its
    micro-batch and accumulation)."""
    memory: MemoryBreakdown | None
    """None when the strategy cannot run this job at all (see reason)."""
    fits: bool
    reason: str
    cost: StepCost | None = None
    stage_memory: tuple[MemoryBreakdown, ...] = ()
    """Every pipeline rank's analytic estimate, one without stages (`memory` is the busiest one's, or the
    estimator's for it)."""
    tight: bool = False
    """It fits (`fits`) only because the allocator gives its cache back under pressure: the
    predicted reserved memory does not fit, the live tensors, context and floor do."""

    def __post_init__(self):
        if self.tight and not (self.fits and self.cost is not None):
            raise ValueError(f"{self.layout.label}: a tight candidate fits and has a step time")

    @property
    def known_to_fit(self) -> bool:
        """It fits and everything it needs was estimated (a bare parameter count's activations are
        not): only such a candidate is chosen, emitted or called `fits` in JSON."""
        return self.fits and self.memory is not None and self.memory.activations is not None

    @property
    def verdict(self) -> str:
        """fits | tight | OOM (n/a: the strategy cannot run the job; states: only the model states
        are known to fit, a bare parameter count's activations being unknown)."""
        if self.memory is None:
            return "n/a"
        if not self.fits:
            return "OOM"
        if self.memory.activations is None:
            return "states"
        return "tight" if self.tight else "fits"

    batch: BatchChoice | None = None
    """At a global batch (spec.global_batch): the micro-batch and accumulation this layout trains
    it with, and the largest micro-batch that fits (hybrid/planning/batch.py). None: the spec's, as given."""
    goodput: Goodput | None = None
    """Its checkpoints, restarts and the useful rate after failures (hybrid/planning/goodput.py); None
    without a step time."""

    @property
    def rank_time(self) -> float:
        """GPU-seconds per useful token, what the planner ranks by: the step's time per token over the
        goodput fraction (failures, restarts and checkpoints), the step's alone without a goodput."""
        if self.goodput is not None:        # no useful work at all (failures faster than restarts): never first
            return self.cost.time_per_token / self.goodput.fraction if self.goodput.fraction > 0 else math.inf
        return self.cost.time_per_token

    @property
    def strategy(self) -> Strategy:
        return self.layout.dp

    @property
    def parallel(self) -> ParallelDims:
        """How the world is laid out for this candidate (dp_replicate x dp_shard x cp x tp x pp)."""
        return self.layout.dims

    @property
    def pipeline(self) -> StageSplit | None:
        """The stages and schedule when pp > 1."""
        return self.layout.pipeline

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def shard_size(self) -> int:
        """Ranks one copy of the model state is sharded over (parallel.dp_shard)."""
        return self.parallel.dp_shard

    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def pp(self) -> int:
        return self.parallel.pp

    @property
    def cp(self) -> int:
        return self.parallel.cp

    @property
    def ep(self) -> int:
        return self.parallel.ep

    @property
    def label(self) -> str:
        return self.layout.label

    def to_dict(self) -> dict:
        m = self.memory
        return {
            **{k: v for k, v in self.layout.to_dict().items() if k != "pipeline"},
            "per_gpu": m.to_dict() if m else None,
            "allocated_bytes": m.allocated if m else None,
            "reserved_bytes": m.reserved if m else None,
            "per_cpu": {"total": m.cpu if m else 0},
            "model_states": m.model_states if m else None,
            "phase": m.phase if m else None,
            # "fits": the whole step is known to fit; a bare parameter count knows only the model states
            "fits": self.known_to_fit, "verdict": self.verdict,
            "floor_bytes": m.floor if m else None, "activations_known": m is not None and m.activations is not None,
            "reason": self.reason,
            **(self.cost.to_dict() if self.cost else {}),
            **(self.goodput.to_dict() if self.goodput else {}),
            "notes": list(m.notes) if m else [],
            **({"batch": self.batch.to_dict()} if self.batch is not None else {}),
            **self.layout.stages_dict(self.stage_memory),
        }


def fastest_fitting(cands, known: bool = True, rate=None) -> Candidate | None:
    """The candidate known to fit (with known=False: whose estimated part fits) that is predicted
    fastest, among those that fit with room when any does (tight ones run only by the allocator's
    retries). `rate`: GPU-seconds per token to rank by (default Candidate.rank_time, by useful tokens)."""
    rate = rate or (lambda c: c.rank_time)
    ok = (lambda c: c.known_to_fit) if known else (lambda c: c.fits)
    fitting = [c for c in cands if ok(c) and not c.tight] or [c for c in cands if ok(c)]
    return min(fitting, key=rate) if fitting else None


@dataclass(frozen=True)
class Plan:
    model: ModelProfile
    cluster: Cluster
    spec: TrainSpec
    candidates: tuple[Candidate, ...]
    chosen: Candidate | None
    method: str = "analytic"
    suggestions: tuple[str, ...] = ()
    """When nothing fits: the smallest changes that would make something fit."""
    tie: float = TIE
    """Predicted speeds within this fraction of the fastest were a tie, broken by simplicity."""
    calibration: object | None = None
    """The calibration.Calibration the cluster's speed figures came from, if any."""
    reliability: Reliability | None = None
    """The failure rate and storage bandwidth the goodput was priced at (hybrid/planning/goodput.py)."""
    by_speed: Candidate | None = None
    """The choice on step time alone, where goodput changed it (None: the same choice)."""
    batch_implied: bool = False
    """spec.global_batch was not given but implied (planner.implied_batch: micro-batch x accumulation x
    world size), and every row holds it."""

    @property
    def fastest(self) -> Candidate | None:
        """The fitting candidate predicted fastest (the chosen one unless a tie went to a simpler one),
        among those that fit with room when any does (as choose() picks)."""
        return fastest_fitting(self.candidates)

    @property
    def missing(self) -> tuple[str, ...]:
        """What was not estimated, when that alone kept every candidate from being chosen (or the
        choice was made without it: auto_wrap's, on model states alone)."""
        if self.chosen is None and any(c.fits and c.memory.activations is None for c in self.candidates):
            return ("activations",)
        if self.chosen is not None and self.chosen.memory.activations is None:
            return ("activations",)
        return ()

    @property
    def model_flops_per_token(self) -> float:
        """Training FLOPs per token, forward and backward, without recomputation (the MFU numerator:
        hybrid.estimation.cost.step.model_flops_per_token)."""
        from ..estimation.cost.step import model_flops_per_token
        return model_flops_per_token(self.model, self.spec.seq_len)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of the chosen layout (the world when nothing was chosen)."""
        return self.chosen.parallel.dp_size if self.chosen else self.cluster.world_size

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: micro-batch x accumulation x data-parallel ranks (the
        job's global batch when it was given: every candidate trains it)."""
        if self.spec.global_batch is not None:
            return self.spec.global_batch
        return self.spec.micro_batch * self.spec.gradient_accumulation * self.dp_size

    def __str__(self) -> str:
        """The decision: one row per strategy (its best variant) with the reason, and the choice."""
        from .report import format_plan
        return format_plan(self, summary=True)

    def to_dict(self) -> dict:
        """The JSON contract shared by `hybrid estimate` and `hybrid plan` (see README)."""
        c = self.chosen
        return {
            "model": self.model.name, "params": self.model.params, "active_params": self.model.active_params,
            "model_flops_per_token": self.model_flops_per_token, "world_size": self.cluster.world_size,
            "capacity_bytes": self.cluster.capacity_bytes,
            "chosen": c.name if c else None,
            "chosen_candidate": ({"name": c.name, "shard_size": c.shard_size, "parallel": c.parallel.to_dict(),
                                  "activation_checkpointing": c.spec.activation_checkpointing} if c else None),
            "method": self.method, "gpu": self.cluster.gpu.name, "nodes": self.cluster.nodes,
            "gpus_per_node": self.cluster.gpus_per_node, "scale_up_domain": self.cluster.domain,
            "software": self.cluster.gpu.software, "collectives": self.cluster.gpu.collectives,
            "spec": self.spec.to_dict(),
            "global_batch": self.global_batch,
            "strategies": [x.to_dict() for x in self.candidates],
            "suggestions": list(self.suggestions), "missing": list(self.missing), "tie": self.tie,
            "calibration": self.calibration.path if self.calibration is not None else None,
            **(self.reliability.to_dict() if self.reliability is not None else {}),
            **({"chosen_by_speed": self.by_speed.label} if self.by_speed is not None else {}),
        }
