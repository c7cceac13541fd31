"""Presets of the decoders people train now, as their published config.json files.

Each entry is the architecture keys of the model's released config.json (Hugging Face Hub, the
repository named beside it; tokenizer ids and generation settings left out). Resolving one builds
the transformers model on the meta device and reads its anatomy from the module
(hybrid/model/anatomy.py), exactly as a user's config.json is read: no formula per family.
`PUBLISHED_COUNTS` holds the total and active parameters their model cards state; tests hold the
built models to them (within 1% total, 3% active).
"""
from __future__ import annotations

_YARN_DS = {"type": "yarn", "rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
_YARN_OSS = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
             "beta_slow": 1.0, "truncate": False}


def _oss(layers: int, experts: int) -> dict:
    return {"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
            "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
            "num_local_experts": experts, "num_experts_per_tok": 4, "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * (layers // 2), "swiglu_limit": 7.0,
            "rope_theta": 150000.0, "rope_scaling": _YARN_OSS, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True,
            "pad_token_id": 199999, "eos_token_id": 200002}


def _llama4(experts: int, step: int) -> dict:
    return {"model_type": "llama4", "text_config": {
        "model_type": "llama4_text", "vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": experts, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": step, "attention_chunk_size": 8192, "use_qk_norm": True,
        "max_position_embeddings": 10485760, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "rope_scaling": {"rope_type": "llama3", "factor": 16.0 if step == 1 else 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "pad_token_id": 200018, "bos_token_id": 200000, "eos_token_id": 200008}}


PUBLISHED: dict[str, dict] = {
    # Qwen/Qwen3-8B, Qwen/Qwen2.5-7B, Qwen/Qwen2.5-72B
    "qwen3-8b": {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
                 "tie_word_embeddings": False},
    "qwen2.5-7b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": False, "use_sliding_window": False},
    "qwen2.5-72b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
                    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                    "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": False, "use_sliding_window": False},
    # Qwen/Qwen2-57B-A14B (Qwen2-MoE: 64 routed experts, top 8, one shared expert with a sigmoid gate)
    "qwen2-57b-a14b": {"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 3584,
                       "intermediate_size": 18944, "moe_intermediate_size": 2560,
                       "shared_expert_intermediate_size": 20480, "num_hidden_layers": 28, "num_attention_heads": 28,
                       "num_key_value_heads": 4, "num_experts": 64, "num_experts_per_tok": 8,
                       "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                       "tie_word_embeddings": False, "norm_topk_prob": False, "decoder_sparse_step": 1},
    # microsoft/phi-4 (the phi3 architecture: fused qkv and gate_up projections)
    "phi-4": {"model_type": "phi3", "vocab_size": 100352, "hidden_size": 5120, "intermediate_size": 17920,
              "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 10,
              "max_position_embeddings": 16384, "original_max_position_embeddings": 16384, "rope_theta": 250000,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "pad_token_id": 100349, "bos_token_id": 100257,
              "eos_token_id": 100265},
    # allenai/OLMo-2-1124-13B (norms after attention and MLP, q/k norms over the whole projection)
    "olmo2-13b": {"model_type": "olmo2", "vocab_size": 100352, "hidden_size": 5120, "intermediate_size": 13824,
                  "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
                  "max_position_embeddings": 4096, "rope_theta": 500000, "rms_norm_eps": 1e-6,
                  "tie_word_embeddings": False, "pad_token_id": 100277, "bos_token_id": None,
                  "eos_token_id": 100257},
    # google/gemma-3-27b-pt's text_config (Gemma3ForCausalLM: 5 local layers of 1024 to 1 global)
    "gemma3-27b": {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 5376,
                   "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32,
                   "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024,
                   "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                   "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh"},
    # deepseek-ai/DeepSeek-V3 (MLA; 3 dense layers then 58 MoE: 256 routed experts, top 8, 1 shared)
    "deepseek-v3": {"model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
                    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
                    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
                    "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
                    "max_position_embeddings": 163840, "rope_theta": 10000, "rope_scaling": _YARN_DS,
                    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1},
    # openai/gpt-oss-120b, openai/gpt-oss-20b (sinks, sliding 128 / full pairs, 4 of 128 / 32 experts)
    "gpt-oss-120b": _oss(36, 128),
    "gpt-oss-20b": _oss(24, 32),
    # meta-llama/Llama-4-Scout-17B-16E, meta-llama/Llama-4-Maverick-17B-128E (multimodal: planned on
    # the text decoder; the vision tower's parameters are held and trained too)
    "llama4-scout": _llama4(16, 1),
    "llama4-maverick": _llama4(128, 2),
}

PUBLISHED_COUNTS: dict[str, tuple[float, float]] = {
    "deepseek-v3": (671e9, 37e9),            # DeepSeek-V3 technical report (arXiv 2412.19437), main model
    "gpt-oss-120b": (116.8e9, 5.1e9),        # gpt-oss model card (OpenAI, 2025), table 1
    "gpt-oss-20b": (20.9e9, 3.6e9),
    "llama4-scout": (109e9, 17e9),           # Llama 4 model card (Meta, 2025)
    "llama4-maverick": (400e9, 17e9),
    "qwen2-57b-a14b": (57.4e9, 14.2e9),      # Qwen2 technical report (arXiv 2407.10671), table 1
}
"""(total, active) parameters as the model cards state them."""
