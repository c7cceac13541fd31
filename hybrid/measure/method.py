"""The memory methods that run the job, as the planner's estimator: `traced` (one rank on fake
tensors, seconds per layout) and `measured` (the real job on this machine's ranks). Which degrees
each runs is planning/reach.METHOD_REACH; the planner asks `runs(layout)` before and calls
`estimator(layout, spec, rank)` for the busiest pipeline rank (rank 0 without stages)."""
from __future__ import annotations

from dataclasses import replace

from ..config.cluster import Cluster
from ..errors import HybridError
from ..layout.layout import Layout
from ..model.sources import ModelSource
from ..config.spec import TrainSpec
from ..estimation.memory.breakdown import MemoryBreakdown


class RunEstimator:
    """A traced or measured estimate of each layout the planner judges, with an optional progress
    reporter (`expect(total)`, `begin(what)`, `end(result)`: the CLI's stderr bar)."""

    def __init__(self, method: str, source: ModelSource, cluster: Cluster, prefer_hf: bool = True,
                 strategies_dir=(), progress=None):
        from .measured import check_runnable
        from .traced import check_traceable

        if method not in ("traced", "measured"):
            raise HybridError(f"unknown memory method {method!r} to run; use traced or measured (analytic needs no "
                              "estimator)")
        if method == "traced":
            check_traceable(source)
        else:
            check_runnable(source, cluster)
        self.method, self.source, self.cluster = method, source, cluster
        self.prefer_hf, self.strategies_dir, self.progress = prefer_hf, tuple(strategies_dir or ()), progress
        from .traced import TraceCache
        self.traces = TraceCache()
        """The plan's traces, shared by candidates whose ranks run the same program (traced.TraceCache)."""

    def runs(self, layout: Layout) -> bool:
        from .traced import traced_runs
        return self.method != "traced" or traced_runs(layout)

    def expect(self, total: int) -> None:
        if self.progress is not None:
            self.progress.expect(total)

    def __call__(self, layout: Layout, spec: TrainSpec, rank: int = 0) -> MemoryBreakdown:
        s, n = layout.dp, layout.dims.dp_shard
        shard = n if s.shard_is_free else None
        if self.method == "measured":     # before the progress line: a refusal is the only stderr line
            from .measured import check_host_memory
            d = layout.dims
            check_host_memory(self.source, s, spec, self.cluster, shard, d.tp, d.cp, d.ep)
        if self.progress is not None:
            self.progress.begin(f"{layout.label} (shard {n})")
        if self.method == "traced":
            from .stages import traced_rank
            # a rank whose states alone exceed the GPU cannot fit: not traced (traced.states_floor)
            result = traced_rank(self.source, layout, spec, self.cluster, rank, self.prefer_hf, self.strategies_dir,
                                 self.traces, beyond=self.cluster.capacity_bytes)
            memory = result.memory
        else:
            from .measured import measured_estimate
            from .traced import IMPLEMENTATIONS
            d = layout.dims
            result = measured_estimate(self.source, s, spec, self.cluster, shard, prefer_hf=self.prefer_hf, tp=d.tp,
                                       cp=d.cp, ep=d.ep)
            note = f"measured on {IMPLEMENTATIONS[result.implementation]} ({result.implementation})"
            memory = replace(result.memory, notes=result.memory.notes + (note,))
        if self.progress is not None:
            done = "not traced: its states alone exceed the GPU" if not getattr(result, "traced", True) else \
                f"{result.seconds:.1f}s ({result.implementation})"
            self.progress.end(done)
        return memory
