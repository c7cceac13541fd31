"""A model's blocks cut into pipeline stage modules, under the model's own names: our Decoder and the
transformers decoder-only models (the stage split itself is planning/stages.py's)."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import HybridError
from ..model.decoder import Decoder, causal_mask, rope_tables


class DecoderStage(nn.Module):
    """Blocks [lo, hi) of a Decoder as one pipeline stage, under the model's own names (embed,
    blocks.<i>, norm, lm_head): the first stage takes token ids and embeds them, the last returns
    logits, the others map hidden states to hidden states. It holds the model's modules (no
    copies): a tied embedding and head are the same Parameter on the first and last stage."""

    def __init__(self, model: Decoder, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.config, self.first, self.last = model.config, first, last
        self._no_split_modules = [type(model.blocks[0]).__name__]      # the unit, even with one block
        if first:
            self.embed = model.embed
            self.pos_embed = model.pos_embed
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if last:
            self.norm, self.lm_head = model.norm, model.lm_head
        self._attention = model.blocks[0].attn.attention
        self.tp_mesh = None
        """Set by tensor parallelism: the residual stream (between blocks, and across the stage
        boundary) is then this rank's sequence shard, as sequence parallelism keeps it."""
        if model.config.style == "llama":
            self.register_buffer("inv_freq", model.inv_freq, persistent=False)

    def forward(self, x):
        cfg = self.config
        b, s = x.shape[0], x.shape[1]
        if self.first:
            x = self.embed(x)
            if self.pos_embed is not None:
                x = x + self.pos_embed(torch.arange(s, device=x.device))
        elif self.tp_mesh is not None:          # this rank's sequence shard of the residual stream
            s *= self.tp_mesh.size()
        rope = rope_tables(self.inv_freq, s, x.dtype, x.device) if cfg.style == "llama" else None
        mask = causal_mask(self._attention, cfg.sliding_window, b, s, x.device)
        for block in self.blocks.values():
            x = block(x, rope, mask)
        return self.lm_head(self.norm(x)) if self.last else x


class HFDecoderStage(nn.Module):
    """The same for a transformers decoder-only model (Llama, Mistral, Qwen2: model.embed_tokens,
    model.layers, model.norm, model.rotary_emb, lm_head), under its own names. Causal attention
    without padding masks (SDPA's is_causal path), as pre-training batches are."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        from ..model.tp_plan import HFPlan
        inner = model.model
        self.config, self.first, self.last = model.config, first, last
        self._no_split_modules = list(getattr(model, "_no_split_modules", None) or [type(inner.layers[0]).__name__])
        self.hf_plan = HFPlan.of(model)
        """What the whole model says about splitting it (a stage holds only some of its parts)."""
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = inner.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): inner.layers[i] for i in range(lo, hi)})
        self.model.rotary_emb = inner.rotary_emb
        if last:
            self.model.norm, self.lm_head = inner.norm, model.lm_head
        self.tp_mesh = None
        """Set by tensor parallelism: past the first stage's embedding the residual stream (across the
        stage boundary too) is this rank's sequence shard, as sequence parallelism keeps it."""

    def forward(self, x):
        s = x.shape[1]                          # the first stage's token ids: the whole sequence
        if self.first:
            x = self.model.embed_tokens(x)
        elif self.tp_mesh is not None:          # this rank's sequence shard of the residual stream
            s *= self.tp_mesh.size()
        pos = torch.arange(s, device=x.device).unsqueeze(0)
        rope = self.model.rotary_emb(x, pos)
        for layer in self.model.layers.values():
            out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=rope)
            x = out[0] if isinstance(out, tuple) else out
        return self.lm_head(self.model.norm(x)) if self.last else x


def pipeline_stage(model: nn.Module, lo: int, hi: int, first: bool, last: bool) -> nn.Module:
    """Blocks [lo, hi) of `model` as a stage module, or a HybridError naming what is supported."""
    if isinstance(model, Decoder):
        return DecoderStage(model, lo, hi, first, last)
    inner = getattr(model, "model", None)
    if all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) and hasattr(model, "lm_head"):
        return HFDecoderStage(model, lo, hi, first, last)
    raise HybridError(f"pipeline stages are cut from hybrid's decoders and transformers decoder-only models "
                      f"(model.embed_tokens, model.layers, model.norm, lm_head); {type(model).__name__} is neither: "
                      "use pp 1")
