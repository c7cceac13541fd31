"""Measured estimate: real training steps of the wrapped model on this machine's ranks.

CPU: N gloo ranks spawned here, live tensor bytes tracked at the dispatcher (measure/tracker.py).
CUDA: the same, plus torch.cuda.max_memory_allocated as the independent reference.
"""
from __future__ import annotations

import contextlib
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
    ranks: tuple[int, ...] = ()
    """Every rank's live-tensor peak, in rank order (with stages, rank r of a pp 2 job on 2 ranks is pipeline
    rank r)."""


@dataclass(frozen=True)
class Job:
    """One measured job, picklable for the ranks: the model by its MODEL string or its decoder shape
    (a source built from a DecoderConfig in code has no string), the strategy and its degrees."""
    ref: str | None
    decoder_cfg: object
    strategy: Strategy
    spec: TrainSpec
    cluster: Cluster
    shard_size: int | None = None
    tp: int = 1
    cp: int = 1
    ep: int = 1
    steps: int = 2
    prefer_hf: bool = True
    pipeline: object = None
    """The stage split (hybrid.layout.pipeline.StageSplit) of a job with pp > 1: its stages run under
    torch.distributed.pipelining's schedule (runtime/backends/pipeline.py); None without stages."""

    @classmethod
    def of(cls, source: ModelSource, strategy: Strategy, spec: TrainSpec, cluster: Cluster, **kw) -> "Job":
        if source.build is None or (source.ref is None and source.decoder_cfg is None):
            raise HybridError(f"{source.profile.name} is a bare parameter count: there is no model to run")
        return cls(source.ref, None if source.ref is not None else source.decoder_cfg, strategy, spec, cluster, **kw)

    def source(self) -> ModelSource:
        if self.ref is not None:
            from ..model.sources import resolve_model
            return resolve_model(self.ref)
        from ..model.profile import profile_decoder
        from ..model.sources import _decoder_builder
        return ModelSource(profile_decoder(self.decoder_cfg, "measured"), _decoder_builder(self.decoder_cfg), None,
                           self.decoder_cfg)


def job_layout(job: Job):
    """The Layout a job runs: its strategy at its degrees, the spec's checkpointing, compile and float8,
    its stage split when staged."""
    from ..layout.dims import ParallelDims
    from ..layout.layout import Layout
    from ..layout.pipeline import stage_cluster
    pipe, spec = job.pipeline, job.spec
    pp = 1 if pipe is None else pipe.pp
    stage = stage_cluster(job.cluster, pp)
    n = job.strategy.shard_size(stage, job.shard_size, job.tp, job.cp)
    dims = ParallelDims(dp_replicate=stage.world_size // job.tp // job.cp // n, dp_shard=n, cp=job.cp, tp=job.tp,
                        pp=pp, ep=job.ep)
    return Layout(dims, job.strategy, spec.activation_checkpointing, None if pipe is None else pipe.schedule, pipe,
                  spec.compile, spec.float8)


def _measure_one(job: Job, runtime):
    """One job on this rank's real tensors: the mesh of its degrees, the layout applied by the one
    order (runtime/parallelize.py, as traced_estimate applies it on fake tensors), `steps` steps (with
    stages, `steps` schedule steps of the job's micro-batches: PipelineEngine.train_step)."""
    import torch

    from ..model.decoder import prepare_for_training
    from ..runtime.mesh import build_mesh
    from ..runtime.parallelize import apply_layout
    from .driver import tracked_steps, tracked_schedule_steps
    from .traced import make_batch, optimizer_factory
    from .tracker import MemoryTracker

    source, spec, cluster = job.source(), job.spec, job.cluster
    layout = job_layout(job)
    mesh = build_mesh(layout.dims, runtime, cluster.gpus_per_node, cluster.domain)
    torch.manual_seed(runtime.rank)
    dtype = torch.bfloat16 if spec.precision == "bf16" else None
    tracker = MemoryTracker()
    with tracker:
        model, impl = source.build(device=runtime.device, attention=spec.attention, prefer_hf=job.prefer_hf,
                                   dtype=dtype)
        prepare_for_training(model)
        engine = apply_layout(model, layout, optimizer_factory(spec), mesh, spec, runtime)
        tracker.relabel(list(model.parameters()), "params")
        tracker.reset_peak()
        if runtime.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        vocab = source.profile.decoder.vocab if source.profile.decoder else None
        if hasattr(engine, "train_step"):     # a pipeline's engine: the window's micro-batches in one schedule step
            ids = torch.randint(0, vocab, (spec.micro_batch * job.pipeline.micro_batches, spec.seq_len),
                                device=runtime.device)
            tracked_schedule_steps(engine, ids, tracker, job.steps)
        else:
            batch = make_batch(model, spec, vocab)
            batch = {k: v.to(runtime.device) if hasattr(v, "to") else v for k, v in batch.items()}
            tracked_steps(engine, batch, tracker, job.steps, accumulation=spec.gradient_accumulation)
    cuda_peak = torch.cuda.max_memory_allocated() if runtime.device.type == "cuda" else None
    del engine, model
    return tracker.peak_breakdown(), tracker.peak_phase, cuda_peak, impl


