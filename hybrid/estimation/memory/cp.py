"""Context parallelism in the estimates (pure): what a cp rank keeps and what it exchanges.

A cp rank runs every block, the head and the loss on S / cp tokens of each sequence (its two of
the 2cp chunks, hybrid/runtime/backends/cp.py), so each per-token activation term and the logits are the
ones of a sequence S / cp long. Attention is where the method shows: each layer all-gathers the
whole sequence's K and V (Llama 3's method, arXiv 2407.21783 §3.3) and SDPA keeps them for its
backward instead of the rank's own K and V: 2 x b x S x kv_dim in the compute dtype per layer,
less the rank's S / cp share the plain layer already counts. The rank's two query chunks run as
two SDPA calls whose outputs are concatenated: o_proj keeps that concatenation (b x S/cp x h)
besides SDPA's own two outputs, where a single SDPA's output is also o_proj's input (seen in the
traced runs: a clone per layer). Under any recomputation (full, selective, op: neither the gather
nor the concatenation is an op they keep) these exist only while the block is recomputed; layer:N
keeps them in the blocks it does not recompute.

Communication per layer and micro-batch: the forward all-gather of K and V (each rank receives
(cp-1)/cp of the gathered bytes), the backward reduce-scatter of their gradients (the same bytes),
and with recomputation the forward all-gather once more in backward; the runtime issues them
synchronously (no overlap with compute), so all of it is exposed.
"""
from __future__ import annotations

from dataclasses import replace

from ...errors import HybridError
from ...model.presets import DecoderConfig
from ...config.spec import TrainSpec, layer_every
from .activations import ActivationTerms, checkpointed_blocks

LONG_SEQ = 16384
"""Sequences at least this long make the planner try cp > 1 (unless --cp pins it): below, the
activations rarely force it, and every cp rank pays the K/V exchange."""


# --- the layout of a sequence (runtime/backends/cp.py runs it) ----------------------------------------
def rank_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2cp) rank `rank` of a cp group holds: an early one and its mirror."""
    return rank, 2 * cp - 1 - rank


def rank_positions(seq: int, cp: int, rank: int) -> list[int]:
    """Global positions of the tokens a cp rank holds, in the order it holds them."""
    if seq % (2 * cp):
        raise HybridError(f"context parallelism cp {cp} cuts each sequence into {2 * cp} equal chunks, and the "
                          f"sequence length {seq} is not divisible by {2 * cp}; use a sequence length that is")
    L = seq // (2 * cp)
    return [c * L + i for c in rank_chunks(cp, rank) for i in range(L)]


def query_key_pairs(seq: int, cp: int) -> list[int]:
    """Causal query-key pairs each cp rank's attention computes (a query at position p sees p + 1
    keys): equal on every rank, which is what the chunk layout is for."""
    return [sum(p + 1 for p in rank_positions(seq, cp, r)) for r in range(cp)]


def gathered_kv_bytes(d: DecoderConfig, spec: TrainSpec, cp: int, tp: int = 1, autocast: bool = False) -> float:
    """Bytes of one layer's gathered K and V beyond the rank's own (b x S x kv_dim each, the
    rank's kv heads / tp), in the compute dtype (bf16 under autocast)."""
    c = 2 if autocast else spec.bytes.compute
    return 2 * c * spec.micro_batch * spec.seq_len * d.kv_dim / tp * (1 - 1 / cp)


def concatenated_output_bytes(d: DecoderConfig, spec: TrainSpec, cp: int, tp: int = 1, autocast: bool = False) -> float:
    """Bytes of one layer's concatenated attention output (b x S/cp x h / tp, compute dtype)."""
    c = 2 if autocast else spec.bytes.compute
    return c * spec.micro_batch * spec.seq_len / cp * d.hidden / tp


def with_gathered_kv(act: ActivationTerms, d: DecoderConfig, spec: TrainSpec, cp: int, tp: int,
                     autocast: bool) -> ActivationTerms:
    """Add the gathered K and V and the concatenated attention output to a cp rank's activation
    terms (spec: the whole sequence)."""
    if cp == 1:
        return act
    extra = gathered_kv_bytes(d, spec, cp, tp, autocast) + concatenated_output_bytes(d, spec, cp, tp, autocast)
    mode = spec.activation_checkpointing
    if mode == "none":
        kept = extra
    elif mode.startswith("layer:"):
        k = checkpointed_blocks(d.layers, layer_every(mode))
        kept = extra * (d.layers - k) / d.layers
    else:
        kept = 0.0
    redone = extra if mode != "none" else 0.0
    return replace(act, per_layer=int(act.per_layer + kept), recompute=int(act.recompute + redone))


def kv_exchange_bytes(d: DecoderConfig, spec: TrainSpec, tp: int = 1) -> float:
    """Bytes of one layer's gathered K and V for one micro-batch (the all-gather's output)."""
    return 2 * spec.bytes.compute * spec.micro_batch * spec.seq_len * d.kv_dim / tp


def kv_collectives_per_layer(spec: TrainSpec) -> int:
    """Collectives of that size per layer and micro-batch: the forward all-gather, the backward
    reduce-scatter, and the all-gather again when the block is recomputed."""
    return 3 if spec.activation_checkpointing != "none" else 2
