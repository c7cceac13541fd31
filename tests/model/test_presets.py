"""Profiles without torch, as `hybrid plan` builds them: published parameter counts of the presets,
HF config.json paths, bare parameter counts, and the one-line errors for bad model specs."""
import json

import pytest

from hybrid.errors import HybridError
from hybrid.model.sources import resolve_model

pytestmark = pytest.mark.unit


# Published totals (model cards / HF `num_parameters()`), independent of our formulas.
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-8b": 8_030_261_248,         # Meta-Llama-3.1-8B: the same shapes, 128K positions
    "llama3.1-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "llama3.2-1b": 1_235_814_400,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_counts_match_published(name):
    assert resolve_model(name).profile.params == PUBLISHED[name]


def test_hf_config_json_path(tmp_path):
    cfg = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
           "max_position_embeddings": 4096, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for spec in (str(tmp_path), str(tmp_path / "config.json")):
        src = resolve_model(spec)
        assert src.profile.params == PUBLISHED["llama2-7b"] and src.profile.source == "hf-config"


def test_params_spec():
    p = resolve_model(None, params="7.5e9").profile
    assert p.params == 7_500_000_000 and p.decoder is None


@pytest.mark.parametrize("spec,match", [
    ("no-such-model", "unknown model 'no-such-model'"),
    ("/does/not/exist.json", "does not exist"),
])
def test_bad_model_specs(spec, match):
    with pytest.raises(HybridError, match=match):
        resolve_model(spec)
