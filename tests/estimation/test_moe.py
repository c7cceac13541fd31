"""Mixture-of-experts decoders: published total/active counts, closed forms equal to the built
transformers modules, and what the estimator does with them."""
import dataclasses

import pytest

from hybrid.model.presets import get_preset
from hybrid.model.profile import profile_decoder
from hybrid.model.sources import resolve_model


# Published counts (model cards: Mixtral-8x7B 46.7B total / 12.9B active; Qwen3-30B-A3B 30.5B /
# 3.3B; OLMoE-1B-7B 6.9B / 1.3B). Totals to the parameter: HF `num_parameters()` of the released
# checkpoints; active counts rounded as their model cards state them.
PUBLISHED = {"mixtral-8x7b": (46_702_792_704, 12.9e9), "qwen3-30b-a3b": (30_532_122_624, 3.3e9),
             "olmoe-1b-7b": (6_919_161_856, 1.3e9)}


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_moe_presets_give_published_total_and_active_counts(name):
    total, active = PUBLISHED[name]
    cfg = get_preset(name)
    assert resolve_model(name).profile.params == total
    assert abs(cfg.active_params / active - 1) < 0.03


@pytest.mark.torch              # builds the transformers module on the meta device
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_closed_form_equals_the_transformers_module(name):
    from hybrid.model.decoder import build_hf
    from hybrid.model.profile import profile_module
    cfg = dataclasses.replace(get_preset(name), layers=2)        # the block is what matters
    closed = profile_decoder(cfg, name)
    walked = profile_module(build_hf(cfg), name)
    for field in ("params", "block_params", "root_params", "num_blocks", "largest_param", "largest_layer_params",
                  "factored_state", "optim_shapes"):
        assert getattr(closed, field) == getattr(walked, field), field
    assert walked.decoder == cfg          # the shape reads back from the transformers config


def _tiny(mt, **kw):
    from hybrid.model.presets import DecoderConfig
    shape = dict(experts=8, top_k=2, moe_ffn=96)
    shape.update(kw)
    return DecoderConfig("llama", 300, 64, 1, 4, 96, 128, kv_heads=2, hf_model_type=mt,
                         qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(mt),
                         head_size=32 if mt == "qwen3_moe" else None, **shape)


@pytest.mark.torch              # real CPU tensors, one block, no process group
@pytest.mark.parametrize("regime", ["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("mt", ["mixtral", "qwen3_moe", "olmoe"])
def test_moe_block_formula_matches_autograd(mt, regime):
    """What one transformers MoE block saves for backward (saved-tensors hooks, batch 3 minus
    batch 1) is what hybrid.estimation.memory.activations counts, for two expert shapes."""
    import torch

    from hybrid.estimation.memory.activations import _layer_full
    from hybrid.model.decoder import build_hf
    from hybrid.config.spec import TrainSpec
    from tests.estimation.test_activations import REGIMES, S, saved_bytes
    dtype, autocast, precision = REGIMES[regime]
    for shape in ({}, {"experts": 16, "top_k": 4, "moe_ffn": 160}):
        cfg = _tiny(mt, **shape)
        torch.manual_seed(0)
        model = build_hf(cfg, device="cpu", dtype=dtype)
        block = model.model.layers[0]
        measured = saved_bytes(model, block, 3, dtype, autocast) - saved_bytes(model, block, 1, dtype, autocast)
        spec = TrainSpec(1, S, precision=precision)
        assert measured == pytest.approx(_layer_full(cfg, spec, spec.bytes.compute, autocast) * 2 * S, rel=0.01)


@pytest.mark.torch              # real CPU tensors, one process
@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_moe_checkpointing_policies_keep_what_the_formulas_say(mode):
    import torch

    from hybrid.runtime.activation_checkpoint import apply_activation_checkpointing
    from hybrid.estimation.memory.activations import activation_terms
    from hybrid.measure.tracker import MemoryTracker
    from hybrid.model.decoder import build_hf
    from hybrid.config.spec import TrainSpec
    from tests.estimation.test_activations import S
    cfg = dataclasses.replace(_tiny("qwen3_moe"), layers=3)
    model = build_hf(cfg, device="cpu")
    apply_activation_checkpointing(model, mode)

    def live(b):
        tracker = MemoryTracker()
        with tracker:
            x = torch.randn(b, S, cfg.hidden, requires_grad=True)
            pos = torch.arange(S)[None]
            rope = model.model.rotary_emb(x, pos)
            y = x
            for block in model.model.layers:
                y = block(y, position_embeddings=rope, attention_mask=None, position_ids=pos)
            return tracker.current - y.untyped_storage().nbytes()
    measured = live(3) - live(1)
    terms = activation_terms(cfg, TrainSpec(2, S, precision="fp32", activation_checkpointing=mode), autocast=False)
    assert measured == pytest.approx(terms.per_layer * terms.layers, rel=0.02)


@pytest.mark.fakepg
def test_mixtral_analytic_matches_the_trace_on_8x8():
    """FSDP2 over 64 ranks: the traced job (fake tensors, the real fully_shard) and the analytic
    estimate agree. Without cutting the 8-expert stacks along a dimension the group divides,
    fully_shard pads dim 0 to one expert per rank and each rank holds 8x its share."""
    from hybrid.families.catalogue import load_catalogue
    from hybrid.config.cluster import Cluster
    from hybrid.estimation.memory.analytic import estimate
    from hybrid.measure.traced import traced_estimate
    from hybrid.config.spec import TrainSpec
    src, cl = resolve_model("mixtral-8x7b"), Cluster.build(8, 8, "h100-80gb")
    spec = TrainSpec(1, 4096)
    fsdp = load_catalogue()["fsdp"]
    traced = traced_estimate(src, fsdp, spec, cl).memory
    analytic = estimate(fsdp, src.profile, spec, cl)
    assert traced.params == pytest.approx(analytic.params, rel=0.01)
    assert traced.allocated == pytest.approx(analytic.allocated, rel=0.03)


@pytest.mark.unit
def test_moe_config_json_reads_like_the_preset(tmp_path):
    import json

    from hybrid.errors import HybridError
    cfg = get_preset("qwen3-30b-a3b")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.hf_config()))
    assert resolve_model(str(path)).profile.decoder == cfg
    broken = dict(cfg.hf_config())
    del broken["num_experts_per_tok"]
    path.write_text(json.dumps(broken))
    with pytest.raises(HybridError, match="missing 'num_experts_per_tok'"):
        resolve_model(str(path))


