"""A plan's traces shared across candidates (measure/traced.TraceCache): the same bytes as tracing each alone."""
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
    assert traced_program(CAT["hsdp"]) != traced_program(CAT["fsdp"])       # shard node, not world


@pytest.mark.parametrize("names,spec,hits", [
    (("zero1", "zero2", "zero2-offload"), TrainSpec(2, 64), 2),                           # traced whole
    (("zero3", "zero3-hpz", "fsdp-offload"), TrainSpec(1, 64, activation_checkpointing="full"), 2),
    (("fsdp", "fsdp-grad-op", "fsdp"), TrainSpec(1, 64), 2),                              # 3 and 4 blocks
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
    assert len({m.tensors for m in alone}) > 1 or names[0] == names[-1]    # the candidates do differ


@pytest.mark.fakepg
def test_the_estimator_traces_a_shared_program_once():
    """RunEstimator, as the planner calls it per candidate, keeps its traces across candidates."""
    src = resolve_model("tiny-llama").with_layers(6)
    est = RunEstimator("traced", src, CLUSTER)
    spec = TrainSpec(1, 64)
    a = est(Layout(ParallelDims(dp_shard=4), CAT["zero1"]), spec)
    b = est(Layout(ParallelDims(dp_shard=4), CAT["zero2"]), spec)
    assert est.traces.misses == 1 and est.traces.hits == 1
    assert b == RunEstimator("traced", src, CLUSTER)(Layout(ParallelDims(dp_shard=4), CAT["zero2"]), spec)
    assert a != b


@pytest.mark.unit
def test_the_cache_is_bounded():
    cache = TraceCache(size=2)
    for k in range(3):
        assert cache.get(k, lambda k=k: k * 10) == k * 10
    assert cache.get(0, lambda: "again") == "again" and cache.get(2, lambda: None) == 20
    assert (cache.hits, cache.misses) == (1, 4)
