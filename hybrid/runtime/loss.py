"""The head and loss of our decoders as TrainSpec.loss runs them: chunked (plain torch) or fused
(Liger's fused linear cross-entropy, CUDA). Their memory and time are priced in
hybrid/estimation/memory/activations.loss_terms and hybrid/estimation/cost/elementwise.loss_bytes."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import HybridError
from ..estimation.memory.activations import LOSS_CHUNKS

IGNORE = -100
"""The label that scores nothing (transformers' and torch's ignore_index)."""


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets, flat: position i scores label i + 1 (the last scores nothing)."""
    return F.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1)


def _chunk_sum(head, hidden, target):
    return F.cross_entropy(head(hidden).float(), target, ignore_index=IGNORE, reduction="sum")


def chunked_causal_lm_loss(head, hidden: torch.Tensor, labels: torch.Tensor, chunks: int = LOSS_CHUNKS):
    """The mean next-token cross-entropy of `head(hidden)` computed `chunks` token chunks at a
    time, each chunk's head and loss under activation checkpointing: forward keeps only the
    hidden states, backward recomputes one chunk's logits at a time, so the whole logits never
    exist (torchtune's CEWithChunkedOutputLoss chunks the same way but keeps every chunk's logits).
    Equal to causal_lm_loss(head(hidden), labels)."""
    flat, target = hidden.reshape(-1, hidden.shape[-1]), _shifted(labels)
    total = sum(checkpoint(_chunk_sum, head, h, t, use_reentrant=False)
                for h, t in zip(flat.chunk(chunks), target.chunk(chunks)))
    return total / (target != IGNORE).sum()


def fused_causal_lm_loss(loss_fn, head, hidden: torch.Tensor, labels: torch.Tensor):
    """Liger's fused linear cross-entropy over the head's weight: logits a chunk at a time inside
    forward, never whole."""
    return loss_fn(head.weight, hidden.reshape(-1, hidden.shape[-1]), _shifted(labels), head.bias)


def liger_loss():
    """Liger's LigerFusedLinearCrossEntropyLoss (mean over the scored tokens), or one line saying why not."""
    if not torch.cuda.is_available():
        raise HybridError("loss 'fused' is Liger's fused linear cross-entropy, a Triton kernel for CUDA GPUs; on this "
                          "machine use loss='chunked' (the same memory saving in plain torch)")
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        raise HybridError("loss 'fused' needs liger-kernel: pip install 'hybrid[liger]', or use "
                          "loss='chunked'") from None
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE)


def check_loss(model, spec, split: str | None = None) -> None:
    """What TrainSpec.loss needs of the model (HybridError, one line), before any mesh; `split`
    names the layout's tp, cp and pp where any is above 1 (the loss then runs outside the whole
    model's forward or vocab-parallel)."""
    if spec.loss == "eager":
        return
    from ..model.decoder import Decoder
    if not isinstance(model, Decoder):
        raise HybridError(f"loss {spec.loss!r} replaces the head and loss of hybrid's decoders; a "
                          f"{type(model).__name__} computes its own: use loss='eager'")
    if split is not None:
        raise HybridError(f"loss {spec.loss!r} runs here without tp, cp or pp (tp has its vocab-parallel loss, cp "
                          f"and pp score the loss outside the model's forward): use loss='eager' with {split}")
    if spec.loss == "fused":
        liger_loss()


def apply_loss(model, spec) -> None:
    """Set the decoder's head_loss to the spec's loss (eager: the decoder's own, nothing set)."""
    if spec.loss == "chunked":
        model.head_loss = chunked_causal_lm_loss
    elif spec.loss == "fused":
        model.head_loss = functools.partial(fused_causal_lm_loss, liger_loss())
