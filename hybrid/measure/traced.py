"""Traced estimate: one rank of the real job, simulated on this CPU with no memory allocated.

A fake process group of the job's world size, FakeTensorMode (shapes and dtypes only), the real
wrapping (FSDP2 on the job's 1D/2D mesh with its mixed precision and checkpointing; DDP's buckets
emulated because its C++ reducer reads data; DeepSpeed as its FSDP2 equivalent plus its own state
layout), the optimizer's state primed, and a real training step (the job's accumulation window) on a
batch of the job's shape. The peak of live tensors and what it is made of come from measure/tracker.py.
"""
from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..families.catalogue import Strategy
from ..config.cluster import Cluster
from ..errors import HybridError
from ..layout.layout import Layout
from ..model.sources import ModelSource
from ..estimation.shares import tp_share
from ..config.spec import TrainSpec
from ..estimation.memory.analytic import check_job, placement_of
from ..estimation.memory.breakdown import CATEGORIES, MemoryBreakdown, fragmentation_floor


@dataclass(frozen=True)
class Traced:
    memory: MemoryBreakdown
    implementation: str
    """Which code was traced: 'transformers' (the HF model of the preset), 'hybrid' (ours), 'factory'."""
    seconds: float
    traced: bool = True
    """False where nothing ran: the states the rank must hold alone exceed the GPU (traced_estimate's
    `beyond`), and `memory` is that floor."""


def optimizer_factory(spec: TrainSpec):
    """The optimizer the estimate assumes, with CUDA's defaults (foreach) even on this CPU."""
    import torch

    if spec.optimizer == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True)
    if spec.optimizer == "adafactor":
        return lambda ps: torch.optim.Adafactor(ps, lr=1e-3, foreach=True)
    if spec.optimizer != "adamw":
        raise HybridError(f"--optimizer {spec.optimizer} is priced by the analytic estimate (state bytes from its "
                          "source: hybrid/families/placement.py); a traced or tuned run builds torch's AdamW, SGD or "
                          "Adafactor only: use --method analytic, or auto_wrap with your own optimizer")
    return lambda ps: torch.optim.AdamW(ps, lr=3e-4, foreach=True)


def make_batch(model, spec: TrainSpec, vocab: int | None):
    import torch

    if hasattr(model, "example_inputs"):
        return model.example_inputs(spec.micro_batch)
    if vocab is None:
        raise HybridError("a traced estimate needs the model's input: give a decoder (preset, config.json) "
                          "or a model with an example_inputs(micro_batch) method")
    ids = torch.randint(0, vocab, (spec.micro_batch, spec.seq_len))
    return {"input_ids": ids, "labels": ids}


@contextlib.contextmanager
def unpacked_batches():
    """transformers decides from the position ids' *values* whether sequences are packed, and so
    whether SDPA may run its causal flash path without a mask (and with GQA kept). Fake tensors
    have no values, so it would materialise a mask a real unpacked batch never gets; answer for it."""
    try:
        import transformers.masking_utils as mu
    except ImportError:
        yield
        return
    original = mu.find_packed_sequence_indices
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original


@contextlib.contextmanager
def _real_mesh_arithmetic():
    """FSDP over tensor parallelism joins the dp and tp meshes (DeviceMesh._concatenate), which
    computes rank lists with tensor ops; under FakeTensorMode those would be fake (no values).
    Mesh bookkeeping is integers, not model memory: run it on real tensors."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    original = DeviceMesh.__dict__.get("_concatenate")
    if original is None:
        yield
        return
    func = original.__func__ if isinstance(original, staticmethod) else original

    def concatenate(*args, **kwargs):
        with unset_fake_temporarily():
            return func(*args, **kwargs)
    DeviceMesh._concatenate = staticmethod(concatenate) if isinstance(original, staticmethod) else concatenate
    try:
        yield
    finally:
        DeviceMesh._concatenate = original


def end_fake_group() -> None:
    """Destroy a trace's fake process group, and DTensor's caches with it: its sharding propagation and
    redistribution plans are cached by their specs, whose meshes compare equal across traces (the same
    ranks and names) while their process groups are the destroyed ones, so the next trace of a different
    rank would reach a group that no longer exists ('Could not resolve the process group')."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, _redistribute, debug

    dist.destroy_process_group()
    clear = getattr(debug, "_clear_sharding_prop_cache", None)      # Python's and the C++ fast path's
    if clear is not None:
        clear()
    else:
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    for name in ("_gen_transform_infos", "clear_redistribute_planner_cache"):
        fn = getattr(_redistribute, name, None)
        if fn is not None:
            getattr(fn, "cache_clear", fn)()


