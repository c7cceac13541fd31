"""Expert parallelism in the estimate, the cost model, the planner and the hand-off (issue 26):
each number held to the arithmetic of the layout it names (DecoderConfig's own counts, the
cluster's link figures), not to an earlier output."""
import pytest

from hybrid.families.catalogue import load_catalogue
from hybrid.config.cluster import Cluster
from hybrid.errors import HybridError
from hybrid.estimation.memory.activations import moe_pair
from hybrid.layout.layout import Layout
from hybrid.estimation.memory.analytic import estimate
from hybrid.planning.planner import plan
from hybrid.model.sources import resolve_model
from hybrid.config.spec import MOE_IMBALANCE, TrainSpec

CAT = load_catalogue()
H100 = Cluster.build(8, 8, "h100-80gb")
SPEC = TrainSpec(1, 4096)


def _est(strategy, p, spec, n, ep=1):
    """One rank's analytic estimate of `strategy` at shard size n and ep on 8 x 8 H100."""
    return estimate(Layout.of(strategy, H100, spec, shard_size=n, ep=ep), p, spec, H100)


def _profile(name="mixtral-8x7b"):
    return resolve_model(name).profile


@pytest.mark.unit
@pytest.mark.parametrize("strategy,n,ep", [("fsdp", 64, 8), ("hsdp", 8, 8), ("hsdp", 16, 4), ("fsdp", 64, 2)])
def test_expert_states_split_over_ep_then_sharded_over_expert_shard(strategy, n, ep):
    """Per rank: the dense parts' fp32 params and AdamW states / (dp_shard x cp), the rank's
    experts/ep experts' / expert_shard (= dp_shard / ep); with accumulation the unsharded fp32
    gradients of its dense parts and of its own experts only."""
    p = _profile()
    d = p.decoder
    experts = d.layers * d.experts * d.expert_params
    dense = p.params - experts
    mine = experts // ep
    m = _est(CAT[strategy], p, SPEC, n, ep)
    assert m.params == int(4 * dense / n + 4 * mine / (n // ep))
    steps = 4 * p.optim_shapes.tensors               # AdamW's 0-dim fp32 step per tensor: bytes, not GiB
    assert 0 <= m.optimizer - int(8 * dense / n + 8 * mine / (n // ep)) <= steps
    acc = _est(CAT[strategy], p, TrainSpec(1, 4096, gradient_accumulation=2), n, ep)
    held = 4 * (dense + mine)                                      # fp32 no-sync gradients (FSDP2)
    assert acc.model_states - m.model_states == held


@pytest.mark.unit
def test_the_expert_unit_is_gathered_and_reduced_apart_from_the_dense_one():
    """At ep 1 a block's backward holds (FSDP's dense-model terms) the block gathered, the next
    one prefetched (bf16 each) and one block's reduce-scatter input (fp32). At ep 2 the rank's
    experts/2 experts are a unit of their own, which FSDP2 runs apart from the block's dense
    unit (estimation/memory/moe.py alternating_units): Mixtral's largest moment is the experts' reduce:
    the dense unit gathered and the previous block's prefetched, the experts' fp32 input beside
    their bf16 gradients, and down_proj's original gradient (cut along dim 1: 4 experts over 32
    ranks) still held while its dim-0 copy is made."""
    p = _profile()
    d = p.decoder
    stack = d.experts * d.expert_params
    dense, mine = p.block_params - stack, stack // 2
    down = d.experts // 2 * d.hidden * d.moe_ffn
    one, two = (_est(CAT["fsdp"], p, SPEC, 64, ep) for ep in (1, 2))
    assert one.phase == two.phase == "blocks"
    summed = (2 * 2 + 4) * (dense + stack)
    apart = 2 * 2 * dense + 4 * mine + 2 * down
    assert one.buffers - two.buffers == pytest.approx(summed - apart, abs=4)


@pytest.mark.unit
def test_imbalance_scales_routed_activations_and_all_to_all_buffers_linearly():
    """The busiest rank keeps (imbalance - 1) x tokens x top_k more routed pairs per MoE layer, and
    one layer's dispatch and combine buffers are 2 (1 + imbalance) x tokens x top_k x hidden bf16."""
    p = _profile()
    d = p.decoder
    pairs = SPEC.tokens * d.top_k
    est = {imb: _est(CAT["fsdp"], p, TrainSpec(1, 4096, moe_imbalance=imb), 64, 2)
           for imb in (1.0, 1.5, 2.0)}
    assert {m.phase for m in est.values()} == {"blocks"}
    step = est[1.5].activations - est[1.0].activations
    assert est[2.0].activations - est[1.5].activations == pytest.approx(step, abs=d.layers)
    assert step == pytest.approx(0.5 * d.layers * pairs * moe_pair(d, 2), abs=d.layers)
    buf = est[1.5].temporaries - est[1.0].temporaries
    assert buf == pytest.approx(2 * 0.5 * pairs * d.hidden * 2, abs=1)
    assert est[2.0].temporaries - est[1.5].temporaries == pytest.approx(buf, abs=1)
    # at ep 1 a rank computes its own tokens: the imbalance changes nothing
    one = [_est(CAT["fsdp"], p, TrainSpec(1, 4096, moe_imbalance=imb), 64).total for imb in (1.0, 2.0)]
    assert one[0] == one[1]


@pytest.mark.unit
def test_all_to_alls_ride_nvlink_inside_a_node_and_the_nic_across_nodes():
    """Four all-to-alls per MoE layer of tokens x top_k x hidden bf16, (ep - 1) / ep of it off the
    rank, the busiest receiver imbalance x that: NVLink for an ep group inside a node, the rank's
    NIC for the share that leaves a node."""
    from hybrid.estimation.cost.step import expert_parallel_terms
    from hybrid.estimation.cost.links import Links
    p = _profile("qwen3-30b-a3b")
    d, g = p.decoder, H100.gpu
    nbytes = 2 * SPEC.tokens * d.top_k * d.hidden
    for ep in (8, 16):
        _, _, a2a = expert_parallel_terms(CAT["fsdp"], p, SPEC, H100, 64, ep, 1e15)
        if ep == 8:
            one = MOE_IMBALANCE * nbytes * 7 / 8 / g.intra_node_bw
        else:
            one = MOE_IMBALANCE * nbytes * max(7 / 16 / g.intra_node_bw, 8 / 16 / g.inter_node_bw)
        assert a2a == pytest.approx(4 * d.layers * (one + Links(H100).latency(ep)))


@pytest.mark.unit
def test_the_straggler_computes_imbalance_times_the_mean_expert_flops():
    from hybrid.estimation.cost.step import expert_parallel_terms
    p = _profile()
    d = p.decoder
    _, straggler, _ = expert_parallel_terms(CAT["fsdp"], p, SPEC, H100, 64, 8, 1e15)
    assert straggler == pytest.approx((MOE_IMBALANCE - 1) * 6 * d.layers * d.top_k * d.expert_params
                                      * SPEC.tokens / 1e15)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_planner_picks_ep_for_hsdp_on_8x8_h100_and_says_why(name):
    """HSDP at seq 4096 on 8 x 8 H100-80GB: at ep 1 a shard group gathers every expert of a
    layer and shards the states over fewer ranks; with ep the experts' states are split over
    the ep ranks first. The plan picks ep > 1, every ep 1 candidate is slower or does not fit,
    and the plan says so."""
    from hybrid.planning.report import format_plan
    p = plan(_profile(name), SPEC, H100, strategies=["hsdp"], search_checkpointing=True, ep=None)
    c = p.chosen
    assert c is not None and c.ep > 1
    ep1 = [x for x in p.candidates if x.ep == 1 and x.fits]
    assert all(x.cost.time_per_token > c.cost.time_per_token for x in ep1)
    assert f"why ep {c.ep}: the best layout without expert parallelism" in format_plan(p)


@pytest.mark.unit
def test_ep_is_tried_for_moe_fsdp_layouts_only():
    from hybrid.estimation.memory.moe import ep_degrees
    moe, dense = _profile(), resolve_model("llama2-7b").profile
    assert ep_degrees(dense, CAT["fsdp"], 64, 1, 1, 1, H100, None) == [1]
    assert ep_degrees(moe, CAT["fsdp"], 64, 1, 1, 1, H100, None) == [1, 2, 4, 8]
    assert ep_degrees(moe, CAT["hsdp"], 4, 1, 1, 1, H100, None) == [1, 2, 4]
    assert ep_degrees(moe, CAT["zero3"], 64, 1, 1, 1, H100, None) == [1]
    p = plan(_profile(), SPEC, H100, ep=None)
    assert {x.ep for x in p.candidates if not x.strategy.family_obj.supports_ep} == {1}


@pytest.mark.unit
def test_ep_on_a_dense_model_is_one_line_and_exit_2(capsys):
    from hybrid.cli.main import main
    code = main(["plan", "llama2-7b", "--nodes", "8", "--ep", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "dense model" in err and "--ep" in err
    with pytest.raises(HybridError, match="does not divide mixtral-8x7b's 8 experts.*valid ep: 1, 2, 4, 8"):
        plan(_profile(), SPEC, H100, ep=3)


@pytest.mark.unit
def test_moe_imbalance_is_a_job_key_and_checked():
    from hybrid.config.jobfile import OPTIONS
    assert OPTIONS["moe_imbalance"].check(1.5) == 1.5
    with pytest.raises(HybridError, match="moe_imbalance must be at least 1"):
        OPTIONS["moe_imbalance"].check(0.5)
    with pytest.raises(HybridError, match="moe-imbalance must be a number >= 1"):
        TrainSpec(1, 4096, moe_imbalance=0.9)
    assert "moe_imbalance" not in SPEC.to_dict() and TrainSpec(moe_imbalance=2.0).to_dict()["moe_imbalance"] == 2.0


@pytest.mark.unit
def test_torchtitan_emit_carries_ep_and_the_others_name_torchtitan():
    from hybrid.handoff.emit import emit
    p = plan(_profile(), SPEC, H100, strategies=["fsdp"], ep=8, search_checkpointing=True)
    assert p.chosen.ep == 8
    text, c = emit("torchtitan", p, p.model)
    assert "--parallelism.expert_parallel_degree 8" in text and c.ep == 8
    for kind in ("fsdp", "accelerate"):
        with pytest.raises(HybridError, match=f"--emit {kind} cannot express expert parallelism.*--emit torchtitan"):
            emit(kind, p, p.model)


@pytest.mark.torch
def test_torchtitan_reads_the_ep_degree(capsys):
    """torchtitan's own ConfigManager on the emitted arguments (skipped where torchtitan 0.3 is not
    installed, as tests/handoff/test_handoff.py does), its model module and config function filled in."""
    from hybrid.cli.main import main
    from tests.handoff.test_handoff import torchtitan_argv, torchtitan_config
    argv = ["plan", "mixtral-8x7b", "--nodes", "8", "--ep", "8", "--strategy", "fsdp", "--emit", "torchtitan"]
    assert main(argv) == 0
    argv = torchtitan_argv(capsys.readouterr().out)
    argv[argv.index("--module") + 1], argv[argv.index("--config") + 1] = "llama3", "llama3_debugmodel"
    assert torchtitan_config(argv).parallelism.expert_parallel_degree == 8


@pytest.mark.unit
def test_a_pinned_ep_that_does_not_fit_suggests_a_larger_one():
    """Gradient accumulation keeps every unsharded fp32 gradient a rank owns (FSDP2's no-sync): at
    ep 1 all of Qwen3-30B-A3B's (122 GB), with ep only the rank's experts."""
    two = Cluster.build(2, 8, "h100-80gb")
    spec = TrainSpec(1, 4096, gradient_accumulation=2, activation_checkpointing="full")
    p = plan(_profile("qwen3-30b-a3b"), spec, two, strategies=["fsdp"], ep=1)
    assert p.chosen is None or p.chosen.pp > 1
    tried = [x for x in p.candidates if x.pp == 1]
    assert tried and not any(x.fits for x in tried)
    fix = [s for s in p.suggestions if s.startswith("--ep ")]
    assert fix and int(fix[0].split()[1]) > 1


@pytest.mark.unit
def test_the_plan_names_what_ep_costs():
    """The why-ep line gives the all-to-all and straggler seconds of the ep layout, as the cost
    model's StepCost records them (and the JSON carries them for ep > 1 only)."""
    from hybrid.planning.report import format_plan
    p = plan(_profile(), SPEC, H100, strategies=["hsdp"], search_checkpointing=True, ep=None)
    c = p.chosen
    assert c.ep > 1 and c.cost.all_to_all_s > 0 and c.cost.straggler_s > 0
    assert (f"the all-to-alls take {c.cost.all_to_all_s:.3f} s and the busiest rank's extra expert compute "
            f"{c.cost.straggler_s:.3f} s") in format_plan(p)
    assert "all_to_all_s" in c.cost.to_dict()
    assert "all_to_all_s" not in next(x for x in p.candidates if x.ep == 1 and x.cost).cost.to_dict()


@pytest.mark.unit
def test_an_ep_no_layout_can_take_is_one_line():
    with pytest.raises(HybridError, match=r"--ep 8: no layout on .* has dp_shard x cp divisible by 8.*divides 4"):
        plan(_profile(), SPEC, Cluster.build(1, 4, "h100-80gb"), ep=8)


@pytest.mark.unit
def test_job_file_and_auto_wrap_carry_moe_imbalance_and_ep(tmp_path, capsys):
    """`moe_imbalance` and `ep` as job keys reach the plan (`hybrid plan --config`), and are
    auto_wrap arguments checked as the job keys are."""
    import json

    from hybrid.cli.main import main
    from hybrid.config.jobfile import check_arguments, wrap_options
    job = tmp_path / "job.yaml"
    job.write_text("model: mixtral-8x7b\nnodes: 8\nseq_len: 4096\nep: 8\nmoe_imbalance: 1.5\n")
    assert main(["plan", "--config", str(job), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec"]["moe_imbalance"] == 1.5 and out["chosen_candidate"]["parallel"]["ep"] == 8
    assert wrap_options(str(job))[0]["moe_imbalance"] == 1.5
    with pytest.raises(HybridError, match="auto_wrap: moe_imbalance must be at least 1"):
        check_arguments({"moe_imbalance": 0.5}, "auto_wrap")


@pytest.mark.unit
def test_the_experts_mesh_splits_the_sharded_ranks():
    from hybrid.layout.dims import EXPERT_DIM_NAMES, ParallelDims
    d = ParallelDims(dp_replicate=2, dp_shard=4, cp=2, ep=4)
    assert EXPERT_DIM_NAMES == ("pp", "dp_replicate", "expert_shard", "ep", "tp")
    assert d.expert_shape == (1, 2, 2, 4, 1)
    assert ParallelDims(dp_shard=4).expert_shape == (1, 1, 4, 1, 1)


@pytest.mark.unit
def test_ep_is_a_checked_job_option():
    from hybrid.config.jobfile import OPTIONS, check_arguments
    assert OPTIONS["ep"].check(2) == 2
    with pytest.raises(HybridError, match="ep"):
        check_arguments({"ep": 0}, "auto_wrap")


@pytest.mark.unit
def test_a_forced_strategy_without_ep_says_which_have_it():
    """auto_wrap(strategy="ddp", ep=2) and `hybrid plan --strategy ddp --ep 2` plan through here."""
    prof, cl = resolve_model("mixtral-8x7b").profile, Cluster.build(8, 8, "h100-80gb")
    for name in ("ddp", "zero3"):
        with pytest.raises(HybridError, match=f"--ep 8: {name} cannot split experts; expert parallelism runs on"):
            plan(prof, TrainSpec(1, 4096), cl, load_catalogue(), strategies=[name], ep=8)
