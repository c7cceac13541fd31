"""Whether tensor parallelism can split a decoder, and what it splits: the one rule the planner,
the estimate and the runtime share (pure, no torch import).

The runtime (hybrid/runtime/backends/tp.py) runs hybrid's llama-style decoder with its own plan, and
a transformers decoder with the model's own `base_model_tp_plan` under sequence parallelism and a
vocab-parallel loss, where that plan holds only the per-layer entries of HF_LAYER_STYLES. What a
transformers module says about it is read once into an `HFPlan` (by the runtime from the module it
is given; by hybrid/model/profile.read_decoder into the DecoderConfig it reads), and both ask the
same `problem`. Mixture-of-experts layers are split by expert parallelism, not tp.
"""
from __future__ import annotations

from dataclasses import dataclass

HF_LAYER_STYLES = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                   "self_attn.o_proj": "rowwise", "self_attn.q_norm": "replicated_with_grad_allreduce",
                   "self_attn.k_norm": "replicated_with_grad_allreduce", "mlp.gate_proj": "colwise",
                   "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
"""The per-layer entries of a transformers `base_model_tp_plan` the sequence-parallel plan
applies (Llama, Mistral, Qwen2, Qwen3, Gemma 3; not OLMo 2's or Phi-3's gather-output plans)."""

HF_PARTS = ("embed_tokens", "layers", "norm")
"""What the plan places in the base model besides the layers' projections."""

_MLP = ("mlp", "feed_forward", "block_sparse_moe", "ffn", "moe")
"""Where a block keeps its MLP (the names hybrid/model/anatomy.py reads)."""


def heads_problem(name: str, heads: int, kv_heads: int, tp: int) -> str | None:
    """Why `tp` cannot split the attention heads and key/value heads evenly (column-wise q, k
    and v give each rank heads / tp of them), or None."""
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads)):
        if n % tp:
            valid = [t for t in range(1, kv_heads + 1) if kv_heads % t == 0 and heads % t == 0]
            return f"tp {tp} does not divide the {n} {what} of {name}; valid tp: {', '.join(map(str, valid))}"
    return None


def moe_problem(name: str) -> str:
    return (f"{name} has mixture-of-experts layers, whose experts are split by expert parallelism (--ep), not "
            "tensor parallelism: use tp=1")


@dataclass(frozen=True)
class HFPlan:
    """What a transformers decoder module says about splitting it, as read from the module."""

    model: str
    """Its class name (the errors name it)."""
    styles: tuple[tuple[str, str], ...]
    """Its config's `base_model_tp_plan` as (module pattern, style) pairs; () = it has none."""
    parts: bool
    """Its base model has the embed_tokens, layers and norm the plan places."""
    heads: int
    """Attention heads (the config's num_attention_heads); 0 = not stated."""
    kv_heads: int
    """Key/value heads (num_key_value_heads, else the attention heads)."""
    experts: bool = False
    """Some layer's MLP holds experts (a mixture of experts)."""

    @classmethod
    def of(cls, model) -> "HFPlan":
        """Read from a transformers causal LM (real, meta or fake: only attributes are read)."""
        config = getattr(model, "config", None)
        base = getattr(config, "base_model_tp_plan", None) or {}
        inner = getattr(model, getattr(model, "base_model_prefix", "model"), None)
        parts = inner is not None and all(hasattr(inner, a) for a in HF_PARTS)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_attention_heads", None) or 0
        kv = getattr(text, "num_key_value_heads", None) or heads
        layers = getattr(inner, "layers", None) if inner is not None else None
        experts = any(getattr(_mlp(layer), "experts", None) is not None for layer in (layers or ()))
        return cls(type(model).__name__, tuple(base.items()), parts, int(heads), int(kv), experts)

    def problem(self, tp: int | None = None) -> str | None:
        """Why hybrid's sequence-parallel plan cannot split this decoder `tp` ways (one line naming
        the fix), or None; tp None: the plan alone, whatever the degree."""
        name = self.model
        if self.experts:
            return moe_problem(name)
        if not self.styles:
            return (f"{name} has no tensor-parallel plan (hybrid's llama-style decoders and transformers decoders "
                    "with base_model_tp_plan have one): use tp=1")
        for pattern, style in self.styles:
            key = pattern.removeprefix("layers.*.")
            if key not in HF_LAYER_STYLES or HF_LAYER_STYLES[key] != style:
                return (f"{name}'s tensor-parallel plan has {pattern!r}: {style!r}, which hybrid's sequence-parallel "
                        "plan does not apply (it splits attention and dense MLP projections): use tp=1")
        if not self.parts:
            return f"{name} has no embed_tokens / layers / norm in its base model: use tp=1"
        if tp is None or tp == 1 or not self.heads:
            return None
        return heads_problem(name, self.heads, self.kv_heads, tp)

    def splits(self, name: str) -> str | None:
        """The style the plan gives a layer's submodule ('self_attn.q_proj'), or None (replicated)."""
        for pattern, style in self.styles:
            if pattern.removeprefix("layers.*.") == name:
                return style
        return None