def _rank_main(jobs: list[Job]):
    """Every job in turn on this rank (one launch, one process group): [result per job], each job measured
    as it runs alone (_as_alone)."""
    from ..runtime.mesh import init_distributed
    runtime = init_distributed()
    out = []
    for job in jobs:
        with _as_alone():
            out.append(_measure_one(job, runtime))
    return out


@contextlib.contextmanager
def _as_alone():
    """A job of a launch with the process-wide functions it found, restored after it: DeepSpeed's ZeRO-3
    engine replaces torch.nn.functional.linear with its LinearFunctionForZeroStage3 for the whole process
    ("This will persist unless manually reset": deepspeed/runtime/zero/partition_parameters.py
    _enable_mem_efficient_linear), which saves other tensors than torch's linear, so a job measured after a
    ZeRO-3 job in the same launch ran another program (measured: a pipeline's first stage under selective
    checkpointing 32,768 B, one boundary tensor, under the same job run alone)."""
    import torch.nn.functional as F
    linear = F.linear
    try:
        yield
    finally:
        F.linear = linear


def check_runnable(source: ModelSource, cluster: Cluster) -> None:
    """A measured run needs a model to build and few enough ranks for this machine."""
    import torch

    if source.build is None or (source.ref is None and source.decoder_cfg is None):
        raise HybridError(f"{source.profile.name} is a bare parameter count: there is no model to run")
    local = torch.cuda.device_count() if torch.cuda.is_available() else MAX_LOCAL_RANKS
    if cluster.world_size > local:
        raise HybridError(f"a measured estimate runs the job here, but world size {cluster.world_size} needs "
                          f"more than the {local} local ranks this machine can run; use e.g. --nodes 1 "
                          f"--gpus-per-node 2, or --method traced for the full-size job")


def check_host_memory(source, strategy, spec, cluster, shard_size, tp: int = 1, cp: int = 1, ep: int = 1,
                      layout=None) -> None:
    """CPU ranks share this machine's memory: refuse up front a run the kernel would OOM-kill (`layout`:
    the job's, with its stages; else the strategy's at these degrees)."""
    if cluster.gpu.is_cuda:
        return
    from ..config.cluster import available_host_bytes
    from ..units import fmt_bytes
    from ..layout.layout import Layout
    from ..estimation.memory.stages import rank_estimates
    layout = layout or Layout.of(strategy, cluster, spec, shard_size=shard_size, tp=tp, cp=cp, ep=ep)
    ranks, busiest = rank_estimates(layout, source.profile, spec, cluster)
    need = ranks[busiest].total
    need *= cluster.world_size
    have = available_host_bytes()
    if need > 0.9 * have:
        raise HybridError(f"measuring {source.profile.name} under {strategy.name} on {cluster.world_size} CPU ranks "
                          f"needs about {fmt_bytes(need)} of host memory (analytic estimate) and this machine has "
                          f"{fmt_bytes(have)} available; measure a smaller model, or use --method traced (fake "
                          "tensors, no memory)")


def measured_estimate(source: ModelSource, strategy: Strategy, spec: TrainSpec, cluster: Cluster,
                      shard_size: int | None = None, steps: int = 2, prefer_hf: bool = True, tp: int = 1,
                      cp: int = 1, ep: int = 1) -> Measured:
    """The job run on this machine's ranks (tp, cp, ep as parallelize applies them), the tracker
    on every rank; the rank with the largest peak."""
    return measured_estimates([Job.of(source, strategy, spec, cluster, shard_size=shard_size, tp=tp, cp=cp, ep=ep,
                                      steps=steps, prefer_hf=prefer_hf)])[0]


def measured_estimates(jobs: list[Job]) -> list[Measured]:
    """Several jobs on one cluster, each checked first, run one after another in one launch of the
    ranks (a launch and its rendezvous cost seconds; a tiny job costs less)."""
    from ..runtime.launch import run_ranks

    if not jobs:
        return []
    cluster = jobs[0].cluster
    if any(j.cluster != cluster for j in jobs):
        raise HybridError("measured_estimates runs jobs of one cluster in one launch; launch the others apart")
    for job in jobs:
        source = job.source()
        check_runnable(source, cluster)
        check_job(source.profile, job.spec)
        check_host_memory(source, job.strategy, job.spec, cluster, job.shard_size, job.tp, job.cp, job.ep,
                          job_layout(job))
    start = time.perf_counter()
    per_rank = run_ranks(cluster.world_size, _rank_main, list(jobs), local_world=cluster.gpus_per_node)
    seconds = (time.perf_counter() - start) / len(jobs)
    out = []
    for i in range(len(jobs)):
        parts, phase, cuda_peak, impl = max((r[i] for r in per_rank), key=lambda r: sum(r[0].values()))
        out.append(Measured(MemoryBreakdown.from_tensors(parts, cluster, phase=phase), cuda_peak, impl, seconds,
                            tuple(sum(r[i][0].values()) for r in per_rank)))
    return out
