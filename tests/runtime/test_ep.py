"""Expert parallelism (hybrid/runtime/backends/ep.py): the experts' mesh, the errors for what cannot
honour ep, and training on gloo ranks equal to one process, checkpoints portable to ep 1."""
import pytest
import torch

from hybrid.errors import HybridError


def tiny_mixtral(seed=0):
    """A 2-block transformers Mixtral, 4 experts (ep 2: two per rank), top 2, vocabulary 512."""
    from hybrid.model.decoder import build_hf
    torch.manual_seed(seed)
    return build_hf(_cfg("mixtral"), device="cpu")


def tiny_moe_decoder(seed=0):
    """Our decoder with Mixtral's MoE blocks, the same shape."""
    from hybrid.model.decoder import build_decoder
    return build_decoder(_cfg("mixtral"), seed=seed)


def tiny_qwen3_moe(seed=0):
    """A 2-block transformers Qwen3-MoE (query/key norms, head size 32), 4 experts, top 2."""
    from hybrid.model.decoder import build_hf
    torch.manual_seed(seed)
    return build_hf(_cfg("qwen3_moe"), device="cpu")


def _cfg(mt, experts=4):
    from hybrid.model.presets import DecoderConfig
    qwen = mt == "qwen3_moe"
    return DecoderConfig("llama", 512, 32, 2, 4, 48, 64, kv_heads=2, hf_model_type=mt, experts=experts, top_k=2,
                         moe_ffn=48, qk_norm="head" if qwen else None, head_size=32 if qwen else None)


MODELS = {"mixtral": tiny_mixtral, "ours": tiny_moe_decoder, "qwen3": tiny_qwen3_moe}


# --- pure checks: the layout, the errors ------------------------------------------------------


@pytest.mark.torch           # CPU modules, no process group
def test_what_cannot_honour_ep_says_what_can():
    from hybrid.runtime.backends.ep import check_expert_parallel
    from hybrid.model.decoder import build_decoder
    from hybrid.families.catalogue import load_catalogue
    cat = load_catalogue()
    model = tiny_moe_decoder()
    assert len(check_expert_parallel(model, 2, cat["fsdp"], False, 1)) == 2
    assert len(check_expert_parallel(model, 2, cat["hsdp"], False, 1)) == 2
    with pytest.raises(HybridError, match=r"not ddp \(the ddp family\); use strategy fsdp or hsdp with ep"):
        check_expert_parallel(model, 2, cat["ddp"], False, 1)
    with pytest.raises(HybridError, match=r"not zero3 \(the deepspeed family\); use strategy fsdp or hsdp"):
        check_expert_parallel(model, 2, cat["zero3"], False, 1)
    with pytest.raises(HybridError, match=r"not a pipeline; use strategy fsdp or hsdp with ep \(and pp 1\)"):
        check_expert_parallel(model, 2, cat["fsdp"], True, 1)
    with pytest.raises(HybridError, match="ep 2 with tp 2.*use tp 1 with ep"):
        check_expert_parallel(model, 2, cat["fsdp"], False, 2)
    with pytest.raises(HybridError, match="ep 8 does not divide the 4 experts.*use an ep that divides 4"):
        check_expert_parallel(model, 8, cat["fsdp"], False, 1)
    with pytest.raises(HybridError, match="no stacked experts.*use ep 1 for a dense model"):
        check_expert_parallel(build_decoder("tiny-llama"), 2, cat["fsdp"], False, 1)


@pytest.mark.torch           # CPU modules, no process group
def test_our_moe_block_computes_what_transformers_mixtral_computes():
    """Same weights, same tokens: our MoE decoder's logits and gradients are transformers'."""
    hf, ours = tiny_mixtral(), tiny_moe_decoder(seed=3)
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    for i in range(2):
        for a, b in (("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm"), ("attn", "self_attn"),
                     ("mlp.gate", "mlp.gate"), ("mlp.experts", "mlp.experts")):
            names.update({k: k.replace(f"blocks.{i}.{a}", f"model.layers.{i}.{b}")
                          for k in ours.state_dict() if k.startswith(f"blocks.{i}.{a}.")})
    hf_state = hf.state_dict()
    ours.load_state_dict({k: hf_state[v] for k, v in names.items()})
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    a, b = ours(ids, labels=ids), hf(ids, labels=ids)
    assert (a.logits - b.logits).abs().max() < 1e-5
    a.loss.backward()
    b.loss.backward()
    for k, v in names.items():
        assert (ours.get_parameter(k).grad - hf.get_parameter(v).grad).abs().max() < 1e-6, k


