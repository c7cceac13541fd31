"""Each pipeline rank traced: without stages the whole job's rank, with stages that rank's stage
(traced_stage_estimate: torch.distributed.pipelining's own PipelineStage on fake tensors), in a process
of its own for the planner (the traced half of estimation/memory/stages.py)."""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace

from ..config.cluster import Cluster
from ..config.spec import TrainSpec
from ..errors import HybridError
from ..layout.layout import Layout
from ..model.sources import ModelSource
from ..families.catalogue import Strategy
from ..estimation.memory.analytic import check_job, placement_of
from ..estimation.memory.breakdown import MemoryBreakdown
from .traced import (TraceCache, Traced, _real_mesh_arithmetic, unpacked_batches, check_traceable, optimizer_factory,
                     end_fake_group, refuse_first, replaced_layout, traced_program)


def traced_rank(source: ModelSource, layout: Layout, spec: TrainSpec, cluster: Cluster, rank: int = 0,
                prefer_hf: bool = True, strategies_dir=(), cache=None, beyond: int | None = None) -> "Traced":
    """Pipeline rank `rank` of `layout`'s job traced, its memory noted with what ran: without stages
    the whole job's rank (traced_estimate); with stages that rank's stage (traced_stage_estimate)
    in a fresh process, as each needs a fake process group of its own rank. `cache` (traced.TraceCache):
    the traces of candidates already judged, reused where this rank runs the same program. `beyond`: a rank
    without stages whose states alone exceed it is not traced (traced_estimate)."""
    from .traced import IMPLEMENTATIONS, traced_estimate

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
                                d.tp, layout.pipeline, rank, prefer_hf).result()
            except BrokenProcessPool:
                raise HybridError(f"tracing pp rank {rank} died (killed, e.g. out of host memory); use --method "
                                  "analytic") from None
        note = f"traced pp rank {rank} (the busiest) on {IMPLEMENTATIONS[t.implementation]} ({t.implementation})"
    return replace(t, memory=replace(t.memory, notes=t.memory.notes + (note,)))


