"""Our own decoder-only transformer (llama and gpt2 styles), built from a DecoderConfig.

Written to compute what the Hugging Face implementations compute, op for op where it matters for
memory (RMSNorm upcast to fp32, loss on fp32 logits), so the same analytic activation formula
serves both. Builds on any device, including `meta` for 7B+ shapes.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .presets import DecoderConfig, get_preset


@dataclass
class CausalLMOutput:
    """What forward returns: `loss` (when labels were given) and `logits`."""

    loss: torch.Tensor | None
    logits: torch.Tensor


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
        bias = cfg.style == "gpt2"
        self.q_proj = nn.Linear(h, h, bias=bias)
        self.k_proj = nn.Linear(h, kv, bias=bias)
        self.v_proj = nn.Linear(h, kv, bias=bias)
        self.o_proj = nn.Linear(h, h, bias=bias)

    def forward(self, x, rope):
        b, s, _ = x.shape
        a, kvh, d = self.cfg.heads, self.cfg.n_kv_heads, self.cfg.head_dim
        q = self.q_proj(x).view(b, s, a, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, kvh, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, kvh, d).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kvh != a)
        else:
            if kvh != a:
                k = k.repeat_interleave(a // kvh, dim=1)
                v = v.repeat_interleave(a // kvh, dim=1)
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
            y = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, s, a * d))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, f = cfg.hidden, cfg.ffn
        self.style = cfg.style
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
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


def _norm(cfg: DecoderConfig) -> nn.Module:
    if cfg.style == "llama":
        return RMSNorm(cfg.hidden, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)


class Block(nn.Module):
    """One transformer layer: the unit that FSDP shards and checkpointing recomputes."""

    def __init__(self, cfg: DecoderConfig, attention: str):
        super().__init__()
        self.norm1, self.attn = _norm(cfg), Attention(cfg, attention)
        self.norm2, self.mlp = _norm(cfg), MLP(cfg)

    def forward(self, x, rope=None):
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """Token ids in, CausalLMOutput out; `labels` (same shape as ids) give the shifted LM loss."""

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
            inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
            self.register_buffer("inv_freq", inv, persistent=False)
        if self.embed.weight.device.type != "meta":
            self.apply(_init_weights)

    def _rope(self, s: int, dtype: torch.dtype, device):
        if self.pos_embed is not None:
            return None
        t = torch.arange(s, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids, labels=None):
        s = input_ids.shape[1]
        x = self.embed(input_ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(s, device=input_ids.device))
        rope = self._rope(s, x.dtype, x.device)
        for block in self.blocks:
            x = block(x, rope)
        logits = self.lm_head(self.norm(x))
        loss = None if labels is None else causal_lm_loss(logits, labels)
        return CausalLMOutput(loss=loss, logits=logits)


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


def build_decoder(cfg: DecoderConfig | str, device="cpu", dtype=None, attention: str = "sdpa",
                  seed: int | None = 0) -> Decoder:
    """Our implementation of a preset (by name) or shape; seeded for reproducible weights."""
    if isinstance(cfg, str):
        cfg = get_preset(cfg)
    if seed is not None and torch.device(device).type != "meta":
        torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        return Decoder(cfg, attention=attention)


def build_hf(cfg: DecoderConfig, device="meta", attention: str = "sdpa", dtype=None):
    """The transformers model of this shape (random weights), or ImportError if not installed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(cfg.hf_config())
    hf_cfg = AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device(device), default_dtype(dtype):
        return AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=attention,
                                                dtype=dtype or torch.float32)


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