@pytest.mark.fakepg
def test_build_mesh_gives_the_ep_and_expert_data_parallel_ranks():
    """Rank 5 of 8 under dp_replicate 2 x dp_shard 2 x cp 2, ep 2: the dense shard group is the
    4 ranks 4-7 (dp_shard x cp); its ep group is {4, 5} (consecutive: inside a node) and the
    ranks holding its experts are {5, 7} with the replica {1, 3} (HSDP over expert_shard)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybrid.runtime.mesh import ep_mesh, ep_size, expert_dp_mesh, fsdp_mesh
    from hybrid.layout.dims import ParallelDims
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        mesh = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, ep=2).build_mesh("cpu")
        assert ep_size(mesh) == 2 and ep_size(ParallelDims(dp_shard=8).build_mesh("cpu")) == 1
        assert ep_mesh(mesh).mesh.tolist() == [4, 5]
        assert expert_dp_mesh(mesh).mesh.tolist() == [[1, 3], [5, 7]]
        assert fsdp_mesh(mesh).mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")   # the dense mesh as before
    finally:
        dist.destroy_process_group()


# --- gloo: training equal to one process, checkpoints across ep -------------------------------
def _wrap(model, strategy, ep, checkpointing=None, cp=None):
    from hybrid import auto_wrap
    from tests.runtime.test_loop import CLIP, GA, MB, SEQ, adamw, warmup
    return auto_wrap(model, optimizer=adamw, scheduler=warmup, gradient_accumulation=GA, max_grad_norm=CLIP,
                     strategy=strategy, precision="fp32", micro_batch=MB, seq_len=SEQ, verbose=False, ep=ep,
                     activation_checkpointing=checkpointing, cp=cp)


def _steps(w, batches):
    from tests.runtime.test_loop import GA, micro
    norms = []
    for ids in batches:
        for k in range(GA):
            local = micro(ids, w.dp_size, w.dp_rank, k)
            w.backward(w(local, labels=local).loss)
            w.step()
            w.zero_grad()
        norms.append(float(w.grad_norm))
    return norms


def _expert_split(w) -> list:
    """(ep size, placement on ep) of every expert stack: each must be Shard(0) over 2 ranks."""
    from hybrid.runtime.backends.ep import expert_modules
    out = set()
    for m in expert_modules(w.engine.model):
        for p in (m.gate_up_proj, m.down_proj):
            names = p.device_mesh.mesh_dim_names
            if "ep" in names:
                out.add((p.device_mesh.size(names.index("ep")), str(p.placements[names.index("ep")])))
    return sorted(out)


def ep_ranks(jobs, path):
    """On the ranks: each (strategy, model, checkpointing, cp) of `jobs` trained under ep 2 for 3
    steps; the first saved at `path`, given one more step, then loaded into a fresh fsdp job
    without ep (other initial weights) that takes the same step."""
    from tests.runtime.test_loop import global_batches
    out = {}
    for i, (strategy, name, checkpointing, cp) in enumerate(jobs):
        w = _wrap(MODELS[name](), strategy, 2, checkpointing, cp)
        norms = _steps(w, global_batches(w.dp_size))
        out[strategy, name, checkpointing, cp] = {"norms": norms, "state": w.state_dict(), "split": _expert_split(w),
                                                  "dp": w.dp_size}
        if i == 0:
            w.save(path)
            more = global_batches(w.dp_size, 1, seed=11)
            _steps(w, more)
            out["after"] = w.state_dict()
            w1 = _wrap(MODELS[name](seed=5), "fsdp", None)
            w1.load(path)
            out["loaded"] = w1.state_dict()
            _steps(w1, more)
            out["after_ep1"] = w1.state_dict()
            out["ep1_split"] = _expert_split(w1)
    return out


def load_alone(name, path, world):
    """One process: the checkpoint loaded under fsdp (no ep, world of one), then the step the
    `world` ranks took next, each micro-batch the rows of all of theirs."""
    from tests.runtime.test_loop import GA, MB, global_batches
    w = _wrap(MODELS[name](seed=5), "fsdp", None)
    w.load(path)
    ids = global_batches(world, 1, seed=11)[0]
    for k in range(GA):
        local = ids[k * world * MB:(k + 1) * world * MB]
        w.backward(w(local, labels=local).loss)
        w.step()
        w.zero_grad()
    return w.state_dict()


def _check(results, jobs):
    from tests.runtime.test_loop import CLIP, reference
    refs, worst = {}, {}
    for job in jobs:
        dp = results[0][job]["dp"]             # cp ranks read the same sequences: the data world is dp
        if (job[1], dp) not in refs:
            refs[job[1], dp] = reference(dp, model_fn=MODELS[job[1]])[:2]
        ref, ref_norms = refs[job[1], dp]
        assert ref_norms[0] > CLIP                      # clipping acts
        for rank, res in enumerate(results):
            r = res[job]
            assert r["split"] == [(2, "S(0)")], (job, r["split"])
            diff = max((r["state"][k] - ref[k]).abs().max().item() for k in ref)
            assert diff < 1e-5, f"{job} rank {rank}: max abs diff {diff:.2e}"
            for a, b in zip(r["norms"], ref_norms):
                assert abs(a - b) <= 1e-5 * b, f"{job}: grad norm {a} vs {b}"
            worst[job] = max(worst.get(job, 0.0), diff)
    first = jobs[0]
    for res in results:
        assert res["ep1_split"] == []                # loaded without ep: plain FSDP shards
        saved = res[first]["state"]
        assert max((res["loaded"][k] - saved[k]).abs().max().item() for k in saved) == 0
        # optimizer moments and step counts came back: the next step is the same under ep 1
        assert max((res["after_ep1"][k] - res["after"][k]).abs().max().item() for k in saved) < 1e-5
    return worst


@pytest.mark.gloo
def test_ep2_on_two_ranks_trains_like_one_process_and_loads_under_ep1_and_alone(tmp_path):
    """ep 2 = dp_shard 2 on 2 ranks (each rank its 2 of 4 experts), 3 steps with accumulation,
    clipping (expert and dense gradients on different meshes) and a scheduler: our MoE decoder,
    the transformers Mixtral (strategy auto: the planner's layout at ep 2) and transformers'
    Qwen3-MoE (with full activation checkpointing: the all-to-alls run again in backward) within
    1e-5 of one process on the same global batch. The first one's checkpoint loads without ep on
    2 ranks and in one process, and exports as a transformers Mixtral."""
    from hybrid.runtime.launch import run_ranks
    from transformers import AutoModelForCausalLM

    from hybrid.cli.main import main
    jobs = [("fsdp", "ours", None, None), ("auto", "mixtral", None, None), ("fsdp", "qwen3", "full", None)]
    ckpt, out = str(tmp_path / "ep2"), str(tmp_path / "hf")
    results = run_ranks(2, ep_ranks, jobs, ckpt)
    print("max abs diff vs one process:", _check(results, jobs))
    alone = run_ranks(1, load_alone, "ours", ckpt, 2)[0]      # the same step in one process
    assert max((alone[k] - results[0]["after"][k]).abs().max().item() for k in alone) < 1e-5
    # exported, our MoE decoder's checkpoint is a transformers Mixtral with the same outputs
    assert main(["export", ckpt, out]) == 0
    ours = tiny_moe_decoder()
    ours.load_state_dict(results[0][jobs[0]]["state"])
    hf = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max() < 1e-5


@pytest.mark.gloo
def test_ep2_by_dp2_on_four_ranks_trains_like_one_process_and_loads_under_ep1(tmp_path):
    """4 ranks, 2 per node: fsdp (dp_shard 4 = expert_shard 2 x ep 2: experts FSDP-sharded over
    the 2 ranks holding the same ones) for both models, hsdp (dp_replicate 2 x dp_shard 2 = ep 2)
    for Mixtral, and our decoder under cp 2 (dp_shard 2 x cp 2 = expert_shard 2 x ep 2: each rank
    routes the tokens of its sequence chunks); the fsdp job's checkpoint loads under fsdp without
    ep."""
    from hybrid.runtime.launch import run_ranks
    jobs = [("fsdp", "mixtral", None, None), ("fsdp", "ours", None, None), ("hsdp", "mixtral", None, None),
            ("fsdp", "ours", None, 2)]
    worst = _check(run_ranks(4, ep_ranks, jobs, str(tmp_path / "ep2dp2"), local_world=2), jobs)
    print("max abs diff vs one process:", worst)


@pytest.mark.fakepg
def test_traced_estimate_runs_the_expert_parallel_code_on_fake_ranks():
    """Mixtral-8x7B, fsdp on 8 x 8 H100, traced with ep 1 and ep 8 (one expert per rank): each
    rank keeps the same share of the states (ep 8 x expert_shard 8 = the 64 ranks ep 1 shards
    over), while the expert unit FSDP gathers for a layer shrinks from 8 experts to 1: the peak
    drops by at least one layer's bf16 expert stack (7 x 3 x 14336 x 4096 x 2 bytes)."""
    from hybrid.families.catalogue import load_catalogue
    from hybrid.config.cluster import Cluster
    from hybrid.measure.traced import traced_estimate
    from hybrid.model.sources import resolve_model
    from hybrid.config.spec import TrainSpec
    src, cl, spec = resolve_model("mixtral-8x7b"), Cluster.build(8, 8, "h100-80gb"), TrainSpec(1, 4096)
    fsdp = load_catalogue()["fsdp"]
    one, eight = (traced_estimate(src, fsdp, spec, cl, ep=ep).memory for ep in (1, 8))
    assert eight.params == pytest.approx(one.params, rel=1e-3)
    assert eight.optimizer == pytest.approx(one.optimizer, rel=1e-3)
    assert one.allocated - eight.allocated > 7 * 3 * 14336 * 4096 * 2
    with pytest.raises(HybridError, match="ep 8: expert parallelism runs under FSDP2 only, not ddp"):
        traced_estimate(src, load_catalogue()["ddp"], spec, cl, ep=8)


@pytest.mark.fakepg
def test_the_expert_parallel_block_keeps_no_more_for_backward_than_one_process():
    """What a Mixtral MoE block keeps alive after forward (MemoryTracker, real CPU tensors): under
    ep 2 on a fake process group (even routing, the rows of all experts on this rank, as one
    process has them) no more than transformers' own experts in one process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybrid.runtime.backends.ep import apply_expert_parallel
    from hybrid.measure.tracker import MemoryTracker
    from hybrid.layout.dims import ParallelDims
    model = tiny_mixtral()
    block = model.model.layers[0].mlp
    x = torch.randn(1, 256, 32, requires_grad=True)

    def kept():
        tracker = MemoryTracker()
        with tracker:
            y = block(x)
        return tracker.current - y.untyped_storage().nbytes()
    one = kept()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        apply_expert_parallel(model, ParallelDims(dp_shard=2, ep=2).build_mesh("cpu"))
        ep = kept()
    finally:
        dist.destroy_process_group()
    assert 0 < ep <= one, (ep, one)


@pytest.mark.fakepg
def test_analytic_ep2_estimate_agrees_with_the_trace():
    """OLMoE-1B-7B, fsdp on 8 x 8 H100, full checkpointing, ep 2: the analytic peak within 3% of
    the trace. The experts are an FSDP unit of their own inside the block's: FSDP2 gathers,
    prefetches and reduce-scatters the two one after the other (estimation/memory/moe.py
    alternating_units), not both at once as two dense-model placements summed would count
    (+11% before); the root's pre-backward prefetches the last block's dense unit, not its
    experts; and ep.py's experts make their weight gradients once (unbind), not a zero-filled
    whole stack per expert (select_backward)."""
    from hybrid.families.catalogue import load_catalogue
    from hybrid.config.cluster import Cluster
    from hybrid.layout.layout import Layout
    from hybrid.estimation.memory.analytic import estimate
    from hybrid.measure.traced import traced_estimate
    from hybrid.model.sources import resolve_model
    from hybrid.config.spec import TrainSpec
    src, cl = resolve_model("olmoe-1b-7b"), Cluster.build(8, 8, "h100-80gb")
    spec, fsdp = TrainSpec(1, 4096, activation_checkpointing="full"), load_catalogue()["fsdp"]
    analytic = estimate(Layout.of(fsdp, cl, spec, ep=2), src.profile, spec, cl).tensors
    traced = traced_estimate(src, fsdp, spec, cl, ep=2).memory.tensors
    assert analytic == pytest.approx(traced, rel=0.03)


@pytest.mark.fakepg
def test_analytic_estimate_counts_the_end_of_the_backward():
    """Mixtral-8x7B, fsdp on 8 x 8 H100, full checkpointing, ep 8: the peak is the end of the
    backward (the first block differentiated, every other block's fp32 gradient shard made,
    one block input left), which the analytic moment of the last block alone missed (5.4% low
    before); within 3% of the trace."""
    from hybrid.families.catalogue import load_catalogue
    from hybrid.config.cluster import Cluster
    from hybrid.layout.layout import Layout
    from hybrid.estimation.memory.analytic import estimate
    from hybrid.measure.traced import traced_estimate
    from hybrid.model.sources import resolve_model
    from hybrid.config.spec import TrainSpec
    src, cl = resolve_model("mixtral-8x7b"), Cluster.build(8, 8, "h100-80gb")
    spec, fsdp = TrainSpec(1, 4096, activation_checkpointing="full"), load_catalogue()["fsdp"]
    analytic = estimate(Layout.of(fsdp, cl, spec, ep=8), src.profile, spec, cl)
    traced = traced_estimate(src, fsdp, spec, cl, ep=8).memory
    assert analytic.phase == traced.phase == "blocks"
    assert analytic.tensors == pytest.approx(traced.tensors, rel=0.03)


# --- transformers MoE modules the runtime recognises by their experts' interface ---------------
def tiny_qwen2_moe(seed=0):
    """A 2-block transformers Qwen2-MoE: 4 routed experts, top 2, a gated shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    torch.manual_seed(seed)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=512, hidden_size=32, intermediate_size=48, moe_intermediate_size=48,
        shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64))


