"""Per pipeline rank: the stage split of a pp > 1 layout and each rank's analytic estimate (the
pipeline's own memory arithmetic, as memory/cp.py and memory/moe.py are cp's and ep's).

A layout without stages is one rank's estimate; with stages every pipeline rank is estimated on
its stage's share of the cluster, and one rank is traced as a stage, so callers (the planner, the
traced estimator) never ask which kind they have."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..cluster import Cluster
from ..errors import HybridError
from ..layout import Layout
from ..pipeline import VIRTUAL, PipelineLayout, balanced_split, even_split, stage_cluster
from ..profile import ModelProfile, ModelSource
from ..spec import TrainSpec
from .analytic import estimate
from .breakdown import MemoryBreakdown
from .placement import NotApplicable

if TYPE_CHECKING:
    from .traced import Traced


def staged(layout: Layout, profile: ModelProfile, spec: TrainSpec, cluster: Cluster) -> Layout:
    """The layout with its stage split (pipeline_layout) when it has pipeline ranks; as it is
    without. NotApplicable where the blocks cannot be split so."""
    if layout.dims.pp == 1:
        return layout
    return layout.with_pipeline(pipeline_layout(layout, profile, spec, stage_cluster(cluster, layout.dims.pp)))


def rank_estimates(layout: Layout, profile: ModelProfile, spec: TrainSpec,
                   cluster: Cluster) -> tuple[tuple[MemoryBreakdown, ...], int]:
    """(each pipeline rank's analytic estimate of a staged layout, the busiest rank); without
    stages the one rank's estimate, rank 0."""
    if layout.pipeline is None:
        return (estimate(layout, profile, spec, cluster),), 0
    stage_cl = stage_cluster(cluster, layout.dims.pp)
    per_rank = tuple(estimate(layout, profile, spec, stage_cl, r) for r in range(layout.dims.pp))
    return per_rank, max(range(len(per_rank)), key=lambda r: per_rank[r].total)


def traced_rank(source: ModelSource, layout: Layout, spec: TrainSpec, cluster: Cluster, rank: int = 0,
                prefer_hf: bool = True, strategies_dir=()) -> "Traced":
    """Pipeline rank `rank` of `layout`'s job traced, its memory noted with what ran: without stages
    the whole job's rank (traced_estimate); with stages that rank's stage (traced_stage_estimate)
    in a fresh process, as each needs a fake process group of its own rank."""
    from .traced import IMPLEMENTATIONS, traced_estimate, traced_stage_in_process

    d, s = layout.dims, layout.dp
    shard = d.dp_shard if s.shard_is_free else None
    if layout.pipeline is None:
        t = traced_estimate(source, s, spec, cluster, shard, prefer_hf=prefer_hf, tp=d.tp, cp=d.cp, ep=d.ep)
        note = f"traced on {IMPLEMENTATIONS[t.implementation]} ({t.implementation})"
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        from concurrent.futures.process import BrokenProcessPool

        # a worker that dies (out of memory) breaks the pool instead of leaving us waiting
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            try:
                t = pool.submit(traced_stage_in_process, source.ref, s.name, strategies_dir, spec, cluster, shard,
                                d.tp, layout.pipeline, rank).result()
            except BrokenProcessPool:
                raise HybridError(f"tracing pp rank {rank} died (killed, e.g. out of host memory); use --method "
                                  "analytic") from None
        note = f"traced pp rank {rank} (the busiest) on hybrid's own implementation"
    return replace(t, memory=replace(t.memory, notes=t.memory.notes + (note,)))


def pipeline_layout(layout: Layout, profile: ModelProfile, spec: TrainSpec, stage_cl: Cluster) -> PipelineLayout:
    """The stages of a pp > 1 layout. 1f1b and gpipe: blocks per rank balanced on the analytic
    memory of each rank (its embedding or head, and per block its states and in-flight
    activations: linear in the block count, so two estimates per rank fix it); interleaved: two
    chunks per rank, as even as the block count allows."""
    pp, schedule = layout.dims.pp, layout.schedule
    if profile.decoder is None or profile.num_blocks == 0:
        raise NotApplicable("pipeline stages split a transformer's blocks; this model has no known decoder shape")
    L, m = profile.num_blocks, spec.gradient_accumulation
    if schedule == "1f1b" and m < pp:
        raise NotApplicable(f"1f1b needs at least pp = {pp} micro-batches (--gradient-accumulation {pp} or more); "
                            "gpipe runs fewer")
    if schedule == "interleaved":
        if L < pp * VIRTUAL:
            raise NotApplicable(f"interleaved needs at least {pp * VIRTUAL} blocks for its {pp * VIRTUAL} chunks")
        return PipelineLayout(pp, schedule, m, even_split(L, pp * VIRTUAL), VIRTUAL)
    if L < pp:
        raise NotApplicable(f"{pp} stages need at least {pp} blocks; the model has {L}")
    if L < 2 * pp:
        return PipelineLayout(pp, schedule, m, even_split(L, pp))

    def totals(k: int) -> list[int]:
        lay = PipelineLayout(pp, schedule, m, (k,) * pp)
        return [estimate(layout.with_pipeline(lay), profile, spec, stage_cl, r).total for r in range(pp)]
    one, two = totals(1), totals(2)
    per_block = [b - a for a, b in zip(one, two)]
    return PipelineLayout(pp, schedule, m, balanced_split(L, [a - d for a, d in zip(one, per_block)], per_block))