def tiny_mixtral():
    """A 2-block transformers Mixtral (3 experts, top 2) with seeded weights, vocabulary 512."""
    import torch

    from hybrid.model.decoder import build_hf
    from hybrid.model.presets import DecoderConfig
    torch.manual_seed(0)
    cfg = DecoderConfig("llama", 512, 32, 2, 4, 48, 64, kv_heads=2, hf_model_type="mixtral", experts=3, top_k=2,
                        moe_ffn=48)
    return build_hf(cfg, device="cpu")


def _train_moe(strategies):
    from tests.runtime.test_loop import train
    return {s: train(s, model_fn=tiny_mixtral) for s in strategies}


@pytest.mark.gloo
def test_mixtral_trains_like_one_process_on_four_ranks():
    """ddp and fsdp on 4 ranks: 3 steps with accumulation, clipping and a scheduler, within
    1e-5 of one process on the same global batch (routing is per token). Under fsdp the 3-expert
    stacks are shorter than the 4-rank group, so they are cut along their width (shard_placement)."""
    from hybrid.runtime.launch import run_ranks
    from tests.runtime.test_loop import CLIP, STEPS, reference
    strategies = ("ddp", "fsdp")
    results = run_ranks(4, _train_moe, strategies)
    ref, ref_norms, _ = reference(4, model_fn=tiny_mixtral)
    assert ref_norms[0] > CLIP
    for s in strategies:
        for rank, res in enumerate(results):
            r = res[s]
            assert r["steps"] == STEPS
            diff = max((r["state"][k] - ref[k]).abs().max().item() for k in ref)
            assert diff < 1e-5, f"{s} rank {rank}: max abs diff {diff:.2e}"


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_emitted_configs_wrap_the_transformers_moe_layer(name):
    """The hand-off names the class FSDP/Accelerate wrap in the transformers model users train
    (the class transformers' own _no_split_modules names)."""
    from hybrid.model.profile import transformers_layer_class
    expected = {"mixtral-8x7b": "MixtralDecoderLayer", "qwen3-30b-a3b": "Qwen3MoeDecoderLayer",
                "olmoe-1b-7b": "OlmoeDecoderLayer"}[name]
    assert transformers_layer_class(resolve_model(name).profile) == expected


@pytest.mark.torch
def test_the_moe_layer_table_is_what_transformers_says():
    from hybrid.model.decoder import build_hf
    from hybrid.model.profile import HF_LAYERS
    for name in sorted(PUBLISHED):
        cfg = dataclasses.replace(get_preset(name), layers=1)
        assert set(build_hf(cfg)._no_split_modules) == {HF_LAYERS[cfg.hf_model_type]}


@pytest.mark.unit
def test_parallel_dims_ep_is_taken_from_the_sharded_ranks():
    from hybrid.errors import HybridError
    from hybrid.layout.dims import ParallelDims
    d = ParallelDims(dp_replicate=2, dp_shard=8, ep=4).validate(16, 8)
    assert d.world_size == 16 and d.expert_shard == 2 and d.describe() == "dp_replicate 2 x dp_shard 8 x ep 4"
    assert d.to_dict()["ep"] == 4 and "ep" not in ParallelDims(dp_shard=8).to_dict()
    assert ParallelDims(dp_shard=2, cp=2, ep=4).expert_shard == 1       # ep spans dp_shard x cp
    with pytest.raises(HybridError, match=r"ep 3 must divide dp_shard\(8\) x cp\(1\) = 8.*valid ep: 1, 2, 4, 8"):
        ParallelDims(dp_shard=8, ep=3)
