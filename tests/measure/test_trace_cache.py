"""A plan's traces shared across candidates (measure/traced.TraceCache): the same bytes as tracing each alone."""
from dataclasses import replace

import pytest

from hybrid.config.cluster import Cluster
from hybrid.config.spec import TrainSpec
from hybrid.families.catalogue import load_catalogue
from hybrid.layout.dims import ParallelDims
from hybrid.layout.layout import Layout
from hybrid.measure.method import RunEstimator
from hybrid.measure.traced import TraceCache, traced_estimate, traced_program
from hybrid.model.sources import resolve_model

CAT = load_catalogue()
CLUSTER = Cluster.build(1, 4, "h100-80gb")


@pytest.mark.torch
def test_programs_group_as_the_trace_runs_them():
    """DeepSpeed traces as its FSDP2 equivalent and a traced run ignores host offload: the presets that
    share a program, and those that do not."""
    no_reshard = {traced_program(CAT[s]) for s in ("zero1", "zero2", "zero2-offload")}
    reshard = {traced_program(CAT[s]) for s in ("zero3", "zero3-hpz", "zero3-offload", "fsdp-offload")}
    assert len(no_reshard) == 1 and len(reshard) == 1 and no_reshard != reshard
    assert traced_program(CAT["fsdp"]) == next(iter(reshard))
    assert traced_program(CAT["fsdp-grad-op"]) == next(iter(no_reshard))
    assert traced_program(CAT["ddp"]) != traced_program(CAT["fsdp"])
    # the shard rule is not the program: the group size it resolves to is in the cache's key
    assert traced_program(CAT["hsdp"]) == traced_program(CAT["fsdp"])
    # ddp over tensor-parallel groups or a pipeline stage replicates through FSDP2 kept gathered: fsdp-grad-op's
    tp2, pp2 = (Layout.of(CAT["fsdp"], CLUSTER, tp=2), Layout.of(CAT["fsdp"], CLUSTER, pp=2, schedule="1f1b"))
    assert traced_program(CAT["ddp"], tp2) == traced_program(CAT["fsdp-grad-op"], tp2) != traced_program(CAT["ddp"])
    assert traced_program(CAT["ddp"], pp2) == traced_program(CAT["fsdp-grad-op"], pp2)


@pytest.mark.parametrize("names,spec,hits", [
    (("zero1", "zero2", "zero2-offload"), TrainSpec(2, 64), 4),                           # 3 and 4 blocks
    (("zero3", "zero3-hpz", "fsdp-offload"), TrainSpec(1, 64, activation_checkpointing="full"), 4),
    (("fsdp", "fsdp-grad-op", "fsdp"), TrainSpec(1, 64), 2),
    (("fsdp", "hsdp"), TrainSpec(1, 64), 2),                          # hsdp on one node: fsdp's group
])
@pytest.mark.fakepg
def test_shared_traces_give_each_candidate_its_own_bytes(names, spec, hits):
    """Each candidate traced through one cache, in a plan's order, has exactly the breakdown it has
    traced alone (every category, the phase, the notes), and the cache did share traces."""
    src = resolve_model("tiny-llama").with_layers(6)
    cache = TraceCache()
    shared = [traced_estimate(src, CAT[n], spec, CLUSTER, cache=cache).memory for n in names]
    alone = [traced_estimate(src, CAT[n], spec, CLUSTER).memory for n in names]
    assert shared == alone
    assert cache.hits == hits
    assert len({m.tensors for m in alone}) > 1 or names[0] == names[-1] or "hsdp" in names   # the candidates differ


@pytest.mark.fakepg
def test_the_estimator_traces_a_shared_program_once():
    """RunEstimator, as the planner calls it per candidate, keeps its traces across candidates."""
    src = resolve_model("tiny-llama").with_layers(6)
    est = RunEstimator("traced", src, CLUSTER)
    spec = TrainSpec(1, 64)
    a = est(Layout(ParallelDims(dp_shard=4), CAT["zero1"]), spec)
    b = est(Layout(ParallelDims(dp_shard=4), CAT["zero2"]), spec)
    # the 3- and 4-block traces, and the meta model's state count (traced.states_floor)
    assert est.traces.misses == 3 and est.traces.hits == 3
    assert b == RunEstimator("traced", src, CLUSTER)(Layout(ParallelDims(dp_shard=4), CAT["zero2"]), spec)
    assert a != b


@pytest.mark.unit
def test_the_cache_is_bounded():
    cache = TraceCache(size=2)
    for k in range(3):
        assert cache.get(k, lambda k=k: k * 10) == k * 10
    assert cache.get(0, lambda: "again") == "again" and cache.get(2, lambda: None) == 20
    assert (cache.hits, cache.misses) == (1, 4)


REPLACED = {"no-reshard": ("zero1", "zero2", "zero2-offload"),
            "reshard": ("zero3", "zero3-hpz", "zero3-offload", "zero3-offload-params", "fsdp-offload")}
"""The presets whose state the trace replaces (DeepSpeed, host offload), by the program their ranks run."""


