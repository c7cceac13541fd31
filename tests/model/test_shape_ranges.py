"""Every number a model config.json gives is held to its range (presets.SHAPE_RANGES) before any
count or build scales with it: one line naming the key, the value and the range, at once."""
import json
import time

import pytest

from hybrid.cli.main import main
from hybrid.errors import HybridError
from hybrid.model.presets import SHAPE_RANGES, DecoderConfig

pytestmark = pytest.mark.unit

LLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
         "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 4096}
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}


@pytest.mark.parametrize("base,key,value", [
    (LLAMA, "vocab_size", 2 ** 100),
    (LLAMA, "num_hidden_layers", 10 ** 12),
    (LLAMA, "hidden_size", 2 ** 40),
    (LLAMA, "num_attention_heads", 2 ** 30),
    (LLAMA, "intermediate_size", 2 ** 80),
    (LLAMA, "max_position_embeddings", 10 ** 40),
    (LLAMA, "num_key_value_heads", 10 ** 9),
    (LLAMA, "head_dim", 10 ** 9),
    (MIXTRAL, "num_local_experts", 10 ** 7),
    (MIXTRAL, "num_experts_per_tok", 10 ** 7),
    (LLAMA, "num_hidden_layers", 1e12),
    ({"model_type": "gpt2"}, "n_layer", 10 ** 12),
    ({"model_type": "bert"}, "num_hidden_layers", 10 ** 12),     # built with transformers: refused first
], ids=lambda v: str(v)[:24] if not isinstance(v, dict) else v["model_type"])
def test_an_out_of_range_config_json_number_is_one_line_at_once(tmp_path, capsys, base, key, value):
    (tmp_path / "config.json").write_text(json.dumps({**base, key: value}))
    start = time.monotonic()
    rc = main(["plan", str(tmp_path), "--json"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    lo, hi = SHAPE_RANGES[{"vocab_size": "vocab", "num_hidden_layers": "layers", "n_layer": "layers",
                           "hidden_size": "hidden", "num_attention_heads": "heads", "intermediate_size": "ffn",
                           "max_position_embeddings": "max_positions", "num_key_value_heads": "kv_heads",
                           "head_dim": "head_size", "num_local_experts": "experts",
                           "num_experts_per_tok": "top_k"}[key]]
    assert f"{key} must be" in err and (f"[{lo}, {hi}]" in err or "positive integer" in err), err
    assert time.monotonic() - start < 2


def test_the_largest_shapes_in_range_still_count_at_once():
    start = time.monotonic()
    cfg = DecoderConfig("llama", SHAPE_RANGES["vocab"][1], SHAPE_RANGES["hidden"][1], SHAPE_RANGES["layers"][1],
                        SHAPE_RANGES["heads"][1], SHAPE_RANGES["ffn"][1], SHAPE_RANGES["max_positions"][1],
                        experts=SHAPE_RANGES["experts"][1], top_k=2, moe_ffn=SHAPE_RANGES["moe_ffn"][1])
    assert cfg.params > 0 and cfg.factored_state > 0 and len(cfg.matrices()) > 0
    assert time.monotonic() - start < 2


@pytest.mark.parametrize("field,value,match", [
    ("layers", 10 ** 12, r"decoder layers must be an integer in \[1, 16384\], got 1000000000000"),
    ("vocab", 2.5, r"decoder vocab must be an integer"),
    ("layers", 0, "decoder layers must be positive, got 0"),
    ("norm_eps", float("nan"), "norm_eps must be a positive finite number"),
])
def test_a_decoder_shape_out_of_range_is_refused(field, value, match):
    args = {"style": "llama", "vocab": 512, "hidden": 64, "layers": 2, "heads": 4, "ffn": 176, "max_positions": 256}
    with pytest.raises(HybridError, match=match):
        DecoderConfig(**{**args, field: value})



@pytest.mark.parametrize("base,key,value,match", [
    (LLAMA, "rope_theta", "x", "rope_theta must be a positive number, got 'x'"),
    (LLAMA, "rope_parameters", 5, "rope_parameters must be a JSON object, got 5"),
    (LLAMA, "rope_parameters", {"rope_theta": "fast"}, "rope_parameters.rope_theta must be a positive number"),
    (LLAMA, "rms_norm_eps", float("nan"), "norm_eps must be a positive finite number"),
    ({"model_type": "gpt2"}, "n_embd", None, "n_embd is null"),
    ({"model_type": "gpt2"}, "n_head", None, "n_head is null"),
])
def test_a_config_json_value_of_the_wrong_type_is_one_line(tmp_path, base, key, value, match):
    from hybrid.model.sources import resolve_model
    (tmp_path / "config.json").write_text(json.dumps({**base, key: value}))
    with pytest.raises(HybridError, match=match) as e:
        resolve_model(str(tmp_path))
    assert "\n" not in str(e.value)
