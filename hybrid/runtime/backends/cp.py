"""Context parallelism: every sequence split over the cp ranks, attention by all-gathered K and V.

Each sequence of S tokens is cut into 2cp chunks of L = S / 2cp; rank r of a cp group holds chunks
r and 2cp-1-r (an early and a late one), so under the causal mask every rank attends the same
number of query-key pairs (`query_key_pairs`). Embeddings, norms, MLPs and the head run on the
rank's 2L tokens; RoPE (or learned positions) take the tokens' global positions, and the labels
are shifted on the whole sequence before they are cut, so no label crosses a chunk boundary.

Attention is Llama 3's method (arXiv 2407.21783 §3.3): each layer all-gathers K and V over the cp
group (autograd: the backward reduce-scatters their gradients), puts the chunks back in sequence
order, and runs SDPA for each of the rank's two query chunks against the keys before it with a
lower-right causal mask (torch.nn.attention.bias.causal_lower_right: on CUDA the flash and
memory-efficient kernels take it without materialising a mask; on CPU it is materialised). The
same code runs on CPU ranks (gloo) and GPUs (nccl); torch's ring attention (`context_parallel`)
is not used: it shards buffers inside a context that must enclose forward and backward, which our
split `w(batch)` / `w.backward(loss)` loop does not, and it has no CPU kernels.

The loss is the mean over every label of the sequence: each rank backpropagates cp x its share
(sum of its tokens' losses / the sequence's label count), so the data-parallel mean over
dp x cp ranks that DDP and FSDP take is the gradient of the whole sequence's mean; the value every
rank returns is the whole sequence's mean (one scalar all-reduce over the cp group).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ...errors import HybridError
from ..mesh import released, traced_group
from ...estimation.memory.cp import rank_chunks, rank_positions

IGNORE = -100
"""The label that is not scored (transformers' and torch's ignore_index)."""
ATTENTION_NAME = "hybrid_cp"
"""The name our attention function is registered under in transformers' AttentionInterface."""
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""transformers models whose attention is plain causal SDPA with RoPE from position_ids (Qwen3's
q/k norms run per head before it)."""


# --- the K/V all-gather with autograd ------------------------------------------------------------
class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim (2) of (b, heads, s, d) tensors, in rank order; backward
    sums every rank's gradient of this rank's slot (a reduce-scatter; all-reduce and slice where
    the backend has no reduce-scatter: gloo)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.n, ctx.rank = n, rank
        parts, x = [torch.empty_like(x) for _ in range(n)], x.contiguous()
        with released(group, x, *parts):
            dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(grad.chunk(ctx.n, dim=2)[0])
            dist.reduce_scatter(out, [g.contiguous() for g in grad.chunk(ctx.n, dim=2)], group=ctx.group)
            return out, None
        with released(ctx.group, grad):
            dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.n, dim=2)[ctx.rank].contiguous(), None


def _in_sequence_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """Rank-ordered pieces [chunk r, chunk 2cp-1-r] back in sequence order (chunk 0 .. 2cp-1)."""
    pieces = gathered.chunk(cp, dim=2)
    halves = [p.chunk(2, dim=2) for p in pieces]
    return torch.cat([halves[c][0] if c < cp else halves[2 * cp - 1 - c][1] for c in range(2 * cp)], dim=2)


_BIASES: dict = {}


def lower_right_bias(q_len: int, kv_len: int):
    """torch's lower-right causal bias for q_len queries ending where kv_len keys end, made once
    per shape: a tensor subclass that cannot be created under a Python dispatch mode (selective
    checkpointing's, a memory tracker's: "the raw Tensor object is already associated to a python
    object"), so it is made outside every mode (it holds no data), and ContextParallel.forward makes
    the rank's two before the model runs."""
    key = (q_len, kv_len)
    if key not in _BIASES:
        from torch.nn.attention.bias import causal_lower_right
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            _BIASES[key] = causal_lower_right(q_len, kv_len)
    return _BIASES[key]


def cp_attention(q, k, v, group, scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's query chunks (q: b, heads, 2L, d) over the whole
    sequence's keys and values (k, v: this rank's b, kv_heads, 2L, d; gathered here). Returns
    (b, heads, 2L, d) in the rank's token order."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    L = q.shape[2] // 2
    keys = _in_sequence_order(_GatherSequence.apply(k, group), cp)
    values = _in_sequence_order(_GatherSequence.apply(v, group), cp)
    gqa = q.shape[1] != k.shape[1]
    # a traced estimate (fake process group, fake tensors: shapes only) runs the mask-free causal
    # kernel, which saves what CUDA's flash kernel saves when it takes the lower-right mask (q, k,
    # v, output, logsumexp); the CPU kernel would materialise the mask a GPU never holds
    traced = traced_group(group)
    out = []
    for half, chunk in enumerate(rank_chunks(cp, rank)):
        end = (chunk + 1) * L                         # the keys at or before this chunk's last query
        qc = q[:, :, half * L:(half + 1) * L]
        mask = dict(is_causal=True) if traced else dict(attn_mask=lower_right_bias(L, end))
        out.append(F.scaled_dot_product_attention(qc, keys[:, :, :end], values[:, :, :end], scale=scale,
                                                  enable_gqa=gqa, **mask))
    return torch.cat(out, dim=2)


def hf_cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature (AttentionInterface): (b, s, heads, d) out."""
    group = getattr(module, "cp_group", None)
    if group is None:
        raise HybridError(f"{type(module).__name__}: attention '{ATTENTION_NAME}' runs only on modules "
                          "auto_wrap(cp=N) prepared")
    if dropout:
        raise HybridError("context parallelism: attention dropout is not supported; set attention_dropout=0")
    return cp_attention(query, key, value, group, scale=scaling).transpose(1, 2).contiguous(), None


# --- applying it to a model ------------------------------------------------------------------------
def _ours(model) -> bool:
    """hybrid's own Decoder (found by its config, so this module imports no model code)."""
    from ...model.presets import DecoderConfig
    return isinstance(getattr(model, "config", None), DecoderConfig)


def _window(model) -> int | None:
    if _ours(model):
        return model.config.sliding_window
    cfg = model.config
    if cfg.model_type in ("qwen2", "qwen3") and not getattr(cfg, "use_sliding_window", False):
        return None
    return getattr(cfg, "sliding_window", None)


def check_context_parallel(model: nn.Module, cp: int, seq_len: int) -> None:
    """A one-line HybridError (the reason) when this model cannot run context parallel."""
    hf_type = getattr(getattr(model, "config", None), "model_type", None)
    if not _ours(model) and hf_type not in MODEL_TYPES:
        raise HybridError(f"context parallelism needs attention it can split by sequence position (hybrid's "
                            f"decoders, transformers {', '.join(MODEL_TYPES)}); {type(model).__name__} is "
                            "unknown: use cp 1")
    window = _window(model)
    if window is not None and window < seq_len:
        raise HybridError(f"context parallelism: sliding-window attention (window {window} < sequence "
                            f"{seq_len}) is not a causal mask over the whole sequence; use cp 1")
    if seq_len % (2 * cp):
        raise HybridError(f"cp {cp} cuts each sequence into {2 * cp} equal chunks; sequence length {seq_len} "
                            f"is not divisible by {2 * cp}")


def _own_config(model: nn.Module):
    """A copy of the model's config in place of the one its modules share, so that what context
    parallelism sets on it leaves the user's config object as it was (another model built from it
    runs as before)."""
    old = model.config
    new = copy.copy(old)
    for m in model.modules():
        if getattr(m, "config", None) is old:
            m.config = new
    return new


def _register_hf_attention() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION_NAME, hf_cp_attention)


