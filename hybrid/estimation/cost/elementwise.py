"""Memory-bound elementwise traffic of a decoder step, eager and compiled (pure, no torch).

The matmuls and attention run near the tensor cores' peak; between them a block runs norms,
rotary embeddings, activations and residual adds that each read their inputs from HBM and write
their outputs back, so they take bytes / bandwidth, not FLOPs / peak. Eager PyTorch runs each op
as its own kernel (every intermediate makes a round trip through HBM); torch.compile fuses each
chain into one kernel that reads the chain's inputs once and writes what leaves it (inductor's
pointwise/reduction fusion). Counted per token, op by op, from our models' code (hybrid/model/decoder.py)
and transformers' Llama/GPT-2 (the same ops):

eager, per block forward (c: compute dtype bytes, 4: fp32):
  RMSNorm  x.float(): r c, w 4; pow: r 4, w 4; mean: r 4; x * rsqrt: r 4, w 4; .to(): r 4, w c;
           weight *: r c, w c                                 -> (7 * 4 + 4c) h per norm, two norms
  LayerNorm (gpt2) one fused kernel in eager: r c, w c        -> 2c h per norm
  rotary   q * cos: r, w; rotate_half: neg r/2 w/2, cat r w; * sin: r, w; add: 2r, w -> 10c (h + kv)
  residual two adds: 2r, w                                    -> 6c h
  SwiGLU   silu: r, w; * up: 2r, w                             -> 5c f
  gelu_new (gpt2) pow, mul, add, mul, tanh, add, mul, mul       -> about 8 ops x 2.5c f = 20c f
compiled, per block forward (inductor fuses each chain between two matmuls):
  residual add + norm: r 2c, w 2c (the sum and the normalised output) -> 4c h per norm
  rotary on q and k: r, w                                     -> 2c (h + kv)
  SwiGLU (silu * up) / gelu: r gate and up, w product         -> 3c f (gpt2: r, w: 2c f)
backward: each op reads its output gradient and the saved inputs and writes its input gradients,
about twice its forward traffic (for y = f(x): r dy, x, w dx = 3 elements against 2).
The loss over the vocabulary V: eager logits.float() r c w 4, log_softmax r 4 w 4 -> (c + 12) V
forward, and backward's scatter w 4, log_softmax backward r 8 w 4, cast r 4 w c -> (20 + c) V;
compiled: r c, w 4 forward, r 4, w c backward (one kernel each).
"""
from __future__ import annotations

from ...model.presets import DecoderConfig

F32 = 4
BACKWARD = 2.0
"""Backward elementwise traffic over forward's (see the module docstring)."""


def block_bytes(d: DecoderConfig, c: int, compiled: bool) -> tuple[float, float]:
    """(forward, backward) elementwise HBM bytes per token of one block."""
    h, kv, f = d.hidden, d.kv_dim, d.ffn
    llama = d.style == "llama"
    if compiled:
        fwd = 2 * 4 * c * h + (2 * c * (h + kv) if llama else 0) + (3 * c * f if llama else 2 * c * f)
    else:
        norms = 2 * ((7 * F32 + 4 * c) * h if llama else 2 * c * h)
        rotary = 10 * c * (h + kv) if llama else 0
        mlp = 5 * c * f if llama else (20 * c * f if d.gelu == "new" else 2 * c * f)
        fwd = norms + rotary + 6 * c * h + mlp
    return fwd, BACKWARD * fwd


def _linear_widths(d: DecoderConfig) -> tuple[int, int]:
    """(input, output) elements per token summed over a block's converted linears."""
    h, kv, f = d.hidden, d.kv_dim, d.ffn
    llama = d.style == "llama"
    inputs = (3 * h + h + 2 * h + f) if llama else (h + h + h + f)      # q, k, v, o, gate, up, down | qkv, o, fc, proj
    outputs = (h + 2 * kv + h + 2 * f + h) if llama else (h + 2 * kv + h + f + h)
    return inputs, outputs


def float8_cast_bytes(d: DecoderConfig, c: int, recipe: str = "tensorwise") -> float:
    """Per token per block, forward and backward, the casts of each converted linear's activations.
    tensorwise (torchao.float8): amax (read c) and cast (read c, write 1) of the input in forward,
    of the output gradient and again of the input (for the weight gradient) in backward.
    mxfp8 (torchao's mx_mm): each cast computes its 32-element blocks' scales in the same pass (read
    c, write 1 and 1/32 of a scale byte), along both dims: the input along dim0 in forward and dim1
    for the weight gradient, the output gradient along dim0 and dim1 in backward."""
    inputs, outputs = _linear_widths(d)
    if recipe == "mxfp8":
        return (c + 1 + 1 / 32) * 2 * (inputs + outputs)
    return (2 * c + 1) * (2 * inputs + outputs)


def loss_bytes(vocab: int, c: int, compiled: bool, kind: str = "eager",
               vocab_parallel: bool = False) -> tuple[float, float]:
    """(forward, backward) elementwise HBM bytes per token of the loss over the vocabulary, by
    TrainSpec.loss. chunked: eager's, plus each chunk's forward again in backward (its
    checkpointed recomputation). fused: Liger's cross-entropy kernel reads each chunk's
    logits once and writes their gradient in place (r c, w c), backward none (a loss gradient of 1
    scales nothing); `vocab_parallel` (tensor parallelism): Megatron-LM's vocab-parallel cross-entropy: the fp32 copy
    (r c, w 4), the in-place shift and exp (r 4, w 4), the sum (r 4), the normalisation (r 4, w
    4); backward in place (r 4, w 4) and the cast (r 4, w c)."""
    if kind == "fused":
        if vocab_parallel:
            return (c + 6 * F32) * vocab, (3 * F32 + c) * vocab
        return 2 * c * vocab, 0.0
    fwd, bwd = ((c + F32) * vocab, (F32 + c) * vocab) if compiled else ((c + 3 * F32) * vocab, (5 * F32 + c) * vocab)
    return fwd, bwd + (fwd if kind == "chunked" else 0.0)