def check_traceable(source: ModelSource) -> None:
    if source.build is None:
        raise HybridError(f"{source.profile.name} is a bare parameter count: there is nothing to trace. "
                          "Use --method analytic, or give a preset / config.json / factory")


UNTRACED = {
    "compile": "--method traced runs the blocks eagerly (torch.compile falls back to eager under the trace's dispatch "
               "mode); a compiled job's blocks keep what AOTAutograd's partitioner saves, which --method analytic "
               "counts (hybrid/measure/compiled.py)",
    "lora": "--method traced runs the model without adapters; --lora-rank is estimated by --method analytic "
            "(docs/finetuning.md), or pass a PEFT model to hybrid.plan"}
"""Job options a trace cannot run as the job runs them, and the line it refuses them with."""


def refuse_first(layout: Layout, profile, spec: TrainSpec, cluster: Cluster, rank: int = 0) -> None:
    """Before anything is built: what the estimate refuses (NotApplicable, the line the plan's row and
    auto_wrap give: the family's rules, the device, what is not modelled), then the job options the
    trace cannot run (UNTRACED), each one line."""
    from ..estimation.memory.analytic import estimate
    estimate(layout, profile, spec, cluster, rank)
    if spec.compile:
        raise HybridError(UNTRACED["compile"])
    if spec.lora is not None:
        raise HybridError(UNTRACED["lora"])


FAST_BLOCKS = (3, 4)
"""Block counts traced by the fast path: two traces of the same job on models of 3 and 4 blocks,
extrapolated moment by moment to the model's own count (extrapolate). Three is the fewest with a
middle block: the first and last blocks of a phase differ from the others (FSDP2's first backward
block has no earlier reduce-scatter in flight, its last nothing to prefetch)."""


def traced_program(strategy: Strategy, layout: Layout | None = None) -> tuple:
    """What `strategy` runs when traced (in `layout`, its degrees), as a value: two strategies with equal
    values run the same program on fake tensors (the backend's traced_proxy: DeepSpeed as its FSDP2
    equivalent, host offload accounted after the trace; then the wrap the layout applies,
    Family.priced_strategy: ddp over tensor-parallel groups or a pipeline stage replicates through
    FSDP2), whatever their names; the rest of the job (the rank's model, batch, shard group and degrees)
    is TraceCache's key beside it. The preset's shard rule is not part of it: the trace runs the group
    size it resolves to (hsdp on one node is fsdp's program)."""
    from dataclasses import replace

    from ..layout.applied import applied_plan
    proxy = getattr(strategy.family_obj.runtime(), "traced_proxy", None)
    s = proxy(strategy) if proxy is not None else strategy
    if layout is not None:
        s = s.family_obj.priced_strategy(s, applied_plan(replace(layout, dp=s)))
    return s.family, s.config


class TraceCache:
    """The traces of a plan's candidates, kept by the program each rank ran (traced_program, the
    model and its block count, the batch, the cluster, the shard group and degrees, the steps), so
    that candidates whose ranks run the same program are traced once: zero1, zero2 and
    zero2-offload all run FSDP2 without resharding under the trace; zero3, zero3-hpz, zero3-offload
    and fsdp-offload FSDP2 with it. Only the trace is shared: each candidate's own state layout is
    accounted on it afterwards (_account). Bounded (the oldest trace goes); `hits` and `misses`
    count the lookups."""

    def __init__(self, size: int = 16):
        self.size, self.hits, self.misses = size, 0, 0
        self._traces: OrderedDict = OrderedDict()

    def get(self, key, make):
        """The trace kept under `key`, or make()'s, kept."""
        if key in self._traces:
            self.hits += 1
            self._traces.move_to_end(key)
            return self._traces[key]
        self.misses += 1
        out = self._traces[key] = make()
        if len(self._traces) > self.size:
            self._traces.popitem(last=False)
        return out


