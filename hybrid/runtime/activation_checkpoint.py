"""Activation checkpointing of a model's blocks as torchtitan applies it: full, selective (torch's
selective-checkpoint policy: matmuls saved, the rest recomputed), per-op, or every N-th block."""
from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.nn as nn

from ..errors import HybridError
from ..model.profile import find_blocks


_EXPERTS = threading.local()


@contextlib.contextmanager
def routed_experts():
    """Around routed experts that run as plain matmuls (runtime/backends/ep.py: each local expert's two
    linears): the selective and per-op policies recompute them, as they do the grouped matmuls experts
    run without expert parallelism, and do not count them; kept, they would be every routed pair's
    gate/up and down outputs per layer (Mixtral 8x7B at 4K tokens, ep 8: 21 GiB a rank)."""
    depth = getattr(_EXPERTS, "depth", 0)
    _EXPERTS.depth = depth + 1
    try:
        yield
    finally:
        _EXPERTS.depth = depth


def _in_experts() -> bool:
    return getattr(_EXPERTS, "depth", 0) > 0


def _selective_policy():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    names = ("mm", "addmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    save = {getattr(aten, n).default for n in names if hasattr(aten, n)}

    def policy(ctx, op, *args, **kwargs):
        keep = op in save and not _in_experts()
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def _op_context():
    """torchtitan's per-op selective policy, fresh per checkpointed call (its matmul counter
    restarts in every block): keep the outputs of the 1st, 3rd, 5th... aten.mm and of attention,
    recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    attention = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        if _in_experts():
            return CheckpointPolicy.PREFER_RECOMPUTE
        if op is aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            keep = counts[key] % 2 == 1
        else:
            keep = op in attention
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Recompute blocks in backward: 'full' keeps only each block's input, 'selective' keeps
    matmul and attention outputs too, 'op' keeps every second matmul output and attention's
    (torchtitan's per-op policy), 'layer:N' recomputes every N-th block fully (blocks 0, N,
    2N...). The block's forward is replaced on the instance, so module and parameter names stay
    exactly the user's (checkpoints stay portable). Returns the number of checkpointed blocks."""
    if mode == "none":
        return 0
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

    from ..config.spec import recomputed_blocks
    blocks = find_blocks(model)[1]
    if not blocks:
        raise HybridError(f"activation checkpointing {mode!r} needs repeated blocks to recompute, and "
                          f"{type(model).__name__} has none (no _no_split_modules, no ModuleList of one class)")
    if mode == "selective":
        policy = _selective_policy()
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    elif mode == "op":
        context_fn = _op_context
    else:
        context_fn = noop_context_fn
    blocks = [b for b, redone in zip(blocks, recomputed_blocks(mode, len(blocks))) if redone]
    for block in blocks:
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            # full: the default context (torch.compile traces checkpoint only with that one, by identity)
            if context_fn is noop_context_fn:
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
        block.forward = forward
    return len(blocks)
