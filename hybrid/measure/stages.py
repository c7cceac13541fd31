"""Each pipeline rank traced: without stages the whole job's rank, with stages that rank's stage in a
process of its own (the traced half of estimation/memory/stages.py)."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..config.cluster import Cluster
from ..config.spec import TrainSpec
from ..errors import HybridError
from ..layout.layout import Layout
from ..model.sources import ModelSource

if TYPE_CHECKING:
    from .traced import Traced


def traced_rank(source: ModelSource, layout: Layout, spec: TrainSpec, cluster: Cluster, rank: int = 0,
                prefer_hf: bool = True, strategies_dir=(), cache=None, beyond: int | None = None) -> "Traced":
    """Pipeline rank `rank` of `layout`'s job traced, its memory noted with what ran: without stages
    the whole job's rank (traced_estimate); with stages that rank's stage (traced_stage_estimate)
    in a fresh process, as each needs a fake process group of its own rank. `cache` (traced.TraceCache):
    the traces of candidates already judged, reused where this rank runs the same program. `beyond`: a rank
    without stages whose states alone exceed it is not traced (traced_estimate)."""
    from .traced import IMPLEMENTATIONS, traced_estimate, traced_stage_in_process

    d, s = layout.dims, layout.dp
    shard = d.dp_shard if s.shard_is_free else None
    if layout.pipeline is None:
        t = traced_estimate(source, s, spec, cluster, shard, prefer_hf=prefer_hf, tp=d.tp, cp=d.cp, ep=d.ep,
                            cache=cache, beyond=beyond)
        if not t.traced:
            return t
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


