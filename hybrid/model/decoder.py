"""Our own decoder-only transformer (llama and gpt2 styles), built from a DecoderConfig.

Written to compute what the Hugging Face implementations compute, op for op where it matters for
memory (RMSNorm upcast to fp32, loss on fp32 logits), so the same analytic activation formula
serves both. Builds on any device, including `meta` for 7B+ shapes.
"""
from __future__ import annotations

import contextlib
import logging
import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import HybridError
from .presets import DecoderConfig, get_preset


@dataclass
class CausalLMOutput:
    """What forward returns: `loss` (when labels were given) and `logits` (None when a chunked or
    fused head_loss made the loss without them)."""

    loss: torch.Tensor | None
    logits: torch.Tensor | None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, attention: str):
        super().__init__()
        h, kv = cfg.hidden, cfg.kv_dim
        self.cfg, self.attention = cfg, attention
        if cfg.style == "gpt2":      # one fused projection with biases, as GPT-2's c_attn
            self.qkv_proj = nn.Linear(h, h + 2 * kv)
        else:
            self.q_proj = nn.Linear(h, h, bias=False)
            self.k_proj = nn.Linear(h, kv, bias=False)
            self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(h, h, bias=cfg.style == "gpt2")
        self.cp_group = None
        """Set by context parallelism (runtime/backends/cp.py): x holds this rank's chunks of the sequence,
        and attention gathers the whole sequence's keys and values over this group."""
        self.cp_attention = None
        """Set with cp_group: attention(q, k, v, group) of this rank's query chunks over the gathered sequence."""

    def forward(self, x, rope, mask=None):
        # head counts come from the projections' outputs: under tensor parallelism each rank holds
        # heads / tp query heads and kv_heads / tp key/value heads
        b, s = x.shape[0], x.shape[1]
        a, kvh, d = self.cfg.heads, self.cfg.n_kv_heads, self.cfg.head_dim
        if self.cfg.style == "gpt2":
            q, k, v = self.qkv_proj(x).split([a * d, kvh * d, kvh * d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, s, -1, d).transpose(1, 2)
        k = k.view(b, s, -1, d).transpose(1, 2)
        v = v.view(b, s, -1, d).transpose(1, 2)
        a, kvh = q.shape[1], k.shape[1]
        if rope is not None:
            cos, sin = rope
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if self.cp_group is not None:      # this rank's query chunks over the gathered sequence
            y = self.cp_attention(q, k, v, self.cp_group)
        elif mask is None:        # the mask-free causal flash path, GQA kept
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kvh != a)
        else:
            if kvh != a:          # kernels that take a mask want every head's k and v
                k = k.repeat_interleave(a // kvh, dim=1)
                v = v.repeat_interleave(a // kvh, dim=1)
            if self.attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                scores = torch.where(mask, (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d)), float("-inf"))
                # Llama takes the softmax in fp32 and casts back; GPT-2 keeps the compute dtype
                upcast = torch.float32 if self.cfg.style == "llama" else None
                y = torch.softmax(scores, dim=-1, dtype=upcast).to(q.dtype) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, f = cfg.hidden, cfg.ffn
        self.style, self.gelu = cfg.style, cfg.gelu
        if cfg.style == "llama":
            self.gate_proj = nn.Linear(h, f, bias=False)
            self.up_proj = nn.Linear(h, f, bias=False)
            self.down_proj = nn.Linear(f, h, bias=False)
        else:
            self.fc = nn.Linear(h, f)
            self.proj = nn.Linear(f, h)

    def forward(self, x):
        if self.style == "llama":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        x = self.fc(x)
        if self.gelu == "tanh":
            return self.proj(F.gelu(x, approximate="tanh"))
        # GPT-2's GELU as published (transformers' gelu_new), op for op
        return self.proj(0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))))


