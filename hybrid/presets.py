"""Decoder-only transformer shapes: the published architectures and their closed-form counts.

Pure Python (no torch) so that `hybrid plan llama2-7b` answers without importing torch. The counts
here are checked in tests against the same model built for real on the meta device.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from .errors import HybridError, unknown_name

Style = Literal["llama", "gpt2"]


@dataclass(frozen=True)
class DecoderConfig:
    """Shape of a decoder-only transformer. `llama` style: RMSNorm, rotary positions, SwiGLU MLP,
    no biases, optional grouped-query attention. `gpt2` style: LayerNorm, learned positions, GELU
    MLP, biases everywhere, tied embeddings."""

    style: Style
    vocab: int
    hidden: int
    layers: int
    heads: int
    ffn: int
    max_positions: int
    kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means as many as `heads` (MHA)."""
    tied: bool = False
    """Whether the LM head shares the token-embedding matrix."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    hf_model_type: str | None = None
    """The transformers `model_type` of this architecture (llama, mistral, gpt2) when it has one."""
    gelu: str = "new"
    """gpt2 style: 'new' is GPT-2's GELU written out (transformers' gelu_new, five f-wide tensors
    kept), 'tanh' the fused kernel (gelu_pytorch_tanh, two kept); the same function."""
    sliding_window: int | None = None
    """Attention window (Mistral-7B-v0.1: 4096); None = full causal attention. From a sequence as
    long as the window, attention needs an explicit mask (no mask-free flash path)."""

    def __post_init__(self):
        for attr in ("vocab", "hidden", "layers", "heads", "ffn", "max_positions"):
            if getattr(self, attr) < 1:
                raise HybridError(f"decoder {attr} must be positive, got {getattr(self, attr)}")
        if self.gelu not in ("new", "tanh"):
            raise HybridError(f"gelu must be 'new' or 'tanh', got {self.gelu!r}")
        if self.hidden % self.heads:
            raise HybridError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.n_kv_heads:
            raise HybridError(f"heads {self.heads} is not divisible by kv_heads {self.n_kv_heads}")

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    # --- closed-form parameter accounting (each matrix listed once, tied weights once) --------
    def block_matrices(self) -> list[tuple[int, ...]]:
        """Shapes of one block's parameters, in (out, in) / (n,) form."""
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        if self.style == "llama":
            return [(h,), (h, h), (kv, h), (kv, h), (h, h), (h,), (f, h), (f, h), (h, f)]
        # norm1, fused qkv (GPT-2's c_attn), output, norm2, fc, proj - weights and biases
        return [(h,), (h,), (h + 2 * kv, h), (h + 2 * kv,), (h, h), (h,),
                (h,), (h,), (f, h), (f,), (h, f), (h,)]

    def root_matrices(self) -> list[tuple[int, ...]]:
        """Parameters outside the blocks: embeddings, final norm, LM head (if untied)."""
        v, h = self.vocab, self.hidden
        if self.style == "llama":
            return [(v, h), (h,)] + ([] if self.tied else [(v, h)])
        return [(v, h), (self.max_positions, h), (h,), (h,)]

    @property
    def block_params(self) -> int:
        return sum(_numel(s) for s in self.block_matrices())

    @property
    def root_params(self) -> int:
        return sum(_numel(s) for s in self.root_matrices())

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.root_params

    @property
    def largest_param(self) -> int:
        return max(_numel(s) for s in self.block_matrices() + self.root_matrices())

    @property
    def factored_state(self) -> int:
        """Adafactor-like state elements: rows + cols per matrix, the full size of vectors."""
        fact = lambda s: s[0] + s[1] if len(s) == 2 else s[0]  # noqa: E731
        return (self.layers * sum(fact(s) for s in self.block_matrices())
                + sum(fact(s) for s in self.root_matrices()))

    def hf_config(self) -> dict:
        """The transformers config dict of this shape (for AutoConfig.for_model)."""
        if self.style == "gpt2":
            return {"model_type": "gpt2", "vocab_size": self.vocab, "n_embd": self.hidden,
                    "n_layer": self.layers, "n_head": self.heads, "n_positions": self.max_positions,
                    "n_inner": self.ffn, "tie_word_embeddings": True, "layer_norm_epsilon": self.norm_eps,
                    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                    "activation_function": "gelu_new" if self.gelu == "new" else "gelu_pytorch_tanh"}
        return {"model_type": self.hf_model_type or "llama", "vocab_size": self.vocab,
                "hidden_size": self.hidden, "intermediate_size": self.ffn,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.n_kv_heads, "max_position_embeddings": self.max_positions,
                "tie_word_embeddings": self.tied, "rms_norm_eps": self.norm_eps,
                "rope_theta": self.rope_theta,
                **({"sliding_window": self.sliding_window} if self.hf_model_type == "mistral" else {})}

    def to_dict(self) -> dict:
        return asdict(self)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _llama(vocab, hidden, layers, heads, ffn, max_pos, kv=None, tied=False, theta=10000.0,
           model_type="llama", window=None) -> DecoderConfig:
    return DecoderConfig("llama", vocab, hidden, layers, heads, ffn, max_pos, kv_heads=kv, tied=tied,
                         rope_theta=theta, hf_model_type=model_type, sliding_window=window)


