"""Decoder-only transformer shapes: the published architectures and their closed-form counts.

Pure Python (no torch) so that `hybrid plan llama2-7b` answers without importing torch. The counts
here are checked in tests against the same model built for real on the meta device.
"""
from __future__ import annotations

import functools
import json
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Literal

from ..errors import HybridError, short, unknown_name
from .anatomy import Layer
from .tp_plan import HFPlan

Style = Literal["llama", "gpt2"]

SHAPE_RANGES: dict[str, tuple[int, int]] = {
    "vocab": (1, 1 << 24), "hidden": (1, 1 << 18), "layers": (1, 1 << 14), "heads": (1, 1 << 14),
    "kv_heads": (0, 1 << 14), "ffn": (1, 1 << 22), "max_positions": (1, 1 << 30), "head_size": (0, 1 << 16),
    "sliding_window": (0, 1 << 30), "experts": (0, 1 << 14), "top_k": (0, 1 << 14), "moe_ffn": (0, 1 << 22)}
"""Inclusive range of each shape field (from 0 where 0 means not set): 16x to 100x the largest
published model's (vocab 256K, hidden 25,600, 160 blocks, 128 heads, 256 experts, 10M positions),
so no count or list that scales with them can run long."""


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
    head_size: int | None = None
    """Per-head dimension when the config states one that is not hidden / heads (Qwen3: 128 with
    hidden 2048 and 32 heads); None = hidden // heads."""
    qk_norm: Literal["head", "full"] | None = None
    """RMSNorm on queries and keys: 'head' over each head's dimension (Qwen3), 'full' over the whole
    projection (OLMoE); None = none."""
    experts: int = 0
    """Routed experts of each MoE block (Mixtral 8, Qwen3-30B-A3B 128); 0 = a dense MLP."""
    top_k: int = 0
    """Experts each token is routed to (num_experts_per_tok)."""
    moe_ffn: int = 0
    """Intermediate size of one expert (Mixtral: intermediate_size; Qwen/OLMoE: moe_intermediate_size)."""
    stack: tuple[Layer, ...] = ()
    """The anatomy layer by layer (hybrid/model/anatomy.py) when it was read from the module: then
    the counts, FLOPs and activations are summed over these layers, and the fields above hold a
    representative layer's figures (the MoE layers' experts, the largest attention) for the rules
    that need one number. () = `layers` identical blocks described by the fields above."""
    hf_json: str | None = None
    """The transformers config (JSON) a read model is built from again."""
    head: bool = True
    """Whether this piece of the model ends in the LM head (False on pipeline ranks before the last)."""
    tp_plan: HFPlan | None = None
    """A decoder read from a transformers module: what the module says about splitting it over tp
    (its base_model_tp_plan, hybrid/model/tp_plan.py), read with the stack; None for hybrid's closed
    forms, whose style decides."""

    def __post_init__(self):
        for attr, (lo, hi) in SHAPE_RANGES.items():     # before any count that scales with them
            v = getattr(self, attr)
            if isinstance(v, int) and not isinstance(v, bool) and lo == 1 and v < 1:
                raise HybridError(f"decoder {attr} must be positive, got {v}")
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
                raise HybridError(f"decoder {attr} must be an integer in [{lo}, {hi}], got {short(v)}; "
                                  "published models stay far inside it")
        for attr in ("norm_eps", "rope_theta"):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e300:
                raise HybridError(f"decoder {attr} must be a positive finite number, got {short(v)}")
        if self.gelu not in ("new", "tanh"):
            raise HybridError(f"gelu must be 'new' or 'tanh', got {self.gelu!r}")
        if self.stack:
            if len(self.stack) != self.layers:
                raise HybridError(f"decoder has {self.layers} layers but {len(self.stack)} described")
            return
        if self.hidden % self.heads:
            raise HybridError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.n_kv_heads:
            raise HybridError(f"heads {self.heads} is not divisible by kv_heads {self.n_kv_heads}")
        if self.experts and not (self.style == "llama" and 1 <= self.top_k <= self.experts and self.moe_ffn >= 1):
            raise HybridError(f"an MoE decoder needs the llama style, 1 <= top_k <= experts and moe_ffn >= 1; got "
                              f"style {self.style}, experts {self.experts}, top_k {self.top_k}, moe_ffn {self.moe_ffn}")

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the query projection and the attention output (heads x head_dim)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def expert_params(self) -> int:
        """Parameters of one expert: gate, up and down projections (SwiGLU)."""
        moe = [ly.mlp for ly in self.stack if ly.mlp.moe]
        return moe[0].expert_params(self.hidden) if moe else 3 * self.hidden * self.moe_ffn

    @property
    def moe_layers(self) -> int:
        """Blocks whose MLP is a mixture of experts (DeepSeek-V3: 58 of 61; Llama 4 Maverick: every other)."""
        if self.stack:
            return sum(ly.mlp.moe for ly in self.stack)
        return self.layers if self.moe else 0

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: all but the experts it is not routed to (the
        published 'active' count, e.g. Mixtral-8x7B's 12.9B of 46.7B)."""
        if self.stack:
            return self.params - sum(n * ly.mlp.inactive_params(self.hidden) for ly, n in _kinds(self))
        return self.params - self.layers * (self.experts - self.top_k) * self.expert_params

    def layer_list(self) -> tuple[Layer, ...]:
        """Every block's anatomy: as read, or `layers` identical blocks of the fields' shape."""
        if self.stack:
            return self.stack
        from .anatomy import MLP, Attention
        gpt2 = self.style == "gpt2"
        window = self.sliding_window or 0
        attn = Attention(self.heads, self.n_kv_heads, self.head_dim, qkv_bias=gpt2, out_bias=gpt2,
                         qk_norm=self.qk_norm, window=window, rope=not gpt2)
        if self.moe:
            mlp = MLP("moe", experts=self.experts, top_k=self.top_k, moe_ffn=self.moe_ffn,
                      renorm=self.hf_model_type != "olmoe")
        else:
            mlp = MLP("dense", self.ffn, gated=not gpt2, act="gelu_new" if gpt2 else "silu", bias=gpt2)
        return (Layer(attn, mlp, norm="layer" if gpt2 else "rms"),) * self.layers

    def sliced(self, first: int, count: int) -> "DecoderConfig":
        """Blocks first..first+count-1 (a shorter model for a trace)."""
        return self.pick(range(first, first + count))

    def pick(self, indices, head: bool = True) -> "DecoderConfig":
        """The blocks at these indices (a pipeline rank's stages), with or without the LM head."""
        indices = list(indices)
        if not self.stack:
            return replace(self, layers=len(indices), head=head)
        return replace(self, layers=len(indices), stack=tuple(self.stack[i] for i in indices), head=head)

    @property
    def block_matmul_params(self) -> int:
        """2-D weight elements of all blocks (what autocast caches in bf16 and float8 converts;
        an MoE block's router, not its stacked experts)."""
        if self.stack:
            return sum(n * m[0] * m[1] for ly, n in _kinds(self) for m in ly.matrices(self.hidden) if len(m) == 2)
        return self.layers * sum(m[0] * m[1] for m in self.block_matrices() if len(m) == 2)

    # --- closed-form parameter accounting (each matrix listed once, tied weights once) --------
    def block_matrices(self) -> list[tuple[int, ...]]:
        """Shapes of one block's parameters, in (out, in) / (n,) form (a read stack: its largest block's)."""
        if self.stack:
            return max(set(self.stack), key=lambda ly: ly.params(self.hidden)).matrices(self.hidden)
        h, f, kv, q = self.hidden, self.ffn, self.kv_dim, self.q_dim
        if self.style == "llama":
            attn = [(h,), (q, h), (kv, h), (kv, h), (q, h)]
            attn += {"head": [(self.head_dim,), (self.head_dim,)], "full": [(q,), (kv,)], None: []}[self.qk_norm]
            if self.moe:       # router (experts x hidden), then each expert's gate/up and down, stacked
                e, m = self.experts, self.moe_ffn
                return attn + [(h,), (e, h), (e, 2 * m, h), (e, h, m)]
            return attn + [(h,), (f, h), (f, h), (h, f)]
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
        """Parameters of the largest block."""
        if self.stack:
            return max(ly.params(self.hidden) for ly in set(self.stack))
        return sum(_numel(s) for s in self.block_matrices())

    @property
    def root_params(self) -> int:
        return sum(_numel(s) for s in self.root_matrices())

    @property
    def params(self) -> int:
        if self.stack:
            return sum(n * ly.params(self.hidden) for ly, n in _kinds(self)) + self.root_params
        return self.layers * self.block_params + self.root_params

    @property
    def largest_param(self) -> int:
        if self.stack:
            return max(_numel(s) for ly in set(self.stack) for s in ly.matrices(self.hidden) + self.root_matrices())
        return max(_numel(s) for s in self.block_matrices() + self.root_matrices())

    def matrices(self) -> list[tuple[int, int]]:
        """One block's 2-D weight matrices (out, in), each expert's counted on its own."""
        out = []
        for m in self.block_matrices():
            if len(m) == 2:
                out.append(m)
            elif len(m) == 3:
                out += [m[1:]] * m[0]
        return out

    @property
    def factored_state(self) -> int:
        """Adafactor-like state elements: rows + cols per matrix (per expert for stacked experts),
        the full size of vectors."""
        def fact(s):
            return s[-2] + s[-1] if len(s) == 2 else (s[0] * (s[1] + s[2]) if len(s) == 3 else s[0])
        if self.stack:
            return (sum(fact(s) for ly in self.stack for s in ly.matrices(self.hidden))
                    + sum(fact(s) for s in self.root_matrices()))
        return (self.layers * sum(fact(s) for s in self.block_matrices())
                + sum(fact(s) for s in self.root_matrices()))

    def hf_config(self) -> dict:
        """The transformers config dict of this shape (for AutoConfig.for_model)."""
        if self.hf_json:
            hf = json.loads(self.hf_json)
            hf["num_hidden_layers"] = self.layers
            if isinstance(hf.get("layer_types"), list):
                hf["layer_types"] = hf["layer_types"][:self.layers]
            return hf
        if self.style == "gpt2":
            return {"model_type": "gpt2", "vocab_size": self.vocab, "n_embd": self.hidden,
                    "n_layer": self.layers, "n_head": self.heads, "n_positions": self.max_positions,
                    "n_inner": self.ffn, "tie_word_embeddings": True, "layer_norm_epsilon": self.norm_eps,
                    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                    "activation_function": "gelu_new" if self.gelu == "new" else "gelu_pytorch_tanh"}
        if self.moe:
            return self._hf_moe_config()
        return {"model_type": self.hf_model_type or "llama", "vocab_size": self.vocab,
                "hidden_size": self.hidden, "intermediate_size": self.ffn,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.n_kv_heads, "max_position_embeddings": self.max_positions,
                "tie_word_embeddings": self.tied, "rms_norm_eps": self.norm_eps,
                "rope_theta": self.rope_theta,
                **({"sliding_window": self.sliding_window} if self.hf_model_type == "mistral" else {}),
                **({"head_dim": self.head_dim} if self.hf_model_type == "qwen3" else {})}

    def _hf_moe_config(self) -> dict:
        common = {"model_type": self.hf_model_type, "vocab_size": self.vocab, "hidden_size": self.hidden,
                  "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                  "num_key_value_heads": self.n_kv_heads, "max_position_embeddings": self.max_positions,
                  "tie_word_embeddings": self.tied, "rms_norm_eps": self.norm_eps, "rope_theta": self.rope_theta,
                  "num_experts_per_tok": self.top_k}
        if self.hf_model_type == "mixtral":
            return {**common, "num_local_experts": self.experts, "intermediate_size": self.moe_ffn,
                    "sliding_window": self.sliding_window, "router_jitter_noise": 0.0}
        if self.hf_model_type == "olmoe":
            return {**common, "num_experts": self.experts, "intermediate_size": self.moe_ffn}
        return {**common, "head_dim": self.head_dim, "num_experts": self.experts, "norm_topk_prob": True,
                "moe_intermediate_size": self.moe_ffn, "intermediate_size": self.ffn, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None}

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("hf_json")
        d["stack"] = [asdict(ly) for ly in self.stack]
        return d

    def attention_flops(self, seq: int) -> float:
        """Forward FLOPs per token of the attention cores alone (QK^T and AV; no weights)."""
        return sum(n * ly.attention.core_flops(seq) for ly, n in _kinds(self))

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token (forward and backward: 3x the forward), counting the matmuls a
        token goes through - every block's projections, an MoE block's router, top-k and shared
        experts only, the LM head (the input embedding is a lookup) - and each layer's attention over
        the keys it attends (its window or chunk where shorter than the sequence). PaLM's 6N + 12LHQT
        (arXiv 2204.02311, App. B) is this for a dense decoder with full attention."""
        fwd = sum(n * ly.forward_flops(self.hidden, seq) for ly, n in _kinds(self))
        return 3 * (fwd + (2 * self.vocab * self.hidden if self.head else 0))


@functools.lru_cache(maxsize=512)
def _kinds(d: DecoderConfig) -> tuple[tuple[Layer, int], ...]:
    """The distinct layers of a decoder and how many times each occurs (a plan asks per candidate)."""
    return tuple(Counter(d.layer_list()).items())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _llama(vocab, hidden, layers, heads, ffn, max_pos, kv=None, tied=False, theta=10000.0,
           model_type="llama", window=None) -> DecoderConfig:
    return DecoderConfig("llama", vocab, hidden, layers, heads, ffn, max_pos, kv_heads=kv, tied=tied,
                         rope_theta=theta, hf_model_type=model_type, sliding_window=window)


def _moe(model_type, vocab, hidden, layers, heads, moe_ffn, max_pos, experts, top_k, kv=None, theta=10000.0,
         ffn=None, head=None, qk_norm=None, eps=1e-5) -> DecoderConfig:
    return DecoderConfig("llama", vocab, hidden, layers, heads, ffn or moe_ffn, max_pos, kv_heads=kv or heads,
                         rope_theta=theta, hf_model_type=model_type, head_size=head, qk_norm=qk_norm,
                         experts=experts, top_k=top_k, moe_ffn=moe_ffn, norm_eps=eps)


def _gpt2(hidden, layers, heads) -> DecoderConfig:
    return DecoderConfig("gpt2", 50257, hidden, layers, heads, 4 * hidden, 1024, tied=True,
                         hf_model_type="gpt2")


# Shapes from each model's published config.json (Meta Llama 2/3 model cards, Mistral-7B-v0.1,
# OpenAI GPT-2). Parameter counts are asserted in tests/model/test_profile.py.
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
    # Mixture-of-experts decoders (published config.json of mistralai/Mixtral-8x7B-v0.1,
    # Qwen/Qwen3-30B-A3B, allenai/OLMoE-1B-7B-0924): every layer an MoE block.
    "mixtral-8x7b": _moe("mixtral", 32000, 4096, 32, 32, 14336, 32768, kv=8, experts=8, top_k=2, theta=1e6),
    "qwen3-30b-a3b": _moe("qwen3_moe", 151936, 2048, 48, 32, 768, 40960, kv=4, experts=128, top_k=8, theta=1e6,
                          ffn=6144, head=128, qk_norm="head", eps=1e-6),
    "olmoe-1b-7b": _moe("olmoe", 50304, 2048, 16, 16, 1024, 4096, experts=64, top_k=8, qk_norm="full"),
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
    if mt in ("llama", "mistral", "qwen3") and not cfg.get("attention_bias") and not cfg.get("mlp_bias"):
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        if cfg.get("head_dim") not in (None, hidden // heads) and mt != "qwen3":
            return None
        if mt == "qwen3" and cfg.get("use_sliding_window"):
            return None
        head = cfg.get("head_dim") if mt == "qwen3" else None
        return DecoderConfig("llama", cfg["vocab_size"], hidden, cfg["num_hidden_layers"], heads,
                             cfg["intermediate_size"], cfg.get("max_position_embeddings", 2048),
                             kv_heads=cfg.get("num_key_value_heads") or heads,
                             tied=bool(cfg.get("tie_word_embeddings", False)),
                             norm_eps=cfg.get("rms_norm_eps", 1e-5),
                             rope_theta=_rope_theta(cfg), hf_model_type=mt,
                             sliding_window=cfg.get("sliding_window") if mt == "mistral" else None,
                             head_size=head if head not in (None, hidden // heads) else None,
                             qk_norm="head" if mt == "qwen3" else None)
    if mt in ("mixtral", "qwen3_moe", "olmoe"):
        return _moe_from_hf(cfg, mt)
    if mt == "gpt2":
        h = cfg.get("n_embd", 768)
        return DecoderConfig("gpt2", cfg.get("vocab_size", 50257), h, cfg.get("n_layer", 12),
                             cfg.get("n_head", 12), cfg.get("n_inner") or 4 * h,
                             cfg.get("n_positions", 1024), tied=True,
                             norm_eps=cfg.get("layer_norm_epsilon", 1e-5), hf_model_type="gpt2",
                             gelu="tanh" if cfg.get("activation_function") == "gelu_pytorch_tanh" else "new")
    return None


def _rope_theta(cfg: dict) -> float:
    """Top-level `rope_theta` (config.json as released), or inside `rope_parameters` (as
    transformers 5 writes it)."""
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
    return float(theta)


def _moe_from_hf(cfg: dict, mt: str) -> DecoderConfig | None:
    """Mixtral, Qwen3-MoE and OLMoE config.json dicts; None (profiled from the built module) where
    a layer is dense or the attention has biases or clipping our closed forms do not count."""
    if cfg.get("attention_bias") or cfg.get("clip_qkv") or cfg.get("mlp_only_layers") \
            or cfg.get("decoder_sparse_step", 1) != 1:
        return None
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if mt == "mixtral":
        moe_ffn, ffn, window = cfg["intermediate_size"], cfg["intermediate_size"], cfg.get("sliding_window")
    elif mt == "olmoe":
        moe_ffn, ffn, window = cfg["intermediate_size"], cfg["intermediate_size"], None
    else:
        moe_ffn, ffn = cfg["moe_intermediate_size"], cfg.get("intermediate_size") or cfg["moe_intermediate_size"]
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    head = cfg.get("head_dim") if mt == "qwen3_moe" else None
    return DecoderConfig("llama", cfg["vocab_size"], hidden, cfg["num_hidden_layers"], heads, ffn,
                         cfg.get("max_position_embeddings", 4096), kv_heads=cfg.get("num_key_value_heads") or heads,
                         tied=bool(cfg.get("tie_word_embeddings", False)), norm_eps=cfg.get("rms_norm_eps", 1e-5),
                         rope_theta=_rope_theta(cfg), hf_model_type=mt,
                         sliding_window=window, head_size=head if head != hidden // heads else None,
                         qk_norm={"qwen3_moe": "head", "olmoe": "full"}.get(mt), experts=experts,
                         top_k=cfg["num_experts_per_tok"], moe_ffn=moe_ffn)
