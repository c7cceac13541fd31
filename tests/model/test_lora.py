"""LoRA's sizes and the quantised base's bytes against their sources: the QLoRA paper's bits per
parameter, bitsandbytes' own quantised tensors, PEFT's own adapters."""
import pytest

from hybrid.config.spec import LoRA
from hybrid.errors import HybridError
from hybrid.model.lora import adapter_params, base_quantized, int8_bytes, nf4_bytes, with_lora
from hybrid.model.presets import PRESETS
from hybrid.model.profile import profile_decoder


@pytest.mark.unit
def test_nf4_bytes_per_parameter_are_qloras_4_127_bits():
    # QLoRA (arXiv 2305.14314) sec. 3: double quantisation takes the constants from 32/64 = 0.5 bits
    # to 8/64 + 32/(64*256) = 0.127 bits per parameter, on top of the 4-bit values
    n = 64 * 256 * 4096
    bits = 8 * nf4_bytes(n) / n
    assert bits == pytest.approx(4 + 8 / 64 + 32 / (64 * 256), abs=1e-5)    # + 68 B per tensor
    assert bits == pytest.approx(4.127, abs=5e-4)
    # LLM.int8 (arXiv 2208.07339): one byte per weight and one fp32 scale per output row
    assert int8_bytes(8192, 8192) == 8192 * 8192 + 4 * 8192


@pytest.mark.unit
def test_llama3_70b_qlora_base_is_about_35_gb():
    # every block linear in nf4: 68.45B of Llama-3-70B's 70.55B weights (the rest: embeddings, head, norms)
    cfg = PRESETS["llama3-70b"]
    elems, nbytes = base_quantized(cfg, "nf4")
    assert elems == 80 * (2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192)
    assert nbytes / elems == pytest.approx(0.5 + 1 / 64 + 4 / 16384, rel=1e-5)
    p = with_lora(profile_decoder(cfg, "llama3-70b"), LoRA(16, quantize="nf4"))
    # r x (in + out) per projection: q, o 8192 + 8192; k, v 8192 + 1024; gate, up, down 8192 + 28672
    assert p.trainable_params == 80 * 16 * (2 * 16384 + 2 * 9216 + 3 * 36864) == 207_093_760
    assert p.params == cfg.params + p.trainable_params


@pytest.mark.unit
def test_lora_inputs_are_checked_in_one_line():
    with pytest.raises(HybridError, match="lora-rank must be a positive integer at most 65536"):
        LoRA(0)
    with pytest.raises(HybridError, match="unknown quantize-base 'nf3'. Available: nf4, int8"):
        LoRA(8, quantize="nf3")
    cfg = PRESETS["tiny-llama"]
    with pytest.raises(HybridError, match="unknown lora-targets qkv, wo for this llama-style decoder. Available: "
                                          "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"):
        adapter_params(cfg, LoRA(8, targets=("q_proj", "qkv", "wo")))
    with pytest.raises(HybridError, match="LoRA of a mixture-of-experts model"):
        with_lora(profile_decoder(PRESETS["mixtral-8x7b"], "mixtral"), LoRA(8))
    with pytest.raises(HybridError, match="no known decoder shape"):
        from hybrid.model.profile import profile_params
        with_lora(profile_params("7e9"), LoRA(8))


def _bnb():
    return pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is not installed: "
                               "pip install 'hybrid[lora]'")


@pytest.mark.torch
@pytest.mark.parametrize("shape", [(1024, 4096), (344, 128), (7, 33)])
def test_nf4_bytes_equal_bitsandbytes_tensors(shape):
    """bitsandbytes' quantize_4bit as QLoRA runs it (nf4, blocksize 64, compress_statistics): the
    packed values and every tensor of its quantisation state, each storage once."""
    import torch
    F = _bnb()
    w = torch.randn(*shape, dtype=torch.bfloat16)
    packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    tensors = [packed, state.absmax, state.code, state.offset, state.state2.absmax]
    real = sum(t.untyped_storage().nbytes() for t in tensors)
    shared = state.state2.code.untyped_storage().nbytes()       # the dynamic map, one for all tensors
    assert nf4_bytes(w.numel()) == real
    assert shared == 4 * 256


@pytest.mark.torch
def test_int8_bytes_equal_bitsandbytes_tensors():
    import torch
    F = _bnb()
    w = torch.randn(344, 128, dtype=torch.float16)
    cb, scb, _ = F.int8_vectorwise_quant(w)
    assert int8_bytes(*w.shape) == cb.untyped_storage().nbytes() + scb.untyped_storage().nbytes()


