"""Compiled blocks of decoders read from their module: the closed forms per anatomy component
(hybrid/estimation/memory/compiled.py) against AOTAutograd's min-cut partitioner on transformers'
own blocks (hybrid/measure/compiled.py block_saved, the runtime's compile with a backend that
partitions and generates no code), at the published widths on fake tensors, bf16, one sequence:
every distinct block of each family, with no checkpointing and under the per-op policy (and the
selective one for a family per rule), byte for byte (Llama 4's rotary blocks also keep the complex
conjugate of their rotary table, s x head_dim / 2 complex64 a block: 0.04% here, not counted).

The partitioner's choice is made on sizes: at toy widths (hidden 64) it keeps an MoE router's fp32
weight and the gathered top-k values that it rebuilds at the published widths, so the families
run at their own. DeepSeek-V3 runs with its value head as wide as its query/key head: CPU's SDPA
takes the math path for a narrower one, where CUDA's efficient kernel, which the estimate prices,
keeps what its flash kernel keeps here."""
import functools

import pytest

pytest.importorskip("transformers")

GRANITE = {"model_type": "granite", "vocab_size": 49155, "hidden_size": 4096, "intermediate_size": 12800,
           "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "embedding_multiplier": 12.0,
           "residual_multiplier": 0.22, "attention_multiplier": 0.0078125, "logits_scaling": 16.0}
"""ibm-granite/granite-3.1-8b-base's architecture keys: a family the anatomy was not written against."""

FAMILIES = {
    "qwen3": ("qwen3-8b", 2, 512, {}), "qwen2": ("qwen2.5-7b", 2, 512, {}), "phi3": ("phi-4", 2, 512, {}),
    "olmo2": ("olmo2-13b", 2, 512, {}), "granite": (GRANITE, 2, 512, {}),
    # five sliding layers of 1,024 tokens, then a global one: at 2,048 tokens the sliding ones mask
    "gemma3_text": ("gemma3-27b", 6, 2048, {}),
    "deepseek_v3": ("deepseek-v3", 4, 512, {"v_head_dim": 192}),         # three dense layers, then MoE
    "gpt_oss": ("gpt-oss-120b", 2, 256, {}),
    "llama4_text": ("llama4-scout", 4, 512, {}),                            # the fourth layer without rotary
    "qwen2_moe": ("qwen2-57b-a14b", 2, 512, {}), "qwen3_moe": ("qwen3-30b-a3b", 2, 512, {}),
}
"""model_type -> (its published config, or a config; layers kept; tokens; changed keys)."""
ROTARY_TABLE = {"llama4_text"}


def _config(mt: str) -> dict:
    from hybrid.model.presets import get_preset
    from hybrid.model.published import PUBLISHED
    where, layers, _, changed = FAMILIES[mt]
    if isinstance(where, dict):
        cfg = dict(where)
    else:
        cfg = dict(PUBLISHED[where]) if where in PUBLISHED else dict(get_preset(where).hf_config())
    cfg = dict(cfg.get("text_config", cfg))
    cfg.update(changed, num_hidden_layers=layers)
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:layers]
    return cfg