def tiny_deepseek_v3(seed=0):
    """A 2-block transformers DeepSeek-V3: MLA (q/kv low rank, rope and nope head dims), a dense
    first layer, then 4 routed experts (top 2, grouped routing with its correction bias) and a
    shared expert."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=512, hidden_size=32, intermediate_size=48, moe_intermediate_size=48, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64))


HF_MOE = {"qwen2_moe": tiny_qwen2_moe, "deepseek_v3": tiny_deepseek_v3}


def applied_ep2(names):
    """On the ranks: fsdp with ep 2 applied by the runtime (parallelize, the engine; the planner's
    profile of these models is the anatomy's), 3 steps of the loop with accumulation, clipping and
    a scheduler. Returns each model's full state."""
    import torch.distributed as dist

    from hybrid.config.spec import TrainSpec
    from hybrid.families.catalogue import load_catalogue
    from hybrid.layout.dims import ParallelDims
    from hybrid.layout.layout import Layout
    from hybrid.runtime.backends.base import LoopOptions
    from hybrid.runtime.mesh import build_mesh, init_distributed
    from hybrid.runtime.parallelize import apply_layout
    from hybrid.runtime.backends.ep import expert_modules
    from tests.runtime.test_loop import CLIP, GA, MB, SEQ, adamw, global_batches, micro, warmup
    runtime = init_distributed()
    layout = Layout(ParallelDims(dp_shard=2, ep=2), load_catalogue()["fsdp"])
    spec = TrainSpec(MB, SEQ, precision="fp32", gradient_accumulation=GA)
    out = {}
    for name in names:
        mesh = build_mesh(layout.dims, runtime, 2)
        engine = apply_layout(HF_MOE[name](), layout, adamw, mesh, spec, runtime, LoopOptions(GA, CLIP))
        split = sorted({str(m.gate_up_proj.placements) for m in expert_modules(engine.model)})
        sched = warmup(engine.user_optimizer)
        for ids in global_batches(2):
            for k in range(GA):
                local = micro(ids, 2, dist.get_rank(), k)
                engine.backward(engine.forward(local, labels=local).loss, GA, sync=k == GA - 1)
            engine.step(True, CLIP)
            sched.step()
            engine.zero_grad()
        out[name] = {"state": engine.full_state_dict(), "split": split}
    return out


@pytest.mark.gloo
def test_ep2_runs_transformers_qwen2_moe_and_deepseek_v3_like_one_process():
    """Their experts have the stacked interface (gate_up_proj, down_proj, num_experts), so ep 2
    splits them (two experts per rank) and the two ranks train as one process (fp32, 3 steps)."""
    from hybrid.runtime.launch import run_ranks
    from tests.runtime.test_loop import reference
    results = run_ranks(2, applied_ep2, list(HF_MOE))
    for name, build in HF_MOE.items():
        ref = reference(2, model_fn=build)[0]
        for r in results:
            assert all("Shard(dim=0)" in s for s in r[name]["split"]) and r[name]["split"], r[name]["split"]
            diff = max((r[name]["state"][k] - ref[k]).abs().max().item() for k in ref)
            assert diff < 1e-5, (name, diff)
