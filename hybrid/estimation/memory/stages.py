"""Per pipeline rank: each rank's analytic estimate of a staged layout (the pipeline's own memory
arithmetic, as estimation/memory/cp.py and estimation/memory/moe.py are cp's and ep's); a layout
without stages is one rank's estimate, so callers never ask which kind they have."""
from __future__ import annotations

from ...config.cluster import Cluster
from ...config.spec import TrainSpec
from ...layout.layout import Layout
from ...layout.pipeline import stage_cluster
from ...model.profile import ModelProfile
from .analytic import estimate
from .breakdown import MemoryBreakdown


def rank_estimates(layout: Layout, profile: ModelProfile, spec: TrainSpec,
                   cluster: Cluster) -> tuple[tuple[MemoryBreakdown, ...], int]:
    """(each pipeline rank's analytic estimate of a staged layout, the busiest rank); without
    stages the one rank's estimate, rank 0."""
    if layout.pipeline is None:
        return (estimate(layout, profile, spec, cluster),), 0
    stage_cl = stage_cluster(cluster, layout.dims.pp)
    per_rank = tuple(estimate(layout, profile, spec, stage_cl, r) for r in range(layout.dims.pp))
    return per_rank, max(range(len(per_rank)), key=lambda r: per_rank[r].total)
