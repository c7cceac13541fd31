"""Where a model comes from: a preset, a config.json (or its folder), a `package.module:factory`, or a
bare parameter count, resolved to a ModelSource (its profile, and how to build it)."""
from __future__ import annotations

import copy
import dataclasses
import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

from ..config.files import JSON_LIMITS, load_json, read_text
from ..errors import HybridError, short
from .presets import PRESETS, SHAPE_RANGES, DecoderConfig, from_hf_config
from .published import PUBLISHED
from .profile import ModelProfile, build_profile, profile_decoder, profile_module, profile_params


@dataclass(frozen=True)
class ModelSource:
    """A resolved MODEL argument: its profile and, when it can be built, how."""

    profile: ModelProfile
    build: Callable[..., Any] | None = None
    """build(device='meta', attention='sdpa', prefer_hf=False, dtype=None) -> (module, implementation)."""
    ref: str | None = None
    """The MODEL string it was resolved from (to resolve it again in another process)."""
    decoder_cfg: DecoderConfig | None = None
    """The decoder shape `build` builds from, when it builds from one (presets, decoder config.json):
    then the same model with fewer blocks can be built (`with_layers`)."""

    def with_layers(self, layers: int) -> "ModelSource":
        """The same model with `layers` blocks (everything else identical)."""
        cfg = self.decoder_cfg.sliced(0, layers)
        return ModelSource(profile_decoder(cfg, f"{self.profile.name} ({layers} blocks)", self.profile.source),
                           _decoder_builder(cfg), None, cfg)


def resolve_model(spec: str | None = None, params: str | int | None = None) -> ModelSource:
    """MODEL as the CLI takes it: a preset name, a HF config.json (or a folder holding one),
    `package.module:factory`, or `params=7.5e9` for a bare count."""
    if params is not None:
        return ModelSource(profile_params(params, name=spec))
    if not spec:
        raise HybridError("no model given: name a preset, a config.json, package.module:factory, "
                          f"or pass --params. Presets: {', '.join(preset_names())}")
    if spec.lower() in PRESETS:
        cfg = PRESETS[spec.lower()]
        return ModelSource(profile_decoder(cfg, spec.lower()), _decoder_builder(cfg), spec, cfg)
    if spec.lower() in PUBLISHED:
        return _from_hf_dict(dict(PUBLISHED[spec.lower()]), spec.lower(), spec, source="preset")
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if path.endswith(".json"):
        return _from_config_json(path)
    if ":" in spec:
        return _from_factory(spec)
    raise HybridError(f"unknown model {spec!r}. Give a preset "
                      f"({', '.join(preset_names())}), a HF config.json path, package.module:factory, or --params N")


def preset_names() -> list[str]:
    """Every preset: the closed-form shapes and the published config.json files."""
    return [*PRESETS, *PUBLISHED]


def _decoder_builder(cfg: DecoderConfig):
    def build(device="meta", attention="sdpa", prefer_hf=False, dtype=None):
        if (prefer_hf or cfg.moe or cfg.qk_norm or cfg.head_size or cfg.stack) and cfg.hf_model_type:
            try:
                from .decoder import build_hf
                return build_hf(cfg, device=device, attention=attention, dtype=dtype), "transformers"
            except ImportError:
                if cfg.moe or cfg.qk_norm or cfg.head_size or cfg.stack:
                    raise HybridError(f"{cfg.hf_model_type} models are built with transformers: "
                                      "pip install 'hybrid[hf]'") from None
        from .decoder import build_decoder
        return build_decoder(cfg, device=device, attention=attention, dtype=dtype), "hybrid"
    return build


_HF_POSITIVE = {"llama": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size"),
                 "mistral": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                             "intermediate_size"),
                 "gpt2": (),
                 "mixtral": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                             "intermediate_size", "num_local_experts", "num_experts_per_tok"),
                 "olmoe": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "num_experts", "num_experts_per_tok"),
                 "qwen3_moe": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "moe_intermediate_size", "num_experts", "num_experts_per_tok")}


_HF_FIELDS = {"vocab_size": "vocab", "hidden_size": "hidden", "n_embd": "hidden", "num_hidden_layers": "layers",
              "n_layer": "layers", "num_attention_heads": "heads", "n_head": "heads", "num_key_value_heads": "kv_heads",
              "intermediate_size": "ffn", "n_inner": "ffn", "moe_intermediate_size": "moe_ffn",
              "max_position_embeddings": "max_positions", "n_positions": "max_positions", "head_dim": "head_size",
              "sliding_window": "sliding_window", "num_local_experts": "experts", "num_experts": "experts",
              "num_experts_per_tok": "top_k"}
"""config.json keys -> the DecoderConfig field whose range (presets.SHAPE_RANGES) they are held to."""