def _builder(mt: str):
    """A zero-argument builder of the family's model in bf16, on the current device or fake mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = _config(mt)
    kind = cfg.pop("model_type")
    attention = "eager" if mt == "gpt_oss" else "sdpa"          # sinks need eager attention

    def build():
        from hybrid.model.decoder import published_rope
        with published_rope():
            return AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **cfg), attn_implementation=attention,
                                                    dtype=torch.bfloat16)
    return build, attention


@functools.lru_cache(maxsize=None)
def _kinds(mt: str):
    """(the read decoder, {each distinct block: the index of its first instance}), read on meta."""
    import torch

    from hybrid.model.profile import read_decoder
    build, _ = _builder(mt)
    with torch.device("meta"):
        model = build()
    d = read_decoder(model, model.config)
    return d, {ly: i for i, ly in reversed(list(enumerate(d.stack)))}


SELECTIVE = ("qwen2", "phi3", "gemma3_text", "deepseek_v3", "gpt_oss", "llama4_text", "qwen2_moe")
"""Families held under selective checkpointing too: one per rule of the saved matmul outputs (addmm,
a fused qkv and gate_up, a down projection a post-norm reads, MLA and an fp32 router, eager
attention, dense dispatch, a shared expert and its gate); the per-op policy runs on every family."""


@pytest.mark.torch
@pytest.mark.parametrize("mt,mode", [(mt, mode) for mt in sorted(FAMILIES) for mode in ("none", "op")]
                         + [(mt, "selective") for mt in SELECTIVE])
def test_a_compiled_blocks_closed_form_is_what_the_partitioner_saves(mt, mode):
    from hybrid.config.spec import TrainSpec
    from hybrid.estimation.memory.compiled import layer_compiled
    from hybrid.measure.compiled import block_saved
    build, attention = _builder(mt)
    d, kinds = _kinds(mt)
    seq = FAMILIES[mt][2]
    spec = TrainSpec(1, seq, precision="bf16", attention=attention, activation_checkpointing=mode, compile=True)
    for layer, index in kinds.items():
        saved = block_saved(build, index, mode, 1, seq, fake=True)
        measured = sum(v.nbytes for v in saved if v.kind != "shared")
        tok, block = layer_compiled(layer, d.hidden, spec, 2, mode)
        if mt in ROTARY_TABLE and layer.attention.rope and mode == "none":
            measured -= seq * layer.attention.head_dim // 2 * 8
        assert tok * seq + block == measured, (mt, index, mode, [v for v in saved if v.kind != "shared"])


def _read_blocks_live(model, b: int, seq: int) -> int:
    """Bytes a transformers decoder's blocks keep after their forward (their inputs included, the
    last output not), counted at the CPU allocator: the blocks called one after another on the
    embeddings, with the model's rotary tables and no mask (causal attention, no window)."""
    import torch

    from hybrid.measure.tracker import allocator_net_bytes
    from hybrid.model.profile import find_blocks
    inner = model.model
    x = torch.randn(b, seq, model.config.hidden_size, requires_grad=True)
    positions = torch.arange(seq).unsqueeze(0)
    rope = inner.rotary_emb(x, positions)

    def forward():
        y = x
        for block in find_blocks(model)[1]:
            y = block(y, attention_mask=None, position_embeddings=rope, position_ids=positions)
        return y
    y, net = allocator_net_bytes(forward)
    return net - y.untyped_storage().nbytes() + x.untyped_storage().nbytes()


@pytest.mark.gloo            # real inductor compiles on this CPU (tens of seconds each)
@pytest.mark.slow
def test_a_read_decoders_inductor_blocks_keep_what_the_estimate_says():
    """Qwen3's blocks (q/k norms over each head; transformers' own, fp32) compiled by inductor on CPU
    as the runtime compiles them: what they keep after forward, between batch 3 and batch 1, is the
    estimate exactly, and less than eager autograd keeps. (Checkpointed per op as the backends do,
    measured once too: exact; 18 s more on 2 cores.)"""
    from hybrid.config.spec import TrainSpec
    from hybrid.estimation.memory.activations import activation_terms
    from hybrid.model.decoder import prepare_for_training
    from hybrid.model.profile import find_blocks, read_decoder
    from hybrid.runtime.compile import compile_block
    from tests.model.test_anatomy import tiny
    seq = 48
    model = tiny("qwen3")
    prepare_for_training(model)
    for block in find_blocks(model)[1]:
        compile_block(block, dynamic=False)
    for b in (1, 3):                             # compile both shapes before counting
        _read_blocks_live(model, b, seq)
    measured = _read_blocks_live(model, 3, seq) - _read_blocks_live(model, 1, seq)
    d = read_decoder(model, model.config)
    terms = activation_terms(d, TrainSpec(2, seq, precision="fp32", compile=True), autocast=False)
    assert measured == terms.per_layer * terms.layers
    eager = activation_terms(d, TrainSpec(2, seq, precision="fp32"), autocast=False)
    assert terms.per_layer < eager.per_layer