def traced_stage_estimate(source: ModelSource, strategy: Strategy, spec: TrainSpec, cluster: Cluster,
                          shard_size: int | None, tp: int, layout, pp_rank: int, steps: int = 2,
                          prefer_hf: bool = False, cache: TraceCache | None = None) -> Traced:
    """One pipeline rank of the real job on fake tensors: its stage cut from the model and
    wrapped as the runtime wraps it (runtime/backends/pipeline.py: the family's wrap_stage over the
    stage's ranks of a fake process group of the whole world), its micro-batches run in the
    schedule's order (pipeline.rank_actions) with the backward and the step-end reduction of
    torch.distributed.pipelining's own PipelineStage, the received activations and gradients in
    per-micro-batch receive buffers as that library allocates them. gpipe and 1f1b. `prefer_hf`: the
    stage cut from the transformers model where the preset has one (runtime/stages.HFDecoderStage);
    `cache` (TraceCache): a stage whose rank runs the same program as one traced before is not traced
    again."""
    import torch.distributed as dist

    from ..layout.dims import ParallelDims
    from ..layout.pipeline import stage_cluster
    from ..estimation.shares import stage_of, stage_share, tp_share

    check_traceable(source)
    if dist.is_initialized():
        raise HybridError("a traced estimate starts its own fake process group; run it outside a "
                          "distributed job (e.g. from the CLI)")
    stage_cl = stage_cluster(cluster, layout.pp)
    n = strategy.shard_size(stage_cl, shard_size, tp)
    dims = ParallelDims(dp_replicate=stage_cl.world_size // tp // n, dp_shard=n, tp=tp, pp=layout.pp)
    check_job(source.profile, spec)
    job = Layout.of(strategy, cluster, spec, shard_size=shard_size, tp=tp, pp=layout.pp,
                    schedule=layout.schedule).with_pipeline(layout)
    refuse_first(job, source.profile, spec, stage_cl, pp_rank)
    if layout.virtual != 1:
        raise HybridError("a traced pipeline estimate runs gpipe and 1f1b; use --method analytic for interleaved")
    stage = stage_of(source.profile, layout, pp_rank)
    # the rank's share (its stage, then its tensor-parallel share), as the estimate prices it; NotApplicable first
    place = placement_of(strategy, tp_share(stage_share(source.profile, layout, pp_rank), tp, stage), spec, stage_cl,
                         n, stage)
    start = time.perf_counter()

    def make():      # the first step only makes the optimizer's state: primed (traced_estimate)
        return _stage_trace(source, strategy, spec, cluster, n, tp, dims, layout, pp_rank, max(steps - 1, 1), prefer_hf,
                            prime=steps > 1)
    if cache is None:
        tracker, impl = make()
    else:
        layers = source.decoder_cfg.layers if source.decoder_cfg is not None else None
        key = ("stage", traced_program(strategy, job), source.profile.name, source.profile.params, layers,
               spec, cluster, n, tp, layout, pp_rank, steps, prefer_hf)
        tracker, impl = cache.get(key, make)
    replaced = strategy.family_obj.traced_replaces(strategy)
    if replaced:        # host offload: the traced proxy's state replaced by the strategy's (traced._account)
        _, parts, phase = tracker.peak_replacing(replaced, replaced_layout(place, replaced))
        memory = MemoryBreakdown.from_tensors(parts, cluster, cpu=int(place.cpu), phase=phase,
                                              notes=(strategy.family_obj.traced_note(strategy),))
    else:
        memory = MemoryBreakdown.from_tensors(tracker.peak_breakdown(), cluster, phase=tracker.peak_phase)
    return Traced(memory, impl, time.perf_counter() - start)


def _stage_trace(source: ModelSource, strategy: Strategy, spec: TrainSpec, cluster: Cluster, n: int, tp: int, dims,
                 layout, pp_rank: int, steps: int, prefer_hf: bool, prime: bool = False):
    """(the tracker after `steps` steps of pipeline rank `pp_rank`'s stage, the implementation traced):
    traced_stage_estimate's run. `prime`: the optimizer's state made first, as a first step would (zero
    gradients shaped like the stage's trainable parameters, one optimizer step: driver.prime_optimizer)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..model.decoder import causal_lm_loss, prepare_for_training
    from ..runtime.backends.base import optimizer_tensors
    from ..runtime.backends.fsdp import gathered_params
    from ..runtime.mesh import TRACED, Runtime, build_mesh
    from ..runtime.parallelize import layout_of_mesh, parallelize_piece
    from ..runtime.stages import pipeline_stage
    from ..layout.pipeline import rank_actions
    from .tracker import MemoryTracker

    d = source.profile.decoder
    m, world = layout.micro_batches, cluster.world_size
    dist.init_process_group(TRACED, store=FakeStore(), rank=pp_rank * (world // layout.pp), world_size=world)
    try:
        runtime = Runtime(torch.device("cpu"), TRACED, world, dist.get_rank(), cluster.gpus_per_node,
                          stands_for=cluster.gpu.software)
        mesh = build_mesh(dims, runtime, cluster.gpus_per_node, cluster.domain)
        dtype = torch.bfloat16 if spec.precision == "bf16" else None
        index = layout.rank_stages(pp_rank)[0]
        first, last = index == 0, index == layout.stages - 1
        with FakeTensorMode(allow_non_fake_inputs=True), unpacked_batches(), _real_mesh_arithmetic():
            # the whole model on fake tensors, outside the tracker: only what the stage's wrapping
            # allocates (its sharded parameters) and the steps count
            model, impl = source.build(device="cpu", attention=spec.attention, prefer_hf=prefer_hf, dtype=dtype)
            prepare_for_training(model)
            lo, hi = layout.stage_range(index)
            chunk = pipeline_stage(model, lo, hi, first, last)
            del model
            tracker = MemoryTracker()
            with tracker:
                chunk, tp_state, _ = parallelize_piece(chunk, layout_of_mesh(strategy, mesh, spec), mesh, spec, runtime,
                                                       staged=True)
                tp_context = tp_state.context if tp_state is not None else contextlib.nullcontext
                stage = PipelineStage(chunk, index, layout.stages, torch.device("cpu"), group=mesh["pp"].get_group())
                optimizer = optimizer_factory(spec)([p for p in chunk.parameters() if p.requires_grad])
                tracker.relabel(list(chunk.parameters()), "params")
                tracker.reset_peak()
                act = spec.bytes.compute
                low = {2: torch.bfloat16, 4: torch.float32}[act]
                boundary = (spec.micro_batch, spec.seq_len // tp, d.hidden)      # a tp rank's sequence shard
                recv = [torch.empty(boundary, dtype=low) for _ in range(m)] if not first else []
                grads_in = [torch.empty(boundary, dtype=low) for _ in range(m)] if not last else []
                tracker.relabel(recv + grads_in, "buffers")
                ids = torch.randint(0, d.vocab, (spec.micro_batch, spec.seq_len))
                if prime:
                    tracker.phase = "step"
                    trainable = [p for p in chunk.parameters() if p.requires_grad]
                    for p in trainable:
                        p.grad = torch.zeros_like(p)
                    optimizer.step()
                    tracker.relabel(optimizer_tensors(optimizer, trainable), "optimizer")
                    optimizer.zero_grad(set_to_none=True)
                for _ in range(steps):
                    live, sending = {}, []
                    for kind, mb in rank_actions(layout.schedule, layout.pp, m, pp_rank):
                        if kind == "F":
                            tracker.phase = "forward"
                            x = ids if first else recv[mb].detach().requires_grad_(True)
                            with tp_context():
                                # the stage's output (the logits on the last stage) stays in
                                # PipelineStage.fwd_cache until the micro-batch's backward
                                kept = out = chunk(x)
                                if last:
                                    tracker.phase = "loss"
                                    out = causal_lm_loss(out, ids)
                            live[mb] = (x, out, kept)
                        else:
                            tracker.phase = "blocks"
                            x, out, kept = live.pop(mb)
                            with tp_context():
                                grads, _ = stage.backward_maybe_with_nosync(
                                    "full", {"stage_output": out, "output_grads": None if last else grads_in[mb],
                                             "input_values": [] if first else [x]}, last_backward=mb == m - 1)
                            # torch's Schedule1F1B holds a backward's send ops (its input gradient) in a
                            # variable it rebinds after the next backward; GPipe's are released at once
                            sending[:] = [grads] if layout.schedule == "1f1b" and not first else []
                            del x, out, kept, grads
                    stage.perform_reduce_grad(m)
                    params = list(chunk.parameters())
                    tracker.relabel([p.grad for p in params if p.grad is not None], "grads")
                    tracker.phase = "step"
                    optimizer.step()
                    tracker.relabel(optimizer_tensors(optimizer, params), "optimizer")
                    tracker.relabel(gathered_params(chunk), "buffers")
                    optimizer.zero_grad(set_to_none=True)
    finally:
        end_fake_group()
    return tracker, impl


def traced_stage_in_process(ref: str, strategy_name: str, strategies_dir, spec: TrainSpec, cluster: Cluster,
                            shard_size, tp: int, layout, rank: int, prefer_hf: bool = False) -> Traced:
    """traced_stage_estimate from picklable arguments (for a fresh process per rank)."""
    from ..families.catalogue import load_catalogue
    from ..model.sources import resolve_model
    return traced_stage_estimate(resolve_model(ref), load_catalogue(tuple(strategies_dir or ())).get(strategy_name),
                                 spec, cluster, shard_size, tp, layout, rank, prefer_hf=prefer_hf)