class ContextParallel:
    """What Wrapped needs to run a context-parallel model: cut the batch, call, score the loss."""

    def __init__(self, model: nn.Module, cp_mesh):
        self.group = cp_mesh.get_group()
        self.size, self.rank = cp_mesh.size(), cp_mesh.get_local_rank()
        self.hf = not _ours(model)
        for m in model.modules():           # every attention module learns its cp group
            if hasattr(m, "q_proj") or hasattr(m, "qkv_proj"):
                m.cp_group, m.cp_attention = self.group, cp_attention
        if self.hf:
            _register_hf_attention()
            _own_config(model)._attn_implementation = ATTENTION_NAME

    def positions(self, seq: int, device) -> torch.Tensor:
        return torch.tensor(rank_positions(seq, self.size, self.rank), device=device)

    def forward(self, engine, args, kwargs):
        """The model on this rank's chunks of the whole sequences in `args`/`kwargs` (token ids
        and optional labels, the same on every rank of the cp group); the output's loss is the
        mean over every label of the sequences, its logits this rank's chunks."""
        ids, labels = _parse(args, kwargs)
        pos = self.positions(ids.shape[1], ids.device)
        L = ids.shape[1] // (2 * self.size)
        if not traced_group(self.group):
            for chunk in rank_chunks(self.size, self.rank):
                lower_right_bias(L, (chunk + 1) * L)
        local = ids.index_select(1, pos)
        if self.hf:
            out = engine.forward(input_ids=local, position_ids=pos.unsqueeze(0))
        else:
            out = engine.forward(local, position_ids=pos)
        if labels is None:
            return out
        shifted = F.pad(labels, (0, 1), value=IGNORE)[..., 1:]      # shift on the whole sequence first
        target = shifted.index_select(1, pos).reshape(-1)
        count = (shifted != IGNORE).sum().clamp(min=1)              # the sequences' labels, every rank alike
        logits = out.logits
        with engine._tp_context():
            mine = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target, ignore_index=IGNORE,
                                   reduction="sum")
        if hasattr(mine, "full_tensor"):
            mine = mine.full_tensor()
        total = mine.detach().clone()
        dist.all_reduce(total, group=self.group)
        # value: the sequences' mean; gradient: cp x this rank's share (the dp x cp mean restores it)
        loss = (self.size * mine + (total - self.size * mine.detach())) / count
        if isinstance(out, dict):       # transformers' ModelOutput: item and attribute alike
            out["loss"] = loss
        else:
            out.loss = loss
        return out


def _parse(args, kwargs):
    from collections.abc import Mapping
    if len(args) == 1 and not kwargs and isinstance(args[0], Mapping):
        kwargs, args = dict(args[0]), ()
    kwargs = dict(kwargs)
    ids = args[0] if args else kwargs.pop("input_ids", None)
    labels = args[1] if len(args) > 1 else kwargs.pop("labels", None)
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(torch.all(mask != 0)):
        raise HybridError("context parallelism takes whole unpadded sequences: an attention_mask with padding "
                          "cannot be split by position; pack the sequences or use cp 1")
    extra = sorted(k for k, v in kwargs.items() if v is not None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or extra or len(args) > 2:
        raise HybridError("with cp > 1, call the model with whole sequences: w(input_ids) or w(input_ids, "
                          "labels=...) or w({'input_ids': ..., 'labels': ...}), (batch, seq) token ids"
                          + (f"; got extra arguments {extra}" if extra else ""))
    return ids, labels
