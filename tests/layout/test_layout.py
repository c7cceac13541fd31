"""Layout: the one value a candidate is (dims, data-parallel preset, checkpointing, pipeline,
compile, float8), its label, its JSON and its one tie-break."""
from dataclasses import replace

import pytest

from hybrid.families.catalogue import load_catalogue
from hybrid.config.cluster import Cluster
from hybrid.errors import HybridError
from hybrid.layout.layout import Layout
from hybrid.estimation.memory.analytic import estimate
from hybrid.layout.dims import ParallelDims
from hybrid.planning.planner import enumerate_candidates, plan
from hybrid.model.sources import resolve_model
from hybrid.config.spec import TrainSpec

CAT = load_catalogue()
NODES = Cluster.build(2, 8, "h100-80gb")


@pytest.mark.unit
def test_layout_of_resolves_the_shard_size_and_validates_the_dims():
    lay = Layout.of(CAT["fsdp"], NODES, TrainSpec(activation_checkpointing="full"), tp=2, cp=2)
    assert lay.dims == ParallelDims(dp_replicate=1, dp_shard=4, cp=2, tp=2)
    assert lay.ac == "full" and lay.schedule is None and lay.label == "fsdp+cp2+tp2+ac:full"
    assert Layout.of(CAT["hsdp"], NODES, shard_size=4).dims == ParallelDims(dp_replicate=4, dp_shard=4)
    staged = Layout.of(CAT["fsdp"], NODES, pp=2)
    assert staged.schedule == "1f1b" and staged.dims.dp_shard == 8
    with pytest.raises(HybridError, match="tp 16 does not divide the 8 GPUs per node"):
        Layout.of(CAT["fsdp"], NODES, tp=16)
    with pytest.raises(HybridError, match="a pipeline schedule goes with pp > 1"):
        Layout(ParallelDims(dp_shard=8, pp=2), CAT["fsdp"])
    with pytest.raises(HybridError, match="unknown pipeline schedule 'zb'"):
        Layout(ParallelDims(dp_shard=8, pp=2), CAT["fsdp"], schedule="zb")
    with pytest.raises(HybridError, match="float8 runs behind torch.compile"):
        Layout(ParallelDims(dp_shard=8), CAT["fsdp"], float8=True)


@pytest.mark.unit
def test_to_dict_is_the_candidates_json_head():
    p = plan(resolve_model("llama2-7b").profile, TrainSpec(1, 4096), NODES)
    c = p.chosen
    head = {k: v for k, v in c.to_dict().items() if k in ("name", "family", "shard_size", "parallel",
                                                          "activation_checkpointing")}
    assert c.layout.to_dict() == head
    assert c.label == c.layout.label and c.parallel is c.layout.dims and c.strategy is c.layout.dp


@pytest.mark.unit
def test_simplicity_is_one_tuple_and_the_yaml_complexity_overrides_the_family_rank():
    zero1, fsdp = (Layout.of(CAT[n], NODES) for n in ("zero1", "fsdp"))
    assert zero1.simplicity < fsdp.simplicity            # partial sharding before full sharding
    assert CAT["zero1"].complexity < CAT["fsdp"].complexity
    forced = replace(CAT["fsdp"], complexity=0)          # a preset file's `complexity: 0`
    assert Layout.of(forced, NODES).simplicity < zero1.simplicity
    # fewer model-parallel dimensions first, then less recomputation
    assert Layout.of(CAT["fsdp"], NODES).simplicity < Layout.of(CAT["fsdp"], NODES, tp=2).simplicity
    assert fsdp.simplicity < replace(fsdp, ac="selective").simplicity < replace(fsdp, ac="full").simplicity


@pytest.mark.unit
def test_enumeration_yields_layouts_and_a_strategy_estimates_as_its_default_layout():
    prof, spec = resolve_model("llama2-7b").profile, TrainSpec(1, 4096)
    lays = enumerate_candidates(CAT, prof, spec, NODES, ["fsdp", "ddp"], None, True, tp=None, pp=None)
    assert lays and all(isinstance(x, Layout) for x in lays)
    assert {x.ac for x in lays} == {"none", "selective", "full"} and any(x.dims.pp > 1 for x in lays)
    assert estimate(CAT["fsdp"], prof, spec, NODES) == estimate(Layout.of(CAT["fsdp"], NODES, spec), prof, spec,
                                                                NODES)
    # the layout's checkpointing rules over the spec's
    full = Layout.of(CAT["fsdp"], NODES, TrainSpec(1, 4096, activation_checkpointing="full"))
    assert estimate(full, prof, spec, NODES).activations < estimate(CAT["fsdp"], prof, spec, NODES).activations


