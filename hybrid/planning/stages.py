"""The stage split of a pp > 1 layout: a layout decision, made once before a candidate is judged,
which the memory model prices (each split's analytic estimate per rank balances the blocks)."""
from __future__ import annotations

from ..config.cluster import Cluster
from ..config.spec import TrainSpec
from ..estimation.memory.analytic import estimate
from ..families.placement import NotApplicable
from ..layout.layout import Layout
from ..layout.pipeline import VIRTUAL, StageSplit, balanced_split, even_split, interleaved_problem, stage_cluster
from ..model.profile import ModelProfile


def staged(layout: Layout, profile: ModelProfile, spec: TrainSpec, cluster: Cluster) -> Layout:
    """The layout with its stage split (stage_split) when it has pipeline ranks; as it is
    without. NotApplicable where the blocks cannot be split so."""
    if layout.dims.pp == 1:
        return layout
    return layout.with_pipeline(stage_split(layout, profile, spec, stage_cluster(cluster, layout.dims.pp)))


def stage_split(layout: Layout, profile: ModelProfile, spec: TrainSpec, stage_cl: Cluster) -> StageSplit:
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
        if interleaved_problem(pp, m):
            raise NotApplicable(interleaved_problem(pp, m))
        return StageSplit(pp, schedule, m, even_split(L, pp * VIRTUAL), VIRTUAL)
    if L < pp:
        raise NotApplicable(f"{pp} stages need at least {pp} blocks; the model has {L}")
    if L < 2 * pp:
        return StageSplit(pp, schedule, m, even_split(L, pp))

    def totals(k: int) -> list[int]:
        split = StageSplit(pp, schedule, m, (k,) * pp)
        return [estimate(layout.with_pipeline(split), profile, spec, stage_cl, r).total for r in range(pp)]
    one, two = totals(1), totals(2)
    per_block = [b - a for a, b in zip(one, two)]
    return StageSplit(pp, schedule, m, balanced_split(L, [a - d for a, d in zip(one, per_block)], per_block))
