"""What a decoder is, layer by layer: each block's attention and MLP, read from the module itself.

A model's anatomy is a list of `Layer`s (its attention: GQA/MHA/MQA or MLA with its low-rank
projections and head dims, biases, q/k norms, its window - global, sliding or chunked - sinks and
soft-caps; its MLP: dense, plain or gated, or MoE with router, experts, top-k, expert width and
shared experts; its norms). Heterogeneous stacks - Gemma 3's local/global alternation,
DeepSeek-V3's dense first layers, Llama 4's interleaved MoE, gpt-oss's sliding/full pairs - are
simply lists whose layers differ.

`read_layers(module)` walks a built module (transformers' classes on the meta device, or a given
one) and describes what it finds, from the parameters' shapes and the modules' attributes, not
from a table per `model_type`; the closed forms (parameters here, FLOPs here, activations in
hybrid/estimation/memory/activations.py) are per component. No torch import: the walk only calls
the module's own methods.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .probes import norm_kind, routing


@dataclass(frozen=True)
class Attention:
    heads: int
    kv_heads: int
    head_dim: int
    """Query/key head dimension (MLA: nope + rope)."""
    kind: Literal["gqa", "mla"] = "gqa"
    v_head_dim: int = 0
    """Value head dimension when it differs from head_dim (MLA); 0 = head_dim."""
    q_lora: int = 0
    """MLA: rank of the query down-projection (0: a full q projection)."""
    kv_lora: int = 0
    """MLA: rank of the joint key/value down-projection."""
    rope_dim: int = 0
    """MLA: the decoupled rotary part of each query/key head (shared by all heads for keys)."""
    qkv_bias: bool = False
    out_bias: bool = False
    fused_qkv: bool = False
    """One projection makes q, k and v (Phi-3's qkv_proj): v stays a view of its whole output."""
    qk_norm: Literal["head", "full", "l2"] | None = None
    """RMSNorm on queries and keys over each head ('head', Qwen3/Gemma 3), over the whole
    projection ('full', OLMo 2/OLMoE), or a weightless L2 norm (Llama 4)."""
    window: int = 0
    """Sliding window (tokens); 0 = global."""
    chunk: int = 0
    """Chunked attention (Llama 4's local layers): attends within chunks of this many tokens."""
    sinks: bool = False
    """A learned logit per head added to the softmax (gpt-oss): needs eager attention."""
    softcap: float = 0.0
    """tanh soft-capping of the attention logits (Gemma 2); 0 = none."""
    rope: bool = True
    rope_cat: bool = False
    """Each query head is a concatenation (MLA's nope and rope parts; a rotary applied to part of the
    head, `partial_rotary_factor`: Phi-3): the queries come out contiguous per head, so SDPA's
    output is laid out (b, heads, s, d) and the o projection reads a copy of it, not a view."""

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def span(self, seq: int) -> int:
        """Keys one query attends to at this sequence length (the full sequence, the window or the chunk)."""
        return min(seq, self.window or seq, self.chunk or seq)

    def masked(self, seq: int) -> bool:
        """Whether this layer's attention needs an explicit mask at this length (no mask-free path)."""
        return self.span(seq) < seq or self.sinks or self.softcap > 0

    def matrices(self, hidden: int) -> list[tuple[int, ...]]:
        h, a, d = hidden, self.heads, self.head_dim
        if self.kind == "mla":
            nope = d - self.rope_dim
            q = ([(self.q_lora, h), (self.q_lora,), (a * d, self.q_lora)] if self.q_lora else [(a * d, h)])
            kv = [(self.kv_lora + self.rope_dim, h), (self.kv_lora,), (a * (nope + self.v_dim), self.kv_lora)]
            return q + kv + [(h, a * self.v_dim)] + ([(h,)] if self.out_bias else [])
        q, kv = self.q_width, self.kv_width
        out = [(q, h), (kv, h), (kv, h), (h, q)]
        if self.qkv_bias:
            out += [(q,), (kv,), (kv,)]
        if self.out_bias:
            out.append((h,))
        out += {"head": [(d,), (d,)], "full": [(q,), (kv,)], "l2": [], None: []}[self.qk_norm]
        if self.sinks:
            out.append((a,))
        return out

    def matmul_params(self, hidden: int) -> int:
        """Weight elements every token multiplies (the projections)."""
        return sum(m[0] * m[1] for m in self.matrices(hidden) if len(m) == 2)

    def core_flops(self, seq: int) -> float:
        """Forward FLOPs per token of the attention itself (QK^T and AV over the keys it attends)."""
        return 2 * self.span(seq) * self.heads * (self.head_dim + self.v_dim)


@dataclass(frozen=True)
class MLP:
    kind: Literal["dense", "moe"] = "dense"
    ffn: int = 0
    """Dense: the intermediate width. MoE: 0."""
    gated: bool = True
    fused_gate_up: bool = False
    """One projection makes the gate and the up halves (Phi-3's gate_up_proj): one matmul, not two."""
    act: Literal["silu", "gelu_tanh", "gelu", "gelu_new", "swiglu_clamp", "relu2"] = "silu"
    bias: bool = False
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    """Width of one routed expert."""
    shared_ffn: int = 0
    """Total width of the shared expert(s) every token also passes through (0: none)."""
    shared_gate: bool = False
    """A sigmoid gate on the shared expert's output (Qwen2-MoE)."""
    router: Literal["softmax", "sigmoid", "topk_softmax"] = "softmax"
    """The router's nonlinearity: a softmax over every expert (then the top k), a sigmoid per
    expert, or a softmax over the top k logits (gpt-oss)."""
    router_bias: bool = False
    renorm: bool = True
    """Whether the top-k routing weights are renormalised to sum to one."""
    router_fp32: bool = False
    """The router's matmul runs in fp32 over lower-precision tokens (DeepSeek-V3 upcasts its input
    and weight): an fp32 copy of both is made."""
    shared_first: bool = False
    """The shared expert(s) run before the router (Qwen2-MoE): the order of the block's matmuls."""
    dense_dispatch: bool = False
    """Every expert runs on every token, its output weighted by a routing score that is zero off
    the top k (transformers' Llama 4 experts: one bmm over all experts). The model's FLOPs count
    the top k; the work and the activations are every expert's."""

    @property
    def moe(self) -> bool:
        return self.kind == "moe"

    def expert_params(self, hidden: int) -> int:
        """Parameters of one routed expert: gate (when gated), up and down, with their biases."""
        m = self.moe_ffn
        return (3 if self.gated else 2) * hidden * m + (((2 if self.gated else 1) * m + hidden) if self.bias else 0)

    def matrices(self, hidden: int) -> list[tuple[int, ...]]:
        h = hidden
        if not self.moe:
            f = self.ffn
            out = [(f, h), (f, h), (h, f)] if self.gated else [(f, h), (h, f)]
            if self.bias:
                out += [(f,), (f,), (h,)] if self.gated else [(f,), (h,)]
            return out
        e, m = self.experts, self.moe_ffn
        out = [(e, h)] + ([(e,)] if self.router_bias else [])
        out += [(e, 2 * m, h), (e, h, m)] if self.gated else [(e, m, h), (e, h, m)]
        if self.bias:
            out += [(e, 2 * m if self.gated else m), (e, h)]
        if self.shared_ffn:
            s = self.shared_ffn
            out += [(s, h), (s, h), (h, s)]
        if self.shared_gate:
            out.append((1, h))
        return out

    def matmul_params(self, hidden: int) -> int:
        """Weight elements one token multiplies: the dense MLP, or the router, its top-k experts and
        the shared expert(s)."""
        h = hidden
        if not self.moe:
            return (3 if self.gated else 2) * h * self.ffn
        return (self.experts * h + self.top_k * (3 if self.gated else 2) * h * self.moe_ffn
                + 3 * h * self.shared_ffn + (h if self.shared_gate else 0))

    def inactive_params(self, hidden: int) -> int:
        """Parameters of the routed experts a token is not sent to."""
        return (self.experts - self.top_k) * self.expert_params(hidden) if self.moe else 0


@dataclass(frozen=True)
class Linear:
    """One linear of a block, as PEFT's target_modules see it (peft/tuners/tuners_utils.py
    check_target_module_exists: a name, or a suffix after a dot)."""

    name: str
    """Its path under the block (self_attn.q_proj)."""
    in_features: int
    out_features: int
    reads: Literal["attention", "core", "mlp", "product", "other"] = "other"
    """What its input is: the attention's input (q/k/v), the attention core's output (o_proj), the
    MLP's input (gate/up), the MLP's activation product (down), or something else (MLA's inner
    projections, an MoE block's shared experts)."""


@dataclass(frozen=True)
class Layer:
    attention: Attention
    mlp: MLP
    norms: int = 2
    """Norm weights of the block (2: pre-attention and pre-MLP; Gemma 3: 4 with the post-norms)."""
    post_norms: bool = False
    """Whether norms also act on the attention and MLP outputs before the residual sums (Gemma 3,
    OLMo 2): they keep those outputs too."""
    norm: Literal["rms", "rms1p", "layer"] = "rms"
    """RMSNorm as Llama writes it, Gemma's (1 + weight) in fp32, or LayerNorm."""
    linears: tuple[Linear, ...] = ()
    """The block's linears as read from the module (what LoRA adapts); () where not read."""

    def matrices(self, hidden: int) -> list[tuple[int, ...]]:
        norms = [(hidden,)] * self.norms * (2 if self.norm == "layer" else 1)
        return self.attention.matrices(hidden) + self.mlp.matrices(hidden) + norms

    def params(self, hidden: int) -> int:
        return sum(math.prod(m) for m in self.matrices(hidden))

    def matmul_params(self, hidden: int) -> int:
        return self.attention.matmul_params(hidden) + self.mlp.matmul_params(hidden)

    def forward_flops(self, hidden: int, seq: int) -> float:
        """Forward FLOPs per token: 2 per weight a token multiplies, and the attention core."""
        return 2 * self.matmul_params(hidden) + self.attention.core_flops(seq)


# --- reading a built module -------------------------------------------------------------------

_ATTENTION = ("self_attn", "attn", "attention", "self_attention")
_MLP = ("mlp", "feed_forward", "block_sparse_moe", "ffn", "moe")


def _child(module, names):
    for n in names:
        c = getattr(module, n, None)
        if c is not None and hasattr(c, "named_parameters"):
            return c
    return None


def _weight(module, *names):
    """The first of these submodules' weight (or the named parameter itself), or None."""
    for n in names:
        c = getattr(module, n, None)
        if c is None:
            continue
        w = getattr(c, "weight", c)
        if hasattr(w, "shape"):
            return w
    return None


def _has_bias(module, *names) -> bool:
    for n in names:
        c = getattr(module, n, None)
        if c is not None and getattr(c, "bias", None) is not None:
            return True
    return False


def _cfg(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


class Unreadable(Exception):
    """A block whose attention or MLP is not one of the kinds described here."""


def read_attention(attn, config, hidden: int, layer_type: str | None) -> Attention:
    heads = _cfg(config, "num_attention_heads", "n_head")
    kv_heads = _cfg(config, "num_key_value_heads", default=heads) or heads
    if heads is None:
        raise Unreadable("no num_attention_heads in the config")
    window = 0
    sliding = _cfg(config, "sliding_window", default=0) or 0
    if layer_type in ("sliding_attention",) or (layer_type is None and getattr(attn, "sliding_window", None)):
        window = getattr(attn, "sliding_window", None) or sliding
    chunk = _cfg(config, "attention_chunk_size", default=0) if layer_type == "chunked_attention" else 0
    sinks = getattr(attn, "sinks", None) is not None
    softcap = float(_cfg(config, "attn_logit_softcapping", default=0.0) or 0.0)
    common = dict(window=int(window or 0), chunk=int(chunk or 0), sinks=sinks, softcap=softcap,
                  rope=bool(getattr(attn, "use_rope", True)), out_bias=_has_bias(attn, "o_proj", "c_proj", "dense"))
    if getattr(attn, "kv_a_proj_with_mqa", None) is not None:                 # multi-head latent attention
        kv_a = attn.kv_a_proj_with_mqa.weight.shape[0]
        kv_lora = attn.kv_a_layernorm.weight.shape[0]
        rope = kv_a - kv_lora
        q_lora = attn.q_a_proj.weight.shape[0] if getattr(attn, "q_a_proj", None) is not None else 0
        q_out = (attn.q_b_proj if q_lora else attn.q_proj).weight.shape[0]
        d = q_out // heads
        v = attn.o_proj.weight.shape[1] // heads
        return Attention(heads, heads, d, kind="mla", v_head_dim=v if v != d else 0, q_lora=q_lora,
                         kv_lora=kv_lora, rope_dim=rope, qkv_bias=_has_bias(attn, "q_a_proj", "q_proj"), rope_cat=True,
                         **common)
    q = _weight(attn, "q_proj", "query", "wq")
    if q is not None:
        q_out = q.shape[0]
        kv_out = _weight(attn, "k_proj", "key", "wk").shape[0]
    else:
        fused = _weight(attn, "qkv_proj", "c_attn", "query_key_value", "Wqkv", "wqkv")
        if fused is None:
            raise Unreadable(f"attention {type(attn).__name__}: no q/k/v or fused qkv projection")
        out = fused.shape[1] if type(getattr(attn, "c_attn", None)).__name__ == "Conv1D" else fused.shape[0]
        d = _cfg(config, "head_dim", default=hidden // heads) or hidden // heads
        q_out, kv_out = heads * d, (out - heads * d) // 2
        common["fused_qkv"] = True
    d = q_out // heads
    kv_heads = kv_out // d
    qk_norm = None
    qn = _weight(attn, "q_norm", "q_layernorm")
    if qn is not None:
        qk_norm = "head" if qn.shape[-1] == d else "full"
    elif getattr(attn, "qk_norm", None) is not None or (getattr(config, "use_qk_norm", False) and common["rope"]):
        qk_norm = "l2"
    return Attention(heads, kv_heads, d, qkv_bias=_has_bias(attn, "q_proj", "qkv_proj", "c_attn", "query_key_value"),
                     qk_norm=qk_norm, rope_cat=common["rope"] and _partial_rotary(config), **common)


def _partial_rotary(config) -> bool:
    """Whether the config declares a partial rotary factor (at its top level or in its rope
    parameters): the code that reads one rotates a slice of each head and concatenates the rest."""
    rope = _cfg(config, "rope_parameters", default={})
    return _cfg(config, "partial_rotary_factor") is not None or (
        isinstance(rope, dict) and rope.get("partial_rotary_factor") is not None)


def _act(config) -> str:
    a = str(_cfg(config, "hidden_act", "hidden_activation", "activation_function", default="silu"))
    return {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_new", "gelu": "gelu", "silu": "silu",
            "swish": "silu", "relu2": "relu2"}.get(a, a)


def _dense_width(mlp) -> tuple[int, bool, bool]:
    """(intermediate width, gated, biased) of a dense MLP module."""
    down = _weight(mlp, "down_proj", "w2", "fc2", "c_proj", "dense_4h_to_h")
    if down is None:
        raise Unreadable(f"MLP {type(mlp).__name__}: no down projection")
    conv = type(getattr(mlp, "c_proj", None)).__name__ == "Conv1D"
    width = down.shape[0] if conv else down.shape[1]
    gated = any(getattr(mlp, n, None) is not None for n in ("gate_proj", "w1", "gate_up_proj", "w3"))
    if getattr(mlp, "fc1", None) is not None and not gated:
        gated = False
    biased = _has_bias(mlp, "down_proj", "w2", "fc2", "c_proj", "dense_4h_to_h")
    return int(width), gated, biased


def read_mlp(mlp, config, hidden: int) -> MLP:
    experts = getattr(mlp, "experts", None)
    if experts is None:
        width, gated, biased = _dense_width(mlp)
        fused = _weight(mlp, "gate_up_proj") is not None and _weight(mlp, "gate_proj", "up_proj") is None
        return MLP("dense", width, gated=gated, fused_gate_up=fused, act=_act(config), bias=biased)
    down = getattr(experts, "down_proj", None)
    if hasattr(down, "shape") and down.dim() == 3:                     # stacked experts (transformers 5)
        n = down.shape[0]
        m = down.shape[2] if down.shape[1] == hidden else down.shape[1]
        bias = getattr(experts, "down_proj_bias", None) is not None or getattr(experts, "gate_up_proj_bias",
                                                                                None) is not None
        gated = True
    elif hasattr(experts, "__len__") and len(experts):                   # a ModuleList of dense experts
        n = len(experts)
        m, gated, bias = _dense_width(experts[0])
    else:
        raise Unreadable(f"MoE {type(mlp).__name__}: experts {type(experts).__name__} not read")
    dense_dispatch = hasattr(down, "shape") and not hasattr(experts, "has_gate")
    clamp = getattr(experts, "limit", None) is not None and getattr(experts, "alpha", None) is not None
    router = _child(mlp, ("gate", "router"))
    top_k = (getattr(mlp, "top_k", None) or getattr(router, "top_k", None)
             or _cfg(config, "num_experts_per_tok", "moe_topk", "top_k"))
    if not top_k:
        raise Unreadable(f"MoE {type(mlp).__name__}: no top-k")
    shared = _child(mlp, ("shared_expert", "shared_experts", "shared_mlp"))
    shared_ffn = _dense_width(shared)[0] if shared is not None else 0
    routed = routing(mlp, hidden, int(n), int(top_k), shared) or _routing_read(config, router)
    return MLP("moe", 0, gated=gated, act="swiglu_clamp" if clamp else _act(config), bias=bias,
               dense_dispatch=dense_dispatch, experts=int(n), top_k=int(top_k),
               moe_ffn=int(m), shared_ffn=int(shared_ffn), shared_gate=getattr(mlp, "shared_expert_gate", None)
               is not None, router_bias=_has_bias(mlp, "gate", "router"), **routed)


def _routing_read(config, router) -> dict:
    """hybrid/model/probes.py routing's fields read from attributes, for a layer that does not run on
    meta: a sigmoid router has a score correction bias or says so; Mixtral and gpt-oss renormalise
    over the top k (a softmax of the top logits) where the config does not say."""
    sigmoid = (getattr(router, "e_score_correction_bias", None) is not None
               or _cfg(config, "scoring_func", default="softmax") == "sigmoid")
    renorm = _cfg(config, "norm_topk_prob", default=None)
    return dict(router="sigmoid" if sigmoid else "softmax", renorm=True if renorm is None else bool(renorm))


def read_layer(block, config, hidden: int, layer_type: str | None = None) -> Layer:
    attn = _child(block, _ATTENTION)
    mlp = _child(block, _MLP)
    if attn is None or mlp is None:
        raise Unreadable(f"block {type(block).__name__}: no attention or MLP submodule")
    norm_mods = [c for n, c in block.named_children() if "norm" in n.lower() or "ln" in n.lower()]
    names = {n for n, _ in block.named_children()}
    post = bool(names & {"post_feedforward_layernorm", "post_mlp_layernorm"})
    kind = norm_kind(norm_mods[0], hidden) if norm_mods else "rms"
    return Layer(read_attention(attn, config, hidden, layer_type), read_mlp(mlp, config, hidden),
                 norms=len(norm_mods), post_norms=post, norm=kind, linears=read_linears(block, attn, mlp, hidden))


_OUT = ("o_proj", "c_proj", "dense", "out_proj", "wo")
_DOWN = ("down_proj", "w2", "fc2", "c_proj", "dense_4h_to_h")


def read_linears(block, attn, mlp, hidden: int) -> tuple[Linear, ...]:
    """Every linear under the block with its input's role; a PEFT adapter's wrapper counts as the
    base linear it wraps (its lora_A/lora_B are not the model's)."""
    out_proj = next((getattr(attn, n) for n in _OUT if getattr(attn, n, None) is not None), None)
    down = next((getattr(mlp, n) for n in _DOWN if getattr(mlp, n, None) is not None), None)
    found = []

    def walk(module, prefix, parent):
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            base = getattr(child, "base_layer", None)
            linear = base if base is not None else child
            if isinstance(getattr(linear, "in_features", None), int) and isinstance(
                    getattr(linear, "out_features", None), int):
                reads = "other"
                if parent is attn:
                    reads = "core" if child is out_proj else "attention" if linear.in_features == hidden else "other"
                elif parent is mlp:
                    reads = "product" if child is down else "mlp" if linear.in_features == hidden else "other"
                found.append(Linear(path, linear.in_features, linear.out_features, reads))
            else:
                walk(child, path + ".", child)
    walk(block, "", block)
    return tuple(found)


def read_layers(blocks, config, hidden: int) -> tuple[Layer, ...]:
    """Every block of a built model, described (Unreadable where a block is not understood)."""
    types = _cfg(config, "layer_types", default=None)
    out = []
    for i, b in enumerate(blocks):
        lt = types[i] if types is not None and i < len(types) else None
        out.append(read_layer(b, config, hidden, lt))
    return tuple(out)