@pytest.mark.torch
@pytest.mark.parametrize("style", ["llama", "gpt2"])
@pytest.mark.parametrize("targets", [None, ("q_proj", "v_proj"), ("c_fc",)])
def test_adapter_params_equal_peft(style, targets):
    """PEFT's own adapters on the transformers model (default targets: every projection)."""
    peft = pytest.importorskip("peft", reason="peft is not installed: pip install 'hybrid[lora]'")
    from hybrid.model.decoder import build_hf
    from hybrid.model.presets import DecoderConfig
    if targets and (("c_fc" in targets) != (style == "gpt2")):
        pytest.skip("these names belong to the other style")
    cfg = DecoderConfig(style, 300, 64, 2, 4, 176, 128, kv_heads=2 if style == "llama" else None,
                        hf_model_type=style)
    names = targets or (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
                        if style == "llama" else ("c_attn", "c_proj", "c_fc"))
    model = peft.get_peft_model(build_hf(cfg, device="cpu"), peft.LoraConfig(
        r=4, target_modules=list(names), fan_in_fan_out=style == "gpt2"))      # GPT-2's Conv1D stores W as in x out
    real = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert adapter_params(cfg, LoRA(4, **({"targets": targets} if targets else {}))) == real
    from hybrid.model.lora import lora_of
    from hybrid.model.profile import build_profile
    assert lora_of(model).rank == 4 and set(lora_of(model).targets) == set(names)
    assert build_profile(model).trainable_params == real


@pytest.mark.unit
def test_targets_match_as_peft_matches_module_names():
    """peft's check_target_module_exists on <blocks>.<index>.<path>: the name, a suffix after a dot,
    or the full name of one block's linear (what 'all-linear' expands to)."""
    from hybrid.model.lora import matches
    assert matches("self_attn.q_proj", 0, "q_proj") and matches("self_attn.q_proj", 3, "self_attn.q_proj")
    assert matches("self_attn.q_proj", 3, "model.layers.3.self_attn.q_proj")
    assert not matches("self_attn.q_proj", 13, "model.layers.3.self_attn.q_proj")
    assert not matches("self_attn.o_proj", 0, "proj") and not matches("mlp.gate_up_proj", 0, "up_proj")


@pytest.mark.unit
def test_a_read_stack_adapts_the_linears_its_blocks_have():
    """A hand-built stack with the linears anatomy reads: adapters per block from its own shapes,
    unknown targets listed from the blocks' names, a QLoRA base from every block's linears."""
    from hybrid.model.anatomy import MLP, Attention, Layer, Linear
    from hybrid.model.lora import stack_adapted
    from hybrid.model.presets import DecoderConfig
    lin = (Linear("self_attn.qkv_proj", 64, 128, "attention"), Linear("self_attn.o_proj", 64, 64, "core"),
           Linear("mlp.gate_up_proj", 64, 192, "mlp"), Linear("mlp.down_proj", 96, 64, "product"))
    ly = Layer(Attention(4, 2, 16, fused_qkv=True), MLP("dense", 96), linears=lin)
    d = DecoderConfig("llama", 300, 64, 2, 4, 96, 128, kv_heads=2, stack=(ly, ly), hf_model_type="phi3")
    assert adapter_params(d, LoRA(8)) == 2 * 8 * (64 + 128 + 64 + 64 + 96 + 64)   # the defaults phi-3 has
    assert [len(b) for b in stack_adapted(d, LoRA(8, targets=("model.layers.1.mlp.down_proj",)))] == [0, 1]
    with pytest.raises(HybridError, match="unknown lora-targets q_proj for this phi3 decoder. Available: qkv_proj, "
                                          "o_proj, gate_up_proj, down_proj"):
        adapter_params(d, LoRA(8, targets=("q_proj", "o_proj")))
    elems, nbytes = base_quantized(d, "nf4")
    assert elems == 2 * (64 * 128 + 64 * 64 + 64 * 192 + 96 * 64)
    assert nbytes == 2 * sum(nf4_bytes(ln.in_features * ln.out_features) for ln in lin)


READ = {"qwen3": dict(head_dim=32), "gemma3_text": dict(head_dim=16, sliding_window=32,
                                                        layer_types=["sliding_attention", "full_attention"]),
        "phi3": {}, "olmo2": {}, "qwen2": {}}


def read_tiny(mt: str):
    """Tiny transformers decoders (tests/model/test_anatomy.py's sizes); Gemma 3 with both layer kinds."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.model.test_anatomy import TINY
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, **{**TINY, **READ[mt]}))


@pytest.mark.torch
@pytest.mark.parametrize("targets", ["default", "all-linear", ("o_proj", "down_proj")])
@pytest.mark.parametrize("mt", sorted(READ))
def test_adapter_params_of_transformers_decoders_equal_peft(mt, targets):
    """PEFT's get_nb_trainable_parameters on the transformers model against the plan's adapters:
    from the module's own profile (the anatomy, or Qwen3's closed form) with the same targets, and
    from the PEFT model read as it is (its LoraConfig, 'all-linear' expanded to every linear's
    full name)."""
    peft = pytest.importorskip("peft", reason="peft is not installed: pip install 'hybrid[lora]'")
    from hybrid.config.spec import LORA_TARGETS
    from hybrid.model.lora import lora_of
    from hybrid.model.profile import build_profile, profile_module
    base = profile_module(read_tiny(mt))
    assert bool(base.decoder.stack) == (mt != "qwen3")
    names = list(LORA_TARGETS) if targets == "default" else targets if isinstance(targets, str) else list(targets)
    model = peft.get_peft_model(read_tiny(mt), peft.LoraConfig(r=4, target_modules=names))
    real = model.get_nb_trainable_parameters()[0]
    lora = LoRA(4) if targets == "default" else lora_of(model)
    planned = with_lora(base, lora)
    assert planned.trainable_params == real and planned.params == base.params + real
    assert build_profile(model).trainable_params == real and lora_of(model).rank == 4