def _check_hf_config(cfg, path: str) -> None:
    """The keys our closed forms read, present and positive integers (one line per problem)."""
    if not isinstance(cfg, dict):
        raise HybridError(f"model config {path!r} must be a JSON object (a transformers config.json), "
                          f"got a JSON {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise HybridError(f"model config {path!r} has no \"model_type\"; a transformers config.json names its "
                          "architecture there (e.g. \"llama\")")
    keys = list(_HF_POSITIVE.get(mt, ())) + [k for k in ("n_embd", "n_layer", "n_head", "n_positions",
                                                         "num_key_value_heads", "max_position_embeddings")
                                             if k in cfg and cfg[k] is not None]
    for key in keys:
        v = cfg.get(key)
        if v is None:
            raise HybridError(f"model config {path!r} ({mt}) is missing {key!r}")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise HybridError(f"model config {path!r}: {key} must be a positive integer, got {v!r}")
    for key, field in _HF_FIELDS.items():              # before anything is counted or built from them
        v = cfg.get(key)
        lo, hi = SHAPE_RANGES[field]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
            raise HybridError(f"model config {path!r}: {key} must be an integer in [{lo}, {hi}], got {short(v)}; "
                              "published models stay far inside it: check the file")
    if mt == "gpt2":                                      # our defaults fill absent keys, never a null
        for key in ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"):
            if key in cfg and cfg[key] is None:
                raise HybridError(f"model config {path!r}: {key} is null; give a positive integer or leave it out")
    rope = cfg.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise HybridError(f"model config {path!r}: rope_parameters must be a JSON object, got {short(rope)}")
    for where, theta in (("rope_theta", cfg.get("rope_theta")), ("rope_parameters.rope_theta",
                                                                 (rope or {}).get("rope_theta"))):
        if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float))
                                  or not 0 < theta < 1e300):
            raise HybridError(f"model config {path!r}: {where} must be a positive number, got {short(theta)}")
    heads = cfg.get("num_attention_heads") or cfg.get("n_head")
    hidden = cfg.get("hidden_size") or cfg.get("n_embd")
    if heads and hidden and hidden % heads:
        raise HybridError(f"model config {path!r}: hidden size {hidden} is not divisible by {heads} attention heads")


def _from_config_json(path: str) -> ModelSource:
    text = read_text(path, "model config", JSON_LIMITS["bytes"], "a transformers config.json is a few KB")
    try:
        cfg = load_json(text)
    except ValueError as e:                       # json.JSONDecodeError, and past JSON_LIMITS
        raise HybridError(f"model config {path!r} is not valid JSON: {str(e)[:200]}") from None
    _check_hf_config(cfg, path)
    name = cfg.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    return _from_hf_dict(cfg, name, path, source="hf-config")


def _from_hf_dict(cfg: dict, name: str, ref: str, source: str) -> ModelSource:
    """A transformers config dict: the closed form of the architectures we know it by, else the
    model built on the meta device and its anatomy read from the module. A multimodal config (a
    `text_config` beside a vision one) builds the whole model, whose parameters all count, and is
    planned on its text decoder."""
    dec = from_hf_config(cfg)
    if dec is not None:
        return ModelSource(profile_decoder(dec, name, source=source), _decoder_builder(dec), ref, dec)
    multimodal = isinstance(cfg.get("text_config"), dict)

    def build(device="meta", attention="sdpa", prefer_hf=True, dtype=None):
        import torch

        from .decoder import default_dtype, published_rope
        try:
            from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
        except ImportError:
            raise HybridError(f"model_type {cfg.get('model_type')!r} in {ref} needs transformers: "
                              "pip install 'hybrid[hf]'") from None
        c = copy.deepcopy(cfg)          # transformers fills nested dicts (rope) in place: never the caller's
        auto = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
        with published_rope():
            config = AutoConfig.for_model(c.pop("model_type"), **c)
        with torch.device(device), default_dtype(dtype), published_rope():
            try:
                return auto.from_config(config, attn_implementation=attention), "transformers"
            except ValueError as e:
                # a model with no SDPA path (gpt-oss: its sinks need the eager softmax) runs eager;
                # the estimate prices those layers' attention eager (anatomy Attention.sinks)
                if attention != "sdpa" or "attention implementation" not in str(e):
                    raise
                return auto.from_config(config, attn_implementation="eager"), "transformers"

    try:
        model, _ = build()
    except HybridError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers rejects the config: say so in one line
        raise HybridError(f"cannot build a causal language model from {ref!r} (model_type "
                          f"{cfg.get('model_type')!r}): {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''}. "
                          "config.json must describe a transformers causal LM; for other models give "
                          "package.module:factory") from None
    profile = dataclasses.replace(profile_module(model, name), source=source)
    dec = profile.decoder
    return ModelSource(profile, build, ref, None if multimodal or dec is None else dec)


def _from_factory(spec: str) -> ModelSource:
    import inspect

    mod_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - ImportError, AttributeError, the module's own error
        raise HybridError(f"cannot load model factory {short(spec)}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
    if not (inspect.isfunction(fn) or inspect.isclass(fn)):
        raise HybridError(f"model factory {spec!r} is a {type(fn).__name__}, not a Python function or class "
                          "that returns an nn.Module")
    try:
        inspect.signature(fn).bind()
    except TypeError:
        raise HybridError(f"model factory {spec!r} needs arguments; it must be callable with none "
                          "(write a small wrapper function that fixes them)") from None
    except ValueError:
        pass

    def build(device="meta", attention="sdpa", prefer_hf=False, dtype=None):
        import torch

        from .decoder import default_dtype
        with torch.device(device), default_dtype(dtype):
            try:
                model = fn()
            except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's code failed: one line, the cause
                # (SystemExit too: a factory calling sys.exit(0) must not end `hybrid plan` silently with rc 0)
                raise HybridError(f"model factory {spec!r} raised {type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
        if not isinstance(model, torch.nn.Module):
            raise HybridError(f"model factory {spec!r} returned a {type(model).__name__}, not an nn.Module")
        return model, "factory"

    model, _ = build()
    return ModelSource(build_profile(model, spec), build, spec)