def _cached_trace(cache: TraceCache | None, source: ModelSource, strategy: Strategy, spec: TrainSpec,
                  cluster: Cluster, n: int, prefer_hf: bool, steps: int, tp: int, prime: bool = False, cp: int = 1,
                  ep: int = 1, layout: Layout | None = None):
    """_trace, through `cache` when one is given (`layout`: the job's, for the program it runs)."""
    def make():
        return _trace(source, strategy, spec, cluster, n, prefer_hf, steps, tp, prime=prime, cp=cp, ep=ep)
    if cache is None:
        return make()
    layers = source.decoder_cfg.layers if source.decoder_cfg is not None else None
    key = (traced_program(strategy, layout), source.profile.name, source.profile.params, layers, spec, cluster, n,
           prefer_hf, steps, tp, prime, cp, ep)
    return cache.get(key, make)


def traced_estimate(source: ModelSource, strategy: Strategy, spec: TrainSpec, cluster: Cluster,
                    shard_size: int | None = None, prefer_hf: bool = True, steps: int = 2, tp: int = 1,
                    fast: bool = True, cp: int = 1, ep: int = 1, cache: TraceCache | None = None,
                    beyond: int | None = None) -> Traced:
    """One rank of the job traced on fake tensors. `fast`: a stack of identical blocks (a preset or
    a decoder config.json) is traced with FAST_BLOCKS blocks and extrapolated to its own count,
    which gives the full trace's peak (benchmarks/fast_traced.py) in a fraction of the time; strategies
    whose state the trace replaces (DeepSpeed, host offload) too (extrapolate_replacing), unless their
    blocks' backward does not repeat as it needs; other models and layer:N checkpointing are traced
    whole. cp > 1 runs the context-parallel code (runtime/backends/cp.py) on the rank's chunks of a
    whole-sequence batch; ep > 1 the expert-parallel code (runtime/backends/ep.py) with
    the dispatch shapes of spec.moe_imbalance (a fake process group carries no routing counts). `cache`
    (TraceCache): traces of the same program already run for another candidate are reused. `beyond`
    (bytes, the GPU's capacity): where the states the rank must hold at its optimizer step
    (states_floor), with the CUDA context and the allocator's least floor, exceed it, the job cannot
    fit whatever the trace would add, and nothing is traced: the memory is that floor (traced False).
    Of `steps` steps the first only makes the optimizer's state, so it is primed (driver.prime_optimizer)
    and steps - 1 are run: the same peak, byte for byte on every traced cell of tests/measure/test_matrix.py,
    in 70% of the time."""
    import torch.distributed as dist

    check_traceable(source)
    if dist.is_initialized():
        raise HybridError("a traced estimate starts its own fake process group; run it outside a "
                          "distributed job (e.g. from the CLI)")
    check_job(source.profile, spec)
    n = strategy.shard_size(cluster, shard_size, tp, cp)
    problem = strategy.family_obj.ep_problem(strategy, ep)
    if problem is not None:
        raise problem
    job = Layout.of(strategy, cluster, spec, shard_size=shard_size, tp=tp, cp=cp, ep=ep)
    refuse_first(job, source.profile, spec, cluster)
    start = time.perf_counter()
    if beyond is not None:
        floor = states_floor(source, strategy, spec, cluster, n, prefer_hf, tp, cp, ep, cache)
        if floor is not None:
            parts, impl, cpu, phase = floor
            held = sum(parts.values())
            if held + cluster.gpu.cuda_context_bytes + fragmentation_floor(cluster, 0) > beyond:
                from ..units import fmt_bytes
                what = ("its parameters, gradients and optimizer states" if phase == "step" else
                        "its parameters and optimizer states, and every block's parameters gathered")
                when = "optimizer step" if phase == "step" else "forward's end"
                note = (f"not traced: at its {when} the rank holds at least {what}, {fmt_bytes(held)}, which "
                        f"with the CUDA context exceed the GPU's "
                        f"{fmt_bytes(beyond)}; the figures are that floor")
                memory = MemoryBreakdown.from_tensors({c: parts.get(c, 0) for c in CATEGORIES}, cluster, cpu=int(cpu),
                                                      phase=phase, notes=(note,))
                return Traced(memory, impl, time.perf_counter() - start, traced=False)
    layers = source.decoder_cfg.layers if source.decoder_cfg is not None else 0
    # every block alike: not with layer:N checkpointing, whose 3- and 4-block models mix kinds of block
    alike = not spec.activation_checkpointing.startswith("layer:")
    if fast and alike and layers > FAST_BLOCKS[-1]:
        runs = [_cached_trace(cache, source.with_layers(k), strategy, spec, cluster, n, prefer_hf, 1, tp, prime=True,
                              layout=job,
                              cp=cp, ep=ep) for k in FAST_BLOCKS]
        note = f"traced with {' and '.join(map(str, FAST_BLOCKS))} blocks, extrapolated to {layers}"
        replaced = strategy.family_obj.traced_replaces(strategy)
        if not replaced:
            parts, phase = extrapolate([t.moments() for t, _ in runs], FAST_BLOCKS, layers)
            memory = MemoryBreakdown.from_tensors(parts, cluster, phase=phase, notes=(note,))
            return Traced(memory, runs[0][1], time.perf_counter() - start)
        place = placement_of(strategy, tp_share(source.profile, tp), spec, cluster, n)
        found = extrapolate_replacing([t for t, _ in runs], FAST_BLOCKS, layers, replaced,
                                      replaced_layout(place, replaced))
        if found is not None:            # else the blocks do not repeat as the model needs: traced whole
            parts, phase = found
            memory = MemoryBreakdown.from_tensors(parts, cluster, cpu=int(place.cpu), phase=phase,
                                                  notes=(note, strategy.family_obj.traced_note(strategy)))
            return Traced(memory, runs[0][1], time.perf_counter() - start)
    tracker, impl = _cached_trace(cache, source, strategy, spec, cluster, n, prefer_hf, max(steps - 1, 1), tp,
                                  prime=steps > 1, cp=cp, ep=ep, layout=job)
    memory = _account(tracker, strategy, source, spec, cluster, n, tp)
    return Traced(memory, impl, time.perf_counter() - start)