class Experts(nn.Module):
    """A mixture-of-experts layer's experts, stacked as transformers 5 stores Mixtral's: gate and up
    projections concatenated (experts x 2 moe_ffn x hidden), down (experts x hidden x moe_ffn).
    Called as transformers' experts are, so expert parallelism (runtime/backends/ep.py) serves both."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        e, h, f = cfg.experts, cfg.hidden, cfg.moe_ffn
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, f))
        self.act_fn = F.silu

    def forward(self, x, top_k_index, top_k_weights):
        """x: (tokens, hidden); each token's top-k experts and their weights: (tokens, k)."""
        out = torch.zeros_like(x)
        for e in torch.unique(top_k_index).tolist():     # ascending, as transformers' loop adds them
            token, slot = torch.where(top_k_index == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class MoE(nn.Module):
    """Mixtral's sparse block: a linear router, softmax in fp32, the top-k experts per token with
    their probabilities renormalised to sum to one, the experts' outputs summed by them."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x):
        b, s, h = x.shape
        x = x.reshape(-1, h)
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        return self.experts(x, chosen, weights).view(b, s, h)


def _norm(cfg: DecoderConfig) -> nn.Module:
    if cfg.style == "llama":
        return RMSNorm(cfg.hidden, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)


class Block(nn.Module):
    """One transformer layer: the unit that FSDP shards and checkpointing recomputes."""

    def __init__(self, cfg: DecoderConfig, attention: str):
        super().__init__()
        self.norm1, self.attn = _norm(cfg), Attention(cfg, attention)
        self.norm2, self.mlp = _norm(cfg), (MoE(cfg) if cfg.moe else MLP(cfg))

    def forward(self, x, rope=None, mask=None):
        x = x + self.attn(self.norm1(x), rope, mask)
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """Token ids in, CausalLMOutput out; `labels` (same shape as ids) give the shifted LM loss."""

    loss_fn = staticmethod(lambda logits, labels: causal_lm_loss(logits, labels))
    """The loss forward applies with labels (hybrid.runtime.compile replaces it with its compiled form)."""
    head_loss = None
    """With labels: head_loss(lm_head, hidden, labels) in place of the whole logits and loss_fn
    (hybrid.runtime.loss sets it for loss 'chunked' or 'fused'; the output then has no logits)."""

    def __init__(self, cfg: DecoderConfig, attention: str = "sdpa"):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_embed = nn.Embedding(cfg.max_positions, cfg.hidden) if cfg.style == "gpt2" else None
        self.blocks = nn.ModuleList(Block(cfg, attention) for _ in range(cfg.layers))
        self.norm = _norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied:
            self.lm_head.weight = self.embed.weight
        if cfg.style == "llama":
            self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        if self.embed.weight.device.type != "meta":
            self.apply(_init_weights)

    def _inv_freq(self):
        cfg = self.config
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))

    @torch.no_grad()
    def init_weights(self):
        """Initialise in place (after `to_empty` of a model built on the meta device)."""
        self.apply(_init_weights)
        for m in self.modules():
            if isinstance(m, (RMSNorm, nn.LayerNorm)):
                m.weight.fill_(1.0)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
        if self.config.style == "llama":
            self.inv_freq.copy_(self._inv_freq())

    def _rope(self, s: int, dtype: torch.dtype, device, positions=None):
        return None if self.pos_embed is not None else rope_tables(self.inv_freq, s, dtype, device, positions)

    def _mask(self, b: int, s: int, device):
        return causal_mask(self.blocks[0].attn.attention, self.config.sliding_window, b, s, device)

    def forward(self, input_ids, labels=None, position_ids=None):
        """position_ids: (s,) global positions of the tokens (context parallelism gives each rank
        its chunks of the sequence); default 0..s-1."""
        s = input_ids.shape[1]
        x = self.embed(input_ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(s, device=input_ids.device) if position_ids is None else position_ids)
        rope = self._rope(s, x.dtype, x.device, position_ids)
        cp = self.blocks[0].attn.cp_group is not None if len(self.blocks) else False
        mask = None if cp else self._mask(input_ids.shape[0], s, x.device)
        for block in self.blocks:
            x = block(x, rope, mask)
        x = self.norm(x)
        if labels is not None and self.head_loss is not None:
            return CausalLMOutput(loss=self.head_loss(self.lm_head, x, labels), logits=None)
        logits = self.lm_head(x)
        loss = None if labels is None else self.loss_fn(logits, labels)
        return CausalLMOutput(loss=loss, logits=logits)


def rope_tables(inv_freq, s: int, dtype: torch.dtype, device, positions=None):
    """Rotary cos/sin tables for positions 0..s-1 (or the given positions)."""
    t = (torch.arange(s, device=device) if positions is None else positions).to(device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.to(device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def causal_mask(attention: str, window: int | None, b: int, s: int, device):
    """The (b, 1, s, s) boolean mask of allowed positions, made once per forward as transformers
    does, or None for the mask-free causal path. Eager attention always needs one; so does a
    sliding window (Mistral: i-window < j <= i) once the sequence reaches the window."""
    if attention == "sdpa" and (window is None or s < window):
        return None
    i = torch.arange(s, device=device)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed = allowed & (i[None, :] > i[:, None] - window)
    return allowed.expand(b, 1, s, s)


def causal_lm_loss(logits, labels, ignore_index: int = -100):
    """Mean next-token cross entropy in fp32 (as transformers' ForCausalLMLoss computes it)."""
    shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), shift.view(-1),
                           ignore_index=ignore_index)