def _gpt2(hidden, layers, heads) -> DecoderConfig:
    return DecoderConfig("gpt2", 50257, hidden, layers, heads, 4 * hidden, 1024, tied=True,
                         hf_model_type="gpt2")


# Shapes from each model's published config.json (Meta Llama 2/3 model cards, Mistral-7B-v0.1,
# OpenAI GPT-2). Parameter counts are asserted in tests/test_profile.py.
PRESETS: dict[str, DecoderConfig] = {
    "gpt2": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    "llama2-7b": _llama(32000, 4096, 32, 32, 11008, 4096),
    "llama2-13b": _llama(32000, 5120, 40, 40, 13824, 4096),
    "llama2-70b": _llama(32000, 8192, 80, 64, 28672, 4096, kv=8),
    "llama3-8b": _llama(128256, 4096, 32, 32, 14336, 8192, kv=8, theta=500000.0),
    "llama3-70b": _llama(128256, 8192, 80, 64, 28672, 8192, kv=8, theta=500000.0),
    # Llama 3.1 8B/70B: Llama 3's shapes with 128K positions (max_position_embeddings 131072)
    "llama3.1-8b": _llama(128256, 4096, 32, 32, 14336, 131072, kv=8, theta=500000.0),
    "llama3.1-70b": _llama(128256, 8192, 80, 64, 28672, 131072, kv=8, theta=500000.0),
    "llama3.1-405b": _llama(128256, 16384, 126, 128, 53248, 131072, kv=8, theta=500000.0),
    "llama3.2-1b": _llama(128256, 2048, 16, 32, 8192, 131072, kv=8, tied=True, theta=500000.0),
    "llama3.2-3b": _llama(128256, 3072, 28, 24, 8192, 131072, kv=8, tied=True, theta=500000.0),
    "mistral-7b": _llama(32000, 4096, 32, 32, 14336, 32768, kv=8, model_type="mistral", window=4096),
    # Small shapes for tests, the demo and CPU benchmarks (not published models).
    "tiny-gpt": DecoderConfig("gpt2", 512, 64, 2, 4, 256, 128, tied=True, hf_model_type="gpt2"),
    "tiny-llama": _llama(512, 64, 2, 4, 176, 256, kv=2),
}


def get_preset(name: str) -> DecoderConfig:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise unknown_name("model", name, PRESETS) from None


def from_hf_config(cfg: dict) -> DecoderConfig | None:
    """Read a transformers config.json dict into our shape, or None for an architecture we do not
    know in closed form (the caller then builds it with transformers and profiles the module)."""
    mt = cfg.get("model_type")
    if mt in ("llama", "mistral") and not cfg.get("attention_bias") and not cfg.get("mlp_bias"):
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        if cfg.get("head_dim") not in (None, hidden // heads):
            return None
        return DecoderConfig("llama", cfg["vocab_size"], hidden, cfg["num_hidden_layers"], heads,
                             cfg["intermediate_size"], cfg.get("max_position_embeddings", 2048),
                             kv_heads=cfg.get("num_key_value_heads") or heads,
                             tied=bool(cfg.get("tie_word_embeddings", False)),
                             norm_eps=cfg.get("rms_norm_eps", 1e-5),
                             rope_theta=float(cfg.get("rope_theta", 10000.0)), hf_model_type=mt,
                             sliding_window=cfg.get("sliding_window") if mt == "mistral" else None)
    if mt == "gpt2":
        h = cfg.get("n_embd", 768)
        return DecoderConfig("gpt2", cfg.get("vocab_size", 50257), h, cfg.get("n_layer", 12),
                             cfg.get("n_head", 12), cfg.get("n_inner") or 4 * h,
                             cfg.get("n_positions", 1024), tied=True,
                             norm_eps=cfg.get("layer_norm_epsilon", 1e-5), hf_model_type="gpt2",
                             gelu="tanh" if cfg.get("activation_function") == "gelu_pytorch_tanh" else "new")
    return None