@pytest.mark.unit
def test_shares_compose_the_stage_then_cp_then_tp():
    from hybrid.layout.pipeline import StageSplit
    from hybrid.model.profile import ModelProfile
    from hybrid.estimation.shares import shares, stage_share, tp_share
    prof, spec = resolve_model("llama2-7b").profile, TrainSpec(1, 4096)
    assert "stage" not in ModelProfile.__dataclass_fields__          # a rank's position is the share's
    lay = Layout.of(CAT["fsdp"], Cluster.build(4, 8, "h100-80gb"), spec, tp=2, pp=2)
    lay = lay.with_pipeline(StageSplit(2, "1f1b", 4, (16, 16)))
    first, last = (shares(prof, lay, spec, r) for r in (0, 1))
    assert first.has_embedding and not first.has_head and last.has_head and not last.has_embedding
    assert first.held == stage_share(prof, lay.pipeline, 0) and first.profile.params < first.held.params
    # tp splits the stage's own embedding once (not the whole model's embedding and head)
    d = prof.decoder
    whole_cut = first.held.params - tp_share(first.held, 2).params          # as if it held both ends
    assert whole_cut - (first.held.params - first.profile.params) == d.vocab * d.hidden // 2
    cp = shares(prof, Layout.of(CAT["fsdp"], NODES, spec, cp=4), spec)
    assert cp.spec.seq_len == 1024 and cp.whole_spec.seq_len == 4096 and cp.loss_outside_forward


@pytest.mark.unit
def test_a_family_checks_a_layout_and_names_the_dimension_it_cannot_run():
    from hybrid.errors import NotApplicable
    zero3 = Layout(ParallelDims(dp_shard=2, cp=2, tp=2, pp=2), CAT["zero3"], schedule="1f1b")
    assert [p.dim for p in CAT["zero3"].family_obj.problems(zero3)] == ["pp", "tp", "cp"]
    with pytest.raises(NotApplicable, match="deepspeed strategies do not run pipeline stages here"):
        CAT["zero3"].family_obj.check(zero3)
    ddp = Layout(ParallelDims(dp_shard=1, dp_replicate=4, cp=2, tp=2), CAT["ddp"])
    with pytest.raises(NotApplicable, match="ddp with tp and cp: replicas of tensor-parallel groups") as e:
        CAT["ddp"].family_obj.check(ddp)
    assert e.value.dim == "cp"
    CAT["fsdp"].family_obj.check(replace(zero3, dp=CAT["fsdp"]))        # fsdp runs every dimension
    # the planner leaves out what a family cannot run unless that degree was pinned
    prof, spec = resolve_model("llama2-7b").profile, TrainSpec(1, 4096, gradient_accumulation=4)
    free = plan(prof, spec, NODES, strategies=["zero3"], tp=None, pp=None)
    assert all(c.tp == 1 and c.pp == 1 for c in free.candidates)
    pinned = plan(prof, spec, NODES, strategies=["zero3"], tp=2)
    assert pinned.chosen is None and all("not applicable with tp > 1" in c.reason for c in pinned.candidates)


@pytest.mark.unit
def test_torchtitan_emission_asks_the_family_for_its_knobs():
    """A DDP preset has no FSDP knobs (its typed config): the torchtitan command line asks its family."""
    from hybrid.handoff.emit import emit
    prof = resolve_model("llama3-8b").profile
    p = plan(prof, TrainSpec(1, 2048), Cluster.build(1, 8, "h100-80gb"), strategies=["ddp", "fsdp-offload"],
             search_shards=False)
    ddp, _ = emit("torchtitan", p, prof, "ddp")
    assert "--parallelism.fsdp_reshard_after_forward default" in ddp and "enable_cpu_offload" not in ddp
    off, _ = emit("torchtitan", p, prof, "fsdp-offload")
    assert "--training.enable_cpu_offload" in off