@pytest.mark.parametrize("program,layers,checkpointing", [
    ("no-reshard", 5, "none"), ("no-reshard", 6, "full"), ("no-reshard", 8, "selective"),
    ("reshard", 5, "full"), ("reshard", 6, "none"), ("reshard", 8, "selective"),
])
@pytest.mark.fakepg
def test_fast_trace_of_a_replaced_state_is_the_full_trace(program, layers, checkpointing):
    """DeepSpeed and host-offload presets on the 3-/4-block fast path: every category, the phase and the
    host bytes are the full trace's to the byte (fast=False: every block, two steps), at three model sizes
    over the two programs; only the notes say how it was traced."""
    src = resolve_model("tiny-llama").with_layers(layers)
    spec = TrainSpec(1, 64, activation_checkpointing=checkpointing)
    small, whole = TraceCache(), TraceCache()
    for name in REPLACED[program]:
        fast = traced_estimate(src, CAT[name], spec, CLUSTER, cache=small).memory
        full = traced_estimate(src, CAT[name], spec, CLUSTER, fast=False, cache=whole).memory
        assert any(f"extrapolated to {layers}" in n for n in fast.notes), name
        assert replace(fast, notes=()) == replace(full, notes=()), name
    assert small.misses == 2 and whole.misses == 1            # one program: two small traces, one whole


@pytest.mark.fakepg
def test_the_rebuilt_backward_is_the_traced_one_event_by_event():
    """Where the gradients' growth through the blocks' backward sets the peak (a layout whose gradients
    dwarf the rest), the backward rebuilt from 3 and 4 blocks gives the peak the 6-block trace of the same
    one-step program has (tracker.peak_replacing over every event), byte for byte; a pair of traces that
    is not one model less a block is refused (None: the candidate is then traced whole)."""
    from hybrid.measure.traced import _trace, extrapolate_replacing

    spec = TrainSpec(1, 64)
    replaced = frozenset({"params", "grads", "optimizer"})

    def layout(phase, progress):
        grads = 1e9 * progress if phase == "blocks" else 0
        return {"grads": grads, "params": 1000, "optimizer": 7}

    def traced(k, name="zero3", source=None):
        src = source or resolve_model("tiny-llama").with_layers(k)
        return _trace(src, CAT[name], spec, CLUSTER, 4, True, 1, 1, prime=True)[0]

    three, four, six = traced(3), traced(4), traced(6)
    total, parts, phase = six.peak_replacing(replaced, layout)
    assert phase == "blocks"
    assert extrapolate_replacing([three, four], (3, 4), 6, replaced, layout) == (parts, phase)
    assert extrapolate_replacing([three, traced(4, "zero1")], (3, 4), 6, replaced, layout) is None
    assert extrapolate_replacing([three, four], (3, 5), 6, replaced, layout) is None


@pytest.mark.parametrize("names,spec", [
    (("ddp",), TrainSpec(1, 64)),
    (("ddp",), TrainSpec(1, 64, precision="bf16", optimizer="sgd")),
    (("fsdp", "hsdp", "zero3", "fsdp-offload"), TrainSpec(1, 64)),
    (("fsdp-grad-op", "zero1", "zero2-offload"), TrainSpec(1, 64, activation_checkpointing="full")),
])
@pytest.mark.fakepg
def test_the_states_floor_is_below_the_trace(names, spec):
    """What a rank must hold at one moment by its states alone (traced.states_floor, counted on the model built
    on meta) is at most the traced peak, for every kind of program; under ddp the parameters and gradients are
    the traced ones to the byte (the optimizer's step counters are left out)."""
    from hybrid.measure.traced import states_floor

    src = resolve_model("tiny-llama").with_layers(6)
    cache = TraceCache()
    for name in names:
        s = CAT[name]
        parts, impl, cpu, phase = states_floor(src, s, spec, CLUSTER, s.shard_size(CLUSTER), True, cache=cache)
        traced = traced_estimate(src, s, spec, CLUSTER, cache=cache)
        assert 0 < sum(parts.values()) <= traced.memory.tensors or name == "fsdp-offload", name
        assert impl == traced.implementation and cpu == traced.memory.cpu, name
        if name == "ddp":
            assert (parts["params"], parts["grads"]) == (traced.memory.params, traced.memory.grads)
        if name == "fsdp-grad-op":                 # gathered blocks kept from forward to backward
            assert phase == "head" and parts["buffers"] > 0


@pytest.mark.fakepg
def test_a_rank_whose_states_exceed_the_gpu_is_not_traced():
    """With the GPU's capacity given (`beyond`, as the planner's RunEstimator gives it), a rank whose states
    floor with the CUDA context and the allocator's least floor exceeds it is not traced: its memory is that
    floor, which cannot fit; one byte more room and it is traced as before."""
    from hybrid.estimation.memory.breakdown import fragmentation_floor
    from hybrid.measure.traced import states_floor

    src = resolve_model("tiny-llama").with_layers(6)
    spec = TrainSpec(1, 64)
    parts = states_floor(src, CAT["ddp"], spec, CLUSTER, 1, True)[0]
    edge = sum(parts.values()) + CLUSTER.gpu.cuda_context_bytes + fragmentation_floor(CLUSTER, 0)
    cache = TraceCache()
    out = traced_estimate(src, CAT["ddp"], spec, CLUSTER, cache=cache, beyond=edge - 1)
    assert not out.traced and cache.misses == 1                       # the meta model's count, no trace
    assert out.memory.tensors == sum(parts.values()) and out.memory.needed > edge - 1
    assert "not traced" in out.memory.notes[0]
    kept = traced_estimate(src, CAT["ddp"], spec, CLUSTER, cache=cache, beyond=edge)
    assert kept.traced and kept.memory == traced_estimate(src, CAT["ddp"], spec, CLUSTER).memory

    small = Cluster.build(1, 4, "h100-80gb", gpu_memory=edge - 1)
    est = RunEstimator("traced", src, small)
    memory = est(Layout(ParallelDims(dp_shard=1), CAT["ddp"]), spec)
    assert any("not traced" in n for n in memory.notes) and est.traces.misses == 1