def split_elements(layer, hidden: int, plan: HFPlan | None = None) -> int:
    """Elements of one block's parameters (hybrid/model/anatomy.py Layer) that tensor parallelism
    shards: column-wise q, k, v (gate, up) split their weights and biases, row-wise o (down) their
    weights while their biases stay whole (DTensor's ColwiseParallel / RowwiseParallel); norms
    (q/k norms too) are replicated. `plan`: a transformers module's, which names the projections it
    splits (None: every one, as hybrid's own plan does)."""
    def has(name: str) -> bool:
        return plan is None or plan.splits(name) is not None
    at, mlp, h = layer.attention, layer.mlp, hidden
    q, kv = at.q_width, at.kv_width
    n = 0
    for name, width in (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)):
        n += (width * h + (width if at.qkv_bias else 0)) if has(name) else 0
    n += h * q if has("self_attn.o_proj") else 0
    if not mlp.moe:
        f = mlp.ffn
        ins = ("mlp.gate_proj", "mlp.up_proj") if mlp.gated else ("mlp.up_proj",)
        n += sum(f * h + (f if mlp.bias else 0) for name in ins if has(name))
        n += h * f if has("mlp.down_proj") else 0
    return n


def _mlp(layer):
    for n in _MLP:
        c = getattr(layer, n, None)
        if c is not None:
            return c
    return None


def decoder_problem(d, tp: int, name: str) -> str | None:
    """Why tensor parallelism cannot split decoder `d` (hybrid/model/presets.DecoderConfig) `tp`
    ways as the runtime runs it, or None. tp 1 splits nothing; `d` None (a model known without a
    decoder's dimensions) splits only at tp 1. A decoder read from a transformers module: its
    module's plan (HFPlan.problem, the runtime's own check); hybrid's closed forms: llama style
    (separate q/k/v projections), dense, heads and key/value heads divisible by tp."""
    if tp == 1:
        return None
    if d is None:
        return f"tensor parallelism needs a transformer's dimensions; {name} has none: use tp=1"
    if d.stack:
        if d.tp_plan is None:
            return (f"{name} was read without its module's tensor-parallel plan (transformers' "
                    "base_model_tp_plan): use tp=1")
        problem = d.tp_plan.problem(tp)
        if problem is not None:
            return problem
        for at in {ly.attention for ly in d.stack}:
            problem = heads_problem(name, at.heads, at.kv_heads, tp)
            if problem is not None:
                return problem
        return None
    if d.moe:
        return moe_problem(name)
    if d.style != "llama":
        return (f"tensor parallelism needs separate q/k/v projections; {d.style} fuses them (qkv_proj): use tp=1")
    return heads_problem(name, d.heads, d.n_kv_heads, tp)
