"""Measured estimate: real training steps of the wrapped model on this machine's ranks.

CPU: N gloo ranks spawned here, live tensor bytes tracked at the dispatcher (measure/tracker.py).
CUDA: the same, plus torch.cuda.max_memory_allocated as the independent reference.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..families.catalogue import Strategy
from ..config.cluster import Cluster
from ..errors import HybridError
from ..model.sources import ModelSource
from ..config.spec import TrainSpec
from ..estimation.memory.analytic import check_job
from ..estimation.memory.breakdown import MemoryBreakdown

MAX_LOCAL_RANKS = 8


@dataclass(frozen=True)
class Measured:
    memory: MemoryBreakdown
    """The rank with the largest peak."""
    cuda_max_allocated: int | None
    """torch.cuda.max_memory_allocated() of that rank (None on CPU)."""
    implementation: str
    seconds: float


def _rank_main(ref, strategy, spec, cluster, shard_size, steps, prefer_hf):
    import torch

    from ..model.sources import resolve_model

    from ..model.decoder import prepare_for_training
    from ..runtime.backends import apply
    from ..runtime.mesh import build_mesh, init_distributed
    from .driver import tracked_steps
    from .traced import make_batch, optimizer_factory
    from .tracker import MemoryTracker

    source = resolve_model(ref)
    runtime = init_distributed()
    n = strategy.shard_size(cluster, shard_size)
    mesh = build_mesh(n, runtime, cluster.gpus_per_node, cluster.domain)
    torch.manual_seed(runtime.rank)
    dtype = torch.bfloat16 if spec.precision == "bf16" else None
    tracker = MemoryTracker()
    with tracker:
        model, impl = source.build(device=runtime.device, attention=spec.attention, prefer_hf=prefer_hf, dtype=dtype)
        prepare_for_training(model)
        engine = apply(strategy, model, optimizer_factory(spec), mesh, spec, runtime)
        tracker.relabel(list(model.parameters()), "params")
        tracker.reset_peak()
        if runtime.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        batch = make_batch(model, spec, source.profile.decoder.vocab if source.profile.decoder else None)
        batch = {k: v.to(runtime.device) if hasattr(v, "to") else v for k, v in batch.items()}
        tracked_steps(engine, batch, tracker, steps)
    cuda_peak = torch.cuda.max_memory_allocated() if runtime.device.type == "cuda" else None
    return tracker.peak_breakdown(), tracker.peak_phase, cuda_peak, impl


def check_runnable(source: ModelSource, cluster: Cluster) -> None:
    """A measured run needs a model to build and few enough ranks for this machine."""
    import torch

    if source.build is None or source.ref is None:
        raise HybridError(f"{source.profile.name} is a bare parameter count: there is no model to run")
    local = torch.cuda.device_count() if torch.cuda.is_available() else MAX_LOCAL_RANKS
    if cluster.world_size > local:
        raise HybridError(f"a measured estimate runs the job here, but world size {cluster.world_size} needs "
                          f"more than the {local} local ranks this machine can run; use e.g. --nodes 1 "
                          f"--gpus-per-node 2, or --method traced for the full-size job")


def check_host_memory(source, strategy, spec, cluster, shard_size) -> None:
    """CPU ranks share this machine's memory: refuse up front a run the kernel would OOM-kill."""
    if cluster.gpu.is_cuda:
        return
    from ..config.cluster import available_host_bytes
    from ..units import fmt_bytes
    from ..layout.layout import Layout
    from ..estimation.memory.analytic import estimate
    need = estimate(Layout.of(strategy, cluster, spec, shard_size=shard_size), source.profile, spec, cluster).total
    need *= cluster.world_size
    have = available_host_bytes()
    if need > 0.9 * have:
        raise HybridError(f"measuring {source.profile.name} under {strategy.name} on {cluster.world_size} CPU ranks "
                          f"needs about {fmt_bytes(need)} of host memory (analytic estimate) and this machine has "
                          f"{fmt_bytes(have)} available; measure a smaller model, or use --method traced (fake "
                          "tensors, no memory)")


def measured_estimate(source: ModelSource, strategy: Strategy, spec: TrainSpec, cluster: Cluster,
                      shard_size: int | None = None, steps: int = 2, prefer_hf: bool = True) -> Measured:
    from ..runtime.launch import run_ranks

    check_runnable(source, cluster)
    check_job(source.profile, spec)
    world = cluster.world_size
    check_host_memory(source, strategy, spec, cluster, shard_size)
    start = time.perf_counter()
    results = run_ranks(world, _rank_main, source.ref, strategy, spec, cluster, shard_size, steps, prefer_hf,
                        local_world=cluster.gpus_per_node)
    parts, phase, cuda_peak, impl = max(results, key=lambda r: sum(r[0].values()))
    memory = MemoryBreakdown.from_tensors(parts, cluster, phase=phase)
    return Measured(memory, cuda_peak, impl, time.perf_counter() - start)
