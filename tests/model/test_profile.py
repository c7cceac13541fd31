"""Profiles of built modules: the closed form against the walked module, tied weights once, block
discovery, dtypes, HF configs transformers builds, factories (torch; the torch-free profiles are in
tests/model/test_presets.py)."""
import json

import pytest
import torch
import torch.nn as nn

from hybrid.errors import HybridError
from hybrid.model.decoder import build_decoder, build_hf
from hybrid.model.presets import get_preset
from hybrid.model.profile import profile_decoder, profile_module
from hybrid.model.sources import resolve_model
from tests.model.test_presets import PUBLISHED

pytestmark = pytest.mark.torch



@pytest.mark.parametrize("name", ["gpt2", "llama2-7b", "mistral-7b", "llama3.2-1b"])
def test_closed_form_equals_meta_module(name):
    """The no-torch profile used by `hybrid plan` is what walking the built module gives."""
    closed = profile_decoder(get_preset(name), name)
    walked = profile_module(build_decoder(name, device="meta"), name)
    for field in ("params", "block_params", "root_params", "num_blocks", "largest_param",
                  "largest_layer_params", "factored_state", "optim_shapes", "tied_groups", "buffer_bytes"):
        assert getattr(closed, field) == getattr(walked, field), field


def test_hf_models_profile_like_presets():
    for name in ("gpt2", "mistral-7b"):
        hf = profile_module(build_hf(get_preset(name)))
        assert hf.params == PUBLISHED[name]
        assert hf.block_class in ("GPT2Block", "MistralDecoderLayer")  # from _no_split_modules
        assert hf.num_blocks == get_preset(name).layers
        assert hf.decoder == get_preset(name)  # dimensions read back from the HF config


def test_tied_weights_counted_once():
    p = profile_module(build_decoder("tiny-gpt", device="meta"))
    assert p.tied_groups == (("embed.weight", "lm_head.weight"),)
    with_dupes = sum(t.numel() for _, t in build_decoder("tiny-gpt", device="meta")
                     .named_parameters(remove_duplicate=False))
    assert p.params == with_dupes - 512 * 64


def test_plain_module_blocks_and_dtypes():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3))
            self.out = nn.Linear(16, 2).to(torch.bfloat16)
            self.register_buffer("scale", torch.ones(5))

        def forward(self, x):
            return x

    p = profile_module(Net())
    assert p.block_class == "Sequential" and p.num_blocks == 3 and p.block_params == 16 * 16 + 16
    assert p.root_params == 8 * 16 + 16 + 16 * 2 + 2
    assert dict(p.dtype_bytes) == {"float32": 4 * (144 + 3 * 272), "bfloat16": 2 * 34}
    assert p.buffer_bytes == 20 and p.decoder is None


def test_frozen_and_empty_models():
    m = nn.Linear(4, 4)
    m.weight.requires_grad_(False)
    p = profile_module(m)
    assert (p.params, p.trainable_params) == (20, 4)
    with pytest.raises(HybridError, match="has no parameters"):
        profile_module(nn.ReLU())


def test_hf_config_of_unknown_closed_form_uses_transformers(tmp_path):
    cfg = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 256, "tie_word_embeddings": True}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    p = resolve_model(str(path)).profile
    model = build_hf_from(cfg)
    assert p.params == sum(t.numel() for t in model.parameters())
    assert p.block_class == "Qwen2DecoderLayer" and p.num_blocks == 2


def build_hf_from(cfg):
    from transformers import AutoConfig, AutoModelForCausalLM
    c = dict(cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(c.pop("model_type"), **c))


def test_factory_spec():
    f = resolve_model("tests.factories:small_mlp").profile
    assert f.params == 10 * 20 + 20 + 20 * 2 + 2


def test_a_missing_factory_is_one_line():
    with pytest.raises(HybridError, match="cannot load model factory"):
        resolve_model("tests.factories:missing")


TINY_LLAMA4 = {"model_type": "llama4_text", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
               "intermediate_size_mlp": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 1,
               "interleave_moe_layer_step": 2, "attention_chunk_size": 32, "max_position_embeddings": 65536,
               "rope_theta": 500000.0, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1,
               "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}}
"""A tiny Llama 4 text decoder with the released rope block (meta-llama/Llama-4-Scout-17B-16E's
config.json: low_freq_factor == high_freq_factor == 1.0)."""


def _rope_warnings(build) -> list[str]:
    """transformers' rope-validation warnings while `build()` runs (its loggers do not propagate)."""
    import logging
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        build()
    finally:
        logger.removeHandler(handler)
    return [m for m in seen if "rope_parameters" in m]


def test_llama4_builds_without_the_rope_warning_and_leaves_the_config_it_was_given(tmp_path):
    """transformers 5 warned `high_freq_factor field must be greater than low_freq_factor` on every
    config hybrid built from Llama 4's released rope block (each `hybrid plan llama4-scout`, each tiny
    Llama 4 from a config.json), and filled the preset's dict in place. The block computes as released
    (finite frequencies); a block with high below low still warns."""
    import copy

    pytest.importorskip("transformers")
    from hybrid.model.sources import _from_hf_dict
    given = copy.deepcopy(TINY_LLAMA4)          # as resolve_model passes a preset's dict (PUBLISHED)
    built = []
    assert _rope_warnings(lambda: built.append(_from_hf_dict(given, "tiny-llama4", "tiny", "preset"))) == []
    assert given == TINY_LLAMA4
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA4))
    assert _rope_warnings(lambda: built.append(resolve_model(str(path)).build(device="cpu")[0])) == []
    inv_freq = built[1].model.rotary_emb.inv_freq
    assert torch.isfinite(inv_freq).all() and inv_freq.min() < inv_freq.max() / 16
    inverted = copy.deepcopy(TINY_LLAMA4)
    inverted["rope_scaling"]["high_freq_factor"] = 0.5
    path.write_text(json.dumps(inverted))
    assert any("high_freq_factor field must be greater" in m
               for m in _rope_warnings(lambda: resolve_model(str(path))))
