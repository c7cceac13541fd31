"""torch.compile as torchtitan applies it: each transformer block compiled on its own
(`fullgraph=True`; repeated blocks share one compiled graph, so compile time does not grow with
depth) after activation checkpointing and before the data-parallel wrap, and the loss compiled
(torchtitan's `build_loss_fn` under `compile.components = ["model", "loss"]`). FSDP2's hooks stay
eager (torch._dynamo.config.skip_fsdp_hooks), so its all-gathers are not traced into the blocks.

On CPU ranks the blocks compile with inductor's C++ backend, on CUDA with Triton.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ..errors import HybridError
from ..model.profile import find_blocks


def apply_compile(model: nn.Module, spec) -> int:
    """Compile every repeated block of `model` in place, and our decoders' loss, when spec.compile;
    returns the number of compiled blocks (0 when compile is off)."""
    if not getattr(spec, "compile", False):
        return 0
    blocks = find_blocks(model)[1]
    if not blocks:
        raise HybridError(f"compile compiles the repeated blocks, and {type(model).__name__} has none (no "
                          "_no_split_modules, no ModuleList of one class): compile the model yourself and pass "
                          "compile=False")
    for block in blocks:
        compile_block(block)
    if getattr(type(model), "loss_fn", None) is not None:        # our Decoder / DecoderStage
        from ..model.decoder import causal_lm_loss
        model.loss_fn = torch.compile(causal_lm_loss)
    return len(blocks)


SKIP_SIDE_EFFECTS = "skip_fwd_side_effects_in_bwd_under_checkpoint"
"""dynamo's flag compile_block sets (torch 2.13 has it; torch >= 2.6 is supported, so it is looked up)."""


def compile_block(block: nn.Module, **kwargs) -> None:
    """Compile one block in place (fullgraph; `kwargs` to torch.compile: a backend, dynamic), with
    dynamo's skip_fwd_side_effects_in_bwd_under_checkpoint on while it traces the block. A
    checkpointed block whose forward mutates Python state outside it is otherwise refused by
    dynamo, since eager checkpointing replays the mutation when it recomputes and a compiled
    backward cannot: transformers' attention (Qwen2, Qwen3, Gemma 3, granite...), under the
    `kernels` package's use_kernelized_func, sets a context variable for its forward and resets it
    on return (kernels/_internals/layer/layer.py), which leaves nothing to replay. The flag is
    dynamo's, read when the block is traced (CheckpointHigherOrderVariable), so it is set around
    this block's calls only."""
    block.compile(fullgraph=True, **kwargs)
    compiled = block._compiled_call_impl           # nn.Module.compile's: what __call__ runs

    if not hasattr(torch._dynamo.config, SKIP_SIDE_EFFECTS):   # a torch before the flag: nothing to set
        return

    @functools.wraps(compiled)
    def call(*args, **kw):
        with torch._dynamo.config.patch(**{SKIP_SIDE_EFFECTS: True}):
            return compiled(*args, **kw)
    block._compiled_call_impl = call
