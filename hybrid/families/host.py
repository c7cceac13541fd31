"""Host work per step that the byte and FLOP terms do not price (pure): how many collectives a
layout launches and how many parameter tensors the frameworks touch one by one.

Each collective call pays a fixed launch and rendezvous time whatever its size (the Python and
c10d dispatch around it, the ranks meeting; on GPUs NCCL's launch), and each per-tensor host
operation (an optimizer's per-tensor loop, DeepSpeed's per-parameter hooks) a fixed Python time.
The families count them (`Family.host`); a calibration fits the seconds of each
(GPUSpec.collective_overhead, GPUSpec.tensor_overhead: 0 in the catalogue, which has no measured
figure for them) by least squares over its trials (hybrid/estimation/calibration.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    """One optimizer step's host work on one rank."""

    calls: float = 0.0
    """Collective calls (all-reduce buckets, all-gathers, reduce-scatters) per step."""
    tensors: float = 0.0
    """Per-parameter-tensor host operations per step (an optimizer loop over tensors, hooks)."""

    def __add__(self, other: "Host") -> "Host":
        return Host(self.calls + other.calls, self.tensors + other.tensors)


def param_tensors(profile, stage=None) -> tuple[int, ...]:
    """Elements of each parameter tensor, in registration order (a tied head counted once). From
    the decoder's shape (hybrid/model/decoder.py builds the same tensors as transformers' Llama and GPT-2);
    without one, each unit and the root as one tensor (all the profile knows). `stage`: a pipeline
    rank's shares.StageShare (its blocks, the embedding on the first, the head on the last)."""
    d, st = profile.decoder, stage
    if d is None:
        units = [profile.block_params] * profile.num_blocks
        return tuple(x for x in [profile.root_params or profile.params, *units] if x > 0)
    h, kv, q, f = d.hidden, d.kv_dim, d.q_dim, d.ffn
    gpt2 = d.style == "gpt2"
    norm = [h, h] if gpt2 else [h]                       # LayerNorm weight and bias; RMSNorm weight
    if gpt2:
        attn = [h * (q + 2 * kv), q + 2 * kv, q * h, h]   # fused qkv (+bias), output (+bias)
    else:
        attn = [h * q, h * kv, h * kv, q * h] + ([d.head_dim] * 2 if d.qk_norm == "head" else
                                                 [q, kv] if d.qk_norm == "full" else [])
    if d.experts:
        mlp = [h * d.experts] + [h * d.moe_ffn] * (3 * d.experts)   # router, then gate/up/down per expert
    elif gpt2:
        mlp = [h * f, f, f * h, h]
    else:
        mlp = [h * f, h * f, f * h]
    blocks = st.blocks if st is not None else d.layers
    first = st is None or st.first
    last = st is None or st.last
    head = [] if d.tied and first else [d.vocab * h]
    out = ([d.vocab * h] + ([d.max_positions * h] if gpt2 else [])) if first else []
    out += (norm + attn + norm + mlp) * blocks
    if last:
        out += norm + head
    return tuple(out)


def ipg_buckets(numels, bucket: int) -> int:
    """Reductions DeepSpeed ZeRO issues for one backward: gradients join the bucket in the order
    they are ready (the reverse of registration), and a bucket is reduced before a gradient that
    would take it past `bucket` elements (DeepSpeed 0.19: stage_1_and_2.py
    reduce_independent_p_g_buckets_and_remove_grads, stage3.py __add_grad_to_ipg_bucket), so
    a tensor larger than the bucket is reduced alone."""
    calls, filled = 0, 0
    for x in reversed(numels):
        if filled and filled + x > bucket:
            calls += 1
            filled = 0
        filled += x
    return calls + (1 if filled else 0)