def _init_weights(m: nn.Module):
    # GPT-2 / Llama initialisation: N(0, 0.02) for matrices and embeddings, zero biases.
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, Experts):
        nn.init.normal_(m.gate_up_proj, std=0.02)
        nn.init.normal_(m.down_proj, std=0.02)


def build_decoder(cfg: DecoderConfig | str, device="cpu", dtype=None, attention: str = "sdpa",
                  seed: int | None = 0) -> Decoder:
    """Our implementation of a preset (by name) or shape; seeded for reproducible weights."""
    if isinstance(cfg, str):
        cfg = get_preset(cfg)
    if cfg.qk_norm or cfg.head_size:      # MoE blocks are Mixtral's (Qwen3-MoE, OLMoE add query/key norms)
        raise HybridError(f"hybrid's own decoder has no query/key norms or head size ({cfg.hf_model_type}): use the "
                          "transformers implementation (--implementation transformers; pip install 'hybrid[hf]')")
    if seed is not None and torch.device(device).type != "meta":
        torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        return Decoder(cfg, attention=attention)


def prepare_for_training(model: nn.Module) -> None:
    """HF models build a KV cache in forward unless told not to: in training it only costs memory,
    and recomputation (checkpointing) would see the cache the first forward filled."""
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "use_cache", False):
        cfg.use_cache = False


def build_hf(cfg: DecoderConfig, device="meta", attention: str = "sdpa", dtype=None):
    """The transformers model of this shape (random weights), or ImportError if not installed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(cfg.hf_config())
    with published_rope():
        hf_cfg = AutoConfig.for_model(hf.pop("model_type"), **hf)
        with torch.device(device), default_dtype(dtype):
            return AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=attention,
                                                    dtype=dtype or torch.float32)


ROPE_LOGGER = "transformers.modeling_rope_utils"
_EQUAL_FACTORS = re.compile(r"^`rope_parameters`'s high_freq_factor field must be greater than low_freq_factor, "
                            r"got high_freq_factor=(\S+) and low_freq_factor=(\S+)$")


class _PublishedRope(logging.Filter):
    """Drops transformers' llama3-rope warning where the two factors are equal, and only there."""

    def filter(self, record: logging.LogRecord) -> bool:
        m = _EQUAL_FACTORS.match(record.getMessage())
        return m is None or m.group(1) != m.group(2)


@contextlib.contextmanager
def published_rope():
    """Configs built here (a preset, a config.json, a read module built again) without transformers'
    warning that a llama3 rope block's high_freq_factor is not above its low_freq_factor, when they
    are equal: Llama 4's released config.json has both 1.0 (meta-llama/Llama-4-Scout-17B-16E), a step
    between the frequencies kept and those divided by `factor` that transformers computes as released
    (_compute_llama3_parameters: the smoothing band between the two wavelengths is empty), and
    transformers 5 repeats the warning on every config it builds from it (its validator only warns).
    Every other rope warning, a high_freq_factor below low_freq_factor included, still shows. Nothing
    in the config is changed."""
    quiet = _PublishedRope()
    logger = logging.getLogger(ROPE_LOGGER)
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


@contextlib.contextmanager
def default_dtype(dtype):
    """Build parameters directly in `dtype` (no .to() afterwards, which fake tensors refuse)."""
    if dtype is None:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
