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
    """One pipeline rank of the real job on fake tensors: its stages (one; two under interleaved) cut from
    the model and wrapped as the runtime wraps them (runtime/backends/pipeline.py: the family's wrap over the
    stage's ranks of a fake process group of the whole world), each a torch.distributed.pipelining
    PipelineStage, its micro-batches run in the schedule's order with what torch's schedule holds and does
    between them (layout/program.rank_program: its sends, its FSDP unshards, reshards and reductions), the
    received activations and gradients in per-micro-batch receive buffers as that library allocates them.
    `prefer_hf`: the stages cut from the transformers model where the preset has one
    (runtime/stages.HFDecoderStage); `cache` (TraceCache): a rank that runs the same program as one traced
    before is not traced again."""
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
    """(the tracker after `steps` steps of pipeline rank `pp_rank`'s stages, the implementation traced):
    traced_stage_estimate's run. `prime`: the optimizer's state made first, as a first step would (zero
    gradients shaped like the stages' trainable parameters, one optimizer step: driver.prime_optimizer)."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..model.decoder import prepare_for_training
    from ..runtime.backends.base import optimizer_tensors
    from ..runtime.backends.fsdp import gathered_params
    from ..runtime.mesh import TRACED, Runtime, build_mesh
    from ..runtime.parallelize import layout_of_mesh, parallelize_piece
    from ..runtime.stages import pipeline_stage
    from ..layout.program import rank_program
    from .tracker import MemoryTracker

    d = source.profile.decoder
    m, world, last = layout.micro_batches, cluster.world_size, layout.stages - 1
    dist.init_process_group(TRACED, store=FakeStore(), rank=pp_rank * (world // layout.pp), world_size=world)
    try:
        runtime = Runtime(torch.device("cpu"), TRACED, world, dist.get_rank(), cluster.gpus_per_node,
                          stands_for=cluster.gpu.software)
        mesh = build_mesh(dims, runtime, cluster.gpus_per_node, cluster.domain)
        dtype = torch.bfloat16 if spec.precision == "bf16" else None
        local = layout.rank_stages(pp_rank)
        with FakeTensorMode(allow_non_fake_inputs=True), unpacked_batches(), _real_mesh_arithmetic():
            # the whole model on fake tensors, outside the tracker: only what the stages' wrapping
            # allocates (their sharded parameters) and the steps count
            model, impl = source.build(device="cpu", attention=spec.attention, prefer_hf=prefer_hf, dtype=dtype)
            prepare_for_training(model)
            pieces = [pipeline_stage(model, *layout.stage_range(i), i == 0, i == last) for i in local]
            del model
            tracker = MemoryTracker()
            with tracker:
                chunks = {}
                for index, piece in zip(local, pieces):      # each local stage wrapped as runtime/parallelize.py does
                    chunks[index], tp_state, _ = parallelize_piece(piece, layout_of_mesh(strategy, mesh, spec), mesh,
                                                                   spec, runtime, staged=True)
                del pieces
                # the engine runs the schedule under the last stage's tensor-parallel context (its loss parallel)
                tp_context = tp_state.context if tp_state is not None else contextlib.nullcontext
                stages = {i: PipelineStage(c, i, layout.stages, torch.device("cpu"), group=mesh["pp"].get_group())
                          for i, c in chunks.items()}
                params = [p for c in chunks.values() for p in c.parameters()]
                trainable = [p for p in params if p.requires_grad]
                optimizer = optimizer_factory(spec)(trainable)
                tracker.relabel(params, "params")
                tracker.reset_peak()
                run = _StageRun(chunks, stages, spec, d, m, tp, last, tracker, tp_context)
                tracker.relabel(run.buffers(), "buffers")
                if prime:
                    tracker.phase = "step"
                    for p in trainable:
                        p.grad = torch.zeros_like(p)
                    optimizer.step()
                    tracker.relabel(optimizer_tensors(optimizer, trainable), "optimizer")
                    optimizer.zero_grad(set_to_none=True)
                program = rank_program(layout, pp_rank, fsdp=any(isinstance(c, FSDPModule) for c in chunks.values()))
                for _ in range(steps):
                    run.step(program)
                    tracker.relabel([p.grad for p in params if p.grad is not None], "grads")
                    tracker.phase = "step"
                    optimizer.step()
                    tracker.relabel(optimizer_tensors(optimizer, params), "optimizer")
                    tracker.relabel([t for c in chunks.values() for t in gathered_params(c)], "buffers")
                    optimizer.zero_grad(set_to_none=True)
    finally:
        end_fake_group()
    return tracker, impl


class _StageRun:
    """One rank's stages running its program (layout/program.rank_program) as torch.distributed.pipelining
    runs it: each forward keeps its stage's output (PipelineStage.fwd_cache) until its backward, the last
    stage's loss computed from its logits, each backward through the stage's backward_maybe_with_nosync
    into the stage's receive buffers' gradients, the sends held until the schedule drops them, the FSDP
    stages unsharded, resharded and reduced where the schedule does."""

    def __init__(self, chunks, stages, spec, decoder, m: int, tp: int, last: int, tracker, tp_context):
        import torch
        self.chunks, self.stages, self.m, self.last = chunks, stages, m, last
        self.tracker, self.tp_context = tracker, tp_context
        low = {2: torch.bfloat16, 4: torch.float32}[spec.bytes.compute]
        boundary = (spec.micro_batch, spec.seq_len // tp, decoder.hidden)      # a tp rank's sequence shard
        # per stage and micro-batch, as PipelineStage allocates them: the received input (all but the first
        # stage), the received gradient of the output (all but the last)
        self.recv = {i: [torch.empty(boundary, dtype=low) for _ in range(m)] for i in chunks if i != 0}
        self.grads_in = {i: [torch.empty(boundary, dtype=low) for _ in range(m)] for i in chunks if i != last}
        # the window's token ids, split into micro-batches (the schedule's input and the loss's target)
        ids = torch.randint(0, decoder.vocab, (spec.micro_batch * m, spec.seq_len))
        self.ids = ids.tensor_split(m)

    def buffers(self) -> list:
        return [b for bufs in (*self.recv.values(), *self.grads_in.values()) for b in bufs]

    def step(self, program) -> None:
        from ..model.decoder import causal_lm_loss
        live, held, done = {}, {}, {}
        with self.tp_context():
            for i, act in enumerate(program):
                stage, chunk = self.stages[act.stage], self.chunks[act.stage]
                if act.kind == "F":
                    self.tracker.phase = "forward"
                    x = self.ids[act.mb] if act.stage == 0 else self.recv[act.stage][act.mb].requires_grad_(True)
                    # the stage's output (the logits on the last stage) stays in PipelineStage.fwd_cache until
                    # the micro-batch's backward
                    kept = out = chunk(x)
                    if act.stage == self.last:
                        self.tracker.phase = "loss"
                        out = causal_lm_loss(out, self.ids[act.mb])
                    live[act.stage, act.mb] = (x, out, kept)
                    sent = kept
                elif act.kind == "B":
                    self.tracker.phase = "blocks"
                    x, out, kept = live.pop((act.stage, act.mb))
                    done[act.stage] = done.get(act.stage, 0) + 1
                    grad_out = None if act.stage == self.last else self.grads_in[act.stage][act.mb]
                    sent, _ = stage.backward_maybe_with_nosync(
                        "full", {"stage_output": out, "output_grads": grad_out,
                                 "input_values": [] if act.stage == 0 else [x]},
                        last_backward=done[act.stage] == self.m)
                    del x, out, kept
                elif act.kind == "reduce":
                    stage.perform_reduce_grad(self.m)
                else:                                   # the runtime schedule's FSDP unshard / reshard of a stage
                    _fsdp_modules_do(chunk, act.kind)
                if act.sends:                           # the send work holds the tensor (layout/program.py)
                    held[i] = (act.released, sent)
                sent = None
                for j in [j for j, (until, _) in held.items() if until == i]:
                    del held[j]
        held.clear()


def _fsdp_modules_do(chunk, kind: str) -> None:
    """unshard or reshard every FSDP module of a stage, as torch's runtime schedule does
    (_PipelineScheduleRuntime's UNSHARD and RESHARD actions)."""
    from torch.distributed.fsdp import FSDPModule
    for sub in chunk.modules():
        if isinstance(sub, FSDPModule):
            sub.unshard() if kind == "unshard" else sub.reshard()


def traced_stage_in_process(ref: str, strategy_name: str, strategies_dir, spec: TrainSpec, cluster: Cluster,
                            shard_size, tp: int, layout, rank: int, prefer_hf: bool = False) -> Traced:
    """traced_stage_estimate from picklable arguments (for a fresh process per rank)."""
    from ..families.catalogue import load_catalogue
    from ..model.sources import resolve_model
    return traced_stage_estimate(resolve_model(ref), load_catalogue(tuple(strategies_dir or ())).get(strategy_name),
                                 spec, cluster, shard_size, tp, layout, rank, prefer_hf=prefer_hf)