STATE_COPIES = {"adamw": 2, "sgd": 1}
"""Optimizer states torch's optimizer keeps per trainable parameter, each shaped and typed like it
(AdamW: exp_avg and exp_avg_sq; SGD with momentum: momentum_buffer); others: none counted."""


def states_floor(source: ModelSource, strategy: Strategy, spec: TrainSpec, cluster: Cluster, n: int,
                 prefer_hf: bool, tp: int = 1, cp: int = 1, ep: int = 1, cache: TraceCache | None = None):
    """({category: bytes}, implementation, host bytes, phase): what rank 0 of the traced job holds at
    once at one moment of its step at the least, so that its traced peak (fast or full) is at least
    their sum; None where it is not derived. Where the trace replaces the state (DeepSpeed, host
    offload: _account), the replacing layout at the optimizer step, which the peak takes in. Else,
    counted on the model built on meta, the larger of: at the optimizer step its parameters, their
    gradients (the step reads them) and the optimizer's states (STATE_COPIES, made by the first
    step); and, where FSDP2 keeps gathered parameters after forward (reshard_after_forward false),
    at the end of the forward the parameters and states with every block's parameters gathered in
    the compute dtype. Whole under ddp; under FSDP2 each shard at least 1/n of its parameter (rank
    0's chunk is the largest). Only without tp, cp, ep, LoRA, compile or float8."""
    family = strategy.family_obj
    replaced = family.traced_replaces(strategy)
    if replaced:
        place = placement_of(strategy, tp_share(source.profile, tp), spec, cluster, n)
        return (replaced_layout(place, replaced)("step", 1.0), _states(source, spec, prefer_hf, cache)[3],
                place.cpu, "step")
    if (tp, cp, ep) != (1, 1, 1) or spec.lora is not None or spec.compile or spec.float8:
        return None
    layout = Layout.of(strategy, cluster, spec)
    split = family.states_split(layout, n)
    if split is None:
        return None
    share, kept_gathered = split
    every, trainable, blocks, impl, model = _states(source, spec, prefer_hf, cache)
    from ..runtime.backends.ddp import check_grouped_experts    # what the trace would refuse first
    check_grouped_experts(model, spec, layout, cluster.gpu.software)
    copies = STATE_COPIES.get(spec.optimizer, 0)
    step = dict(params=every // share, grads=trainable // share, optimizer=copies * trainable // share)
    if kept_gathered:
        forward = dict(params=step["params"], optimizer=step["optimizer"], buffers=blocks)
        if sum(forward.values()) > sum(step.values()):
            return forward, impl, 0, "head"
    return step, impl, 0, "step"


def _states(source: ModelSource, spec: TrainSpec, prefer_hf: bool, cache: TraceCache | None):
    """(bytes of every parameter, of the trainable ones, of the blocks' parameters gathered in the compute
    dtype, implementation, the module) of the model as the trace builds it, built on meta (kept in `cache`:
    a meta module holds no memory)."""
    def count():
        import torch

        from ..runtime.backends.base import compute_dtype, shardable_blocks
        dtype = torch.bfloat16 if spec.precision == "bf16" else None
        model, impl = source.build(device="meta", attention=spec.attention, prefer_hf=prefer_hf, dtype=dtype)
        params = list(model.parameters())
        low = compute_dtype(spec)
        gathered = sum(p.numel() * (low.itemsize if low is not None else p.element_size())
                       for b in shardable_blocks(model) for p in b.parameters())
        return (sum(p.numel() * p.element_size() for p in params),
                sum(p.numel() * p.element_size() for p in params if p.requires_grad), gathered, impl, model)
    if cache is None:
        return count()
    layers = source.decoder_cfg.layers if source.decoder_cfg is not None else None
    return cache.get(("states", source.profile.name, source.profile.params, layers, spec.precision, spec.attention,
                      prefer_hf), count)


def extrapolate(moments: list[dict], blocks: tuple[int, int], layers: int) -> tuple[dict[str, int], str]:
    """The peak of a `layers`-block model from the moments (MemoryTracker.moments) of two traces
    with `blocks` blocks: each moment's bytes, category by category, are a + L x b, so two counts
    fix them; the peak is the largest moment at L = layers. The middle blocks' moment is the
    largest over blocks 1 .. L-2 of a + L x b + j x c, at j = 1 or L - 2 by the sign of c: also
    a + L x b' for every L >= 3."""
    best, best_key = None, None
    for key, parts in extrapolated_moments(moments, blocks, layers).items():
        if best is None or sum(parts.values()) > sum(best.values()):
            best, best_key = parts, key
    return best, best_key[0]


def extrapolated_moments(moments: list[dict], blocks: tuple[int, int], layers: int) -> dict:
    """Each moment present in both traces (extrapolate), its bytes by category at L = layers, in
    the order of the first trace's timeline."""
    (k1, m1), (k2, m2) = zip(blocks, moments)
    return {key: {c: max(0, round(p1[c] + (m2[key][1][c] - p1[c]) * (layers - k1) / (k2 - k1))) for c in p1}
            for key, (_, p1) in m1.items() if key in m2}


def replaced_layout(place, replaced: frozenset):
    """layout(phase, progress) -> {category: bytes}: the real strategy's state (its Placement `place`)
    at each moment of the step, for the categories `replaced` that the traced proxy holds otherwise
    (tracker.peak_replacing). Where the proxy's buffers are kept (host offload: FSDP2 is the proxy),
    the unsharded gradients FSDP2 accumulates are among them, so the state's gradients go without them."""
    kept = 0 if "buffers" in replaced else place.accumulated

    def layout(phase: str, progress: float) -> dict:
        if phase == "step":
            out = dict(grads=place.grads_end + place.grads_step, buffers=place.buffers_step)
        elif phase == "blocks" and place.grads_early:      # the gradient buffer made whole at its first reduction
            out = dict(grads=place.grads_start - kept + place.grads_end, buffers=place.buffers_mid)
        elif phase == "blocks":          # gradients arrive block by block
            out = dict(grads=place.grads_start - kept + progress * (place.grads_end - place.grads_start),
                       buffers=place.buffers_mid)
        else:                            # forward, head, loss
            out = dict(grads=place.grads_start - kept, buffers=place.buffers_start)
        out.update(params=place.params, optimizer=place.optimizer)
        return {k: v for k, v in out.items() if k in replaced}
    return layout


def _blocks_run(segments):
    """The blocks phase (the blocks' backward) of a one-step trace, as the live bytes before it and
    its segments, one per mark (`segments`: tracker.segments: pre, first, mid per middle block, last, post), each
    as the change by category at each event: (start {category: bytes}, [(position, [[(category,
    change), ...] per event]) ...]); None when the trace has not exactly one blocks phase."""
    where = [i for i, (phase, _, _) in enumerate(segments) if phase == "blocks"]
    if not where or where != list(range(where[0], where[-1] + 1)) or where[-1] + 1 == len(segments):
        return None
    before = [events for _, _, events in segments[:where[0]] if events]
    if not before:
        return None
    start = previous = before[-1][-1]
    out = []
    for i in where:
        position, events = segments[i][1], segments[i][2]
        changes = []
        for now in events:
            changes.append([(c, now[c] - previous[c]) for c in now if now[c] != previous[c]])
            previous = now
        out.append((position, changes))
    return start, out


def _blocks_at(run, k: int, layers: int):
    """The segments of the blocks phase of a `layers`-block model (layers >= 3) from `run`
    (_blocks_run), a trace of k >= 4 blocks: its segments up to the first block's and from the last
    block's on as they are; of the middle blocks' the last one's (its successor is the last block)
    as it is, and the first one's (its successor a middle block) once for each other middle block.
    None where the trace's segments are not first, k - 2 middle blocks, last."""
    positions = [p for p, _ in run]
    if k < 4 or layers < 3 or "first" not in positions or "last" not in positions:
        return None
    a, b = positions.index("first") + 1, positions.index("last")
    if positions[a:b] != ["mid"] * (k - 2) or "mid" in positions[b:] or "first" in positions[a:]:
        return None
    return run[:a] + [run[a]] * (layers - 3) + run[b - 1:]


def extrapolate_replacing(trackers: list, blocks: tuple[int, int], layers: int, replaced: frozenset, layout):
    """What tracker.peak_replacing(replaced, layout) gives on the full trace of a `layers`-block
    model, from one-step traces (prime) of `blocks` blocks: (breakdown, phase), or None where the
    traces do not repeat as this needs. Outside the blocks' backward the layout is constant in each
    phase, so each moment's peak is the extrapolated moment (tracker.moments without `replaced`); in
    the blocks' backward the gradients grow with the phase's progress (its events), so that phase is
    rebuilt event by event: its start extrapolated (a + L x b), then the change at each event as the
    larger trace has it, a middle block's repeated for each block it lacks. The rebuild must give
    the smaller trace's own events exactly, or None."""
    (k1, t1), (k2, t2) = zip(blocks, trackers)
    if k2 != k1 + 1:
        return None
    runs = [_blocks_run(t.segments()) for t in trackers]
    if None in runs:
        return None
    (s1, run1), (s2, run2) = runs
    model = _blocks_at(run2, k2, k1)
    if model is None or [(p, c) for p, c in model] != run1 or s1.keys() != s2.keys():
        return None                                  # the smaller trace is not the larger one less a block
    keep = [c for c in CATEGORIES if c != "overhead" and c not in replaced]
    moments = extrapolated_moments([t.moments(exclude=replaced) for t in trackers], blocks, layers)
    best = (-1, None, "")

    def rebuilt_blocks(best):
        segments = _blocks_at(run2, k2, layers)
        live = {c: s1[c] + (s2[c] - s1[c]) * (layers - k1) for c in s1}
        kept = sum(live[c] for c in keep)
        events, i = sum(len(changes) for _, changes in segments), 0
        for _, changes in segments:
            for change in changes:
                for c, d in change:
                    live[c] += d
                    if c in keep:
                        kept += d
                state = layout("blocks", i / max(events, 1))        # as peak_replacing's progress
                i += 1
                total = sum(state.values(), kept)      # = sum(out.values()): the kept ints, then the state
                if total > best[0]:
                    out = {c: live[c] for c in keep}
                    out.update(state)
                    best = (total, out, "blocks")
        return best

    rebuilt = False
    for (phase, _), parts in moments.items():          # in the timeline's order, as peak_replacing
        if phase == "blocks":
            if not rebuilt:
                best, rebuilt = rebuilt_blocks(best), True
            continue
        out = {c: parts[c] for c in keep}
        out.update(layout(phase, 0.0))
        total = sum(out.values())
        if total > best[0]:
            best = (total, out, phase)
    if not rebuilt:
        best = rebuilt_blocks(best)
    return best[1], best[2]


def _trace(source: ModelSource, strategy: Strategy, spec: TrainSpec, cluster: Cluster, n: int,
           prefer_hf: bool, steps: int, tp: int, prime: bool = False, cp: int = 1, ep: int = 1):
    """(the tracker after `steps` training steps of one rank, which implementation was traced).
    `prime`: create the optimizer state first without a training step (driver.prime_optimizer),
    so that one step is the steady state."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..model.decoder import prepare_for_training
    from ..runtime.mesh import TRACED, Runtime, build_mesh
    from .driver import prime_optimizer, tracked_steps
    from .tracker import MemoryTracker

    dist.init_process_group(TRACED, store=FakeStore(), rank=0, world_size=cluster.world_size)
    try:
        runtime = Runtime(torch.device("cpu"), TRACED, cluster.world_size, 0, cluster.gpus_per_node,
                          stands_for=cluster.gpu.software)
        from ..layout.dims import ParallelDims
        dims = ParallelDims(dp_replicate=cluster.world_size // tp // cp // n, dp_shard=n, cp=cp, tp=tp, ep=ep)
        mesh = build_mesh(dims, runtime, cluster.gpus_per_node, cluster.domain)     # outside fake mode: real ints
        backend = strategy.family_obj.runtime()
        dtype = torch.bfloat16 if spec.precision == "bf16" else None
        with FakeTensorMode(allow_non_fake_inputs=True), unpacked_batches(), _real_mesh_arithmetic():
            tracker = MemoryTracker()
            with tracker:
                model, impl = source.build(device="cpu", attention=spec.attention, prefer_hf=prefer_hf,
                                           dtype=dtype)
                prepare_for_training(model)
                engine = backend.traced_apply(strategy, model, optimizer_factory(spec), mesh, spec, runtime)
                tracker.relabel(list(model.parameters()), "params")
                tracker.reset_peak()               # building the full model is not part of a step
                batch = make_batch(model, spec, source.profile.decoder.vocab if source.profile.decoder else None)
                if prime:
                    prime_optimizer(engine, tracker)
                tracked_steps(engine, batch, tracker, steps, accumulation=spec.gradient_accumulation)
    finally:
        end_fake_group()
    return tracker, impl


def _account(tracker, strategy: Strategy, source: ModelSource, spec: TrainSpec, cluster: Cluster,
             n: int, tp: int = 1) -> MemoryBreakdown:
    """The tracer's bytes; where the traced proxy holds its state differently from the real
    strategy (host offload; DeepSpeed's partitions and buckets), that state is replaced along the
    whole timeline by the real strategy's layout and the peak is taken again."""
    notes, cpu = [], 0
    replaced = strategy.family_obj.traced_replaces(strategy)
    if replaced:
        place = placement_of(strategy, tp_share(source.profile, tp), spec, cluster, n)
        _, parts, phase = tracker.peak_replacing(replaced, replaced_layout(place, replaced))
        cpu = place.cpu
        notes.append(strategy.family_obj.traced_note(strategy))
    else:
        parts, phase = tracker.peak_breakdown(), tracker.peak_phase
    return MemoryBreakdown.from_tensors(parts, cluster, cpu=int(cpu), phase=phase, notes=tuple(notes))


IMPLEMENTATIONS = {"transformers": "the transformers model", "hybrid": "hybrid's own implementation",
                   "factory": "the factory's model"}
"""What a traced or measured estimate ran, in its note."""


def traced_runs(layout) -> bool:
    """Whether the trace runs this layout: pipeline stages only under a family that runs them (every
    schedule: traced_stage_estimate runs each local stage of a rank, interleaved's two included)."""
    return not any(x.dim == "pp" for x in layout.dp.family_obj.problems(layout))

