"""Saved-activation and logits/loss bytes of one micro-batch for a decoder-only transformer.

Counted tensor by tensor from what autograd keeps for our `models.Decoder` and the Hugging Face
Llama/Mistral/GPT-2 implementations (see tests/estimation/test_activations.py, which checks each formula
against the tensors a saved-tensors hook sees). The structure follows Korthikanti et al. 2022
(arXiv 2205.05198, sec. 4.1), whose s*b*h*(34 + 5*a*s/h) is the GPT-3 case with dropout; ours has
no dropout, RMSNorm upcasts to fp32, and SwiGLU keeps four f-wide tensors instead of two.

Two compute regimes:
- native: weights are held in the compute dtype (FSDP2 MixedPrecisionPolicy, DeepSpeed bf16, pure
  bf16, fp32); every activation is in that dtype, c bytes.
- autocast: fp32 weights under torch.autocast(bf16) (DDP bf16-mixed); the residual stream and
  norms stay fp32, each matmul input is cast to bf16 once per consumer, and autocast caches a bf16
  copy of every weight until backward has used it.
All results are bytes per micro-batch (b sequences of s tokens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...model.presets import DecoderConfig
from ...config.spec import TrainSpec, layer_every

# fp32 bytes: RMSNorm's upcast copy, softmax/log-softmax outputs, logsumexp, norm statistics.
F32 = 4


@dataclass(frozen=True)
class ActivationTerms:
    per_layer: int
    """Bytes each block keeps from forward to its backward (after checkpointing)."""
    recompute: int
    """Extra bytes while one checkpointed block is recomputed in backward (0 without checkpointing)."""
    head_forward: int
    """Final norm, logits and log-softmax output alive at the end of forward."""
    head_backward: int
    """Peak of the loss backward: head_forward plus the fp32 gradients of the log-softmax."""
    autocast_cache: int
    """bf16 weight copies autocast holds from forward into backward (autocast regime only)."""
    layers: int
    backward_transient: int = 0
    """Bytes one block's backward holds at the MLP's beyond what the block saved: the gradients of
    its f-wide tensors and the down projection's weight gradient (0 where not modelled: MoE blocks,
    read stacks, compiled blocks)."""
    block_input: int = 0
    """Of per_layer, a checkpointed block's input, which torch.utils.checkpoint saves as the tensor
    itself (on a pipeline stage's first block, the stage's receive buffer); 0 without checkpointing
    (nothing keeps the input) and where not modelled (compiled blocks)."""


def mlp_backward_transient(d: DecoderConfig, spec: TrainSpec, autocast: bool) -> float:
    """Bytes the MLP's backward holds at once beyond the saved activations (autograd's order: the
    down projection, then the product's backward, whose input gradient is freed only after both
    factors' gradients exist): a gated MLP the gradients of the product, the activation's output
    and the up projection (three f-wide), a plain one those of the activation's output and input
    (two f-wide); with the down projection's weight gradient, in the matmuls' dtype. Less the down
    projection's input (f wide, saved by its matmul, or by its LoRA adapter's A where only the
    adapter trains), which autograd frees once that projection's backward has run (a node releases its
    saved tensors after it runs), before these exist: the traced pp 2 stage held it no longer
    (tests/measure/test_matrix.py)."""
    c = 2 if autocast else spec.bytes.compute
    T = spec.micro_batch * spec.seq_len
    wide = 3 if d.style == "llama" else 2
    weight = 0 if spec.lora is not None else d.hidden * d.ffn      # a frozen down projection makes none
    from ...model.lora import closed_reads
    saved = spec.lora is None or "product" in closed_reads(d, spec.lora)
    return c * ((wide - saved) * d.ffn * T + weight)


def _qk_norm(d: DecoderConfig, c: int) -> float:
    """Bytes per token the query/key RMSNorms keep: each one's fp32 input (the upcast; in fp32 the
    input itself), its rsqrt per normalised group and its output cast back to c bytes (measured
    with saved-tensors hooks on transformers' Qwen3-MoE and OLMoE: tests/estimation/test_moe.py)."""
    if d.qk_norm is None:
        return 0
    groups = d.heads + d.n_kv_heads if d.qk_norm == "head" else 2
    return (F32 + c) * (d.q_dim + d.kv_dim) + F32 * groups


def _moe_mlp(d: DecoderConfig, c: int) -> float:
    """Bytes per token an MoE block's experts and router keep (transformers' grouped_mm experts:
    tokens sorted by expert, one grouped matmul per projection). Per routed (token, expert) pair:
    the gathered input and the down projection's output (h each), the gate_up output (2m), its
    SiLU and the product (m each), the fp32 routing weight and four int64 index vectors; per
    token the fp32 router softmax over all experts, and where the top-k weights are renormalised
    (Mixtral, Qwen3-MoE) their fp32 copy and sum. Measured in tests/estimation/test_moe.py."""
    renorm = d.hf_model_type != "olmoe"
    return d.top_k * moe_pair(d, c) + F32 * d.experts + (F32 * (d.top_k + 1) if renorm else 0)


def moe_pair(d: DecoderConfig, c: int) -> float:
    """Bytes one routed (token, expert) pair keeps (see _moe_mlp): what expert parallelism moves
    to the rank that holds the expert, and what routing imbalance multiplies (estimation/memory/moe.py)."""
    return c * (2 * d.hidden + 4 * d.moe_ffn) + F32 + 4 * 8


def _layer_full(d: DecoderConfig, spec: TrainSpec, c: int, autocast: bool) -> float:
    """Bytes per token one block saves with no checkpointing."""
    h, kv, f, a, s = d.hidden, d.kv_dim, d.ffn, d.heads, spec.seq_len
    q = d.q_dim
    llama = d.style == "llama"
    if autocast:
        c = 2
        # RMSNorm: fp32 input + rsqrt + fp32 normalised; LayerNorm: fp32 input + mean + rstd.
        norm = (2 * F32 * h + F32) if llama else (F32 * h + 2 * F32)
        # each consumer of a norm output casts it to bf16 once (q, k, v | fused qkv; gate, up | fc;
        # an MoE block's router: its experts' grouped matmuls are not on autocast's list)
        casts = c * h * ((3 + (1 if d.moe else 2)) if llama else (1 + 1))
        norms = 2 * norm + casts
    else:
        # RMSNorm: fp32 upcast + rsqrt + cast back + weighted output; LayerNorm: input, output, stats.
        norm = (F32 * h + F32 + 2 * c * h) if llama else (2 * c * h + 2 * F32)
        norms = 2 * norm
    masked = d.sliding_window is not None and s >= d.sliding_window
    if spec.attention == "sdpa" and not masked:
        attn = 2 * c * q + 2 * c * kv + F32 * a          # q, k, v, output; logsumexp per head
    elif spec.attention == "sdpa":
        # a mask rules out the mask-free flash path: k and v expanded to every head, and SDPA
        # turns the boolean (b, 1, s, s) mask into a float bias it keeps for backward, per layer
        attn = 4 * c * q + F32 * a + c * s
    else:
        # q, k and v (expanded to every head), output copy; per head s x s: Llama's softmax in fp32
        # and its cast back, GPT-2's in the compute dtype
        softmax = (F32 + (c if c < F32 else 0)) if llama else c
        attn = 4 * c * q + softmax * a * s
    attn += _qk_norm(d, c)
    if d.moe:                  # experts outside autocast's list run in the weights' fp32
        return norms + attn + _moe_mlp(d, F32 if autocast else c)
    # llama: gate, silu, up, product; gpt2: fc and gelu output, plus tanh, 0.5x and 1+tanh when
    # GELU is written out (gelu_new)
    mlp = 4 * c * f if llama else (5 if d.gelu == "new" else 2) * c * f
    return norms + attn + mlp


def _layer_selective(d: DecoderConfig, c: int, autocast: bool) -> float:
    """Bytes per token with selective checkpointing: block input + matmul and attention outputs."""
    h, kv, f, a, q = d.hidden, d.kv_dim, d.ffn, d.heads, d.q_dim
    mm = 2 if autocast else c
    block_input = (F32 if autocast else c) * h
    # an MoE block's experts run grouped matmuls, which the policy recomputes; its router is an mm
    mlp = d.experts if d.moe else ((2 * f + h) if d.style == "llama" else (f + h))
    linears = mm * (q + 2 * kv + h) + mm * mlp
    return block_input + linears + mm * q + F32 * a       # + attention output and logsumexp


def _selective_unrebuilt(d: DecoderConfig, c: int, autocast: bool) -> float:
    """Bytes per token of a llama block's no-checkpointing tensors (_layer_full) that are not alive
    beside its recomputation at its backward under the selective policy: those the policy saved and
    backward reads, so not rebuilt (v, the attention output and its logsumexp, gate and up); and the
    saved matmul outputs only the recomputation reads (q, k, the o projection's), which it takes from
    the policy's cache (torch.utils.checkpoint's _CachedTorchDispatchMode pops them) and nothing keeps
    after. The down projection's output stays cached: the recomputation stops before it (early stop).
    Measured on the traced pp 2 stage of tiny-llama (tests/measure/test_matrix.py)."""
    h, kv, f, a, q = d.hidden, d.kv_dim, d.ffn, d.heads, d.q_dim
    mm = 2 if autocast else c
    return mm * (kv + q + 2 * f) + F32 * a + mm * (q + kv + h)


def _op_unrebuilt(d: DecoderConfig, c: int, autocast: bool) -> float:
    """_selective_unrebuilt under the per-op policy (_layer_op): saved and read by backward, so not
    rebuilt, v, the attention output, its logsumexp and gate; saved and read only by the recomputation,
    q (popped from the policy's cache, then freed). The down projection's output stays cached (early
    stop). Measured on the traced pp 2 stage of tiny-llama (tests/measure/test_matrix.py)."""
    kv, f, a, q = d.kv_dim, d.ffn, d.heads, d.q_dim
    mm = 2 if autocast else c
    return mm * (kv + q + f) + F32 * a + mm * q


def _layer_op(d: DecoderConfig, c: int, autocast: bool) -> float:
    """Bytes per token under torchtitan's per-op policy: the block input, the outputs of the 1st,
    3rd, 5th... aten.mm of the block (llama: q, v, gate, down; gpt2's biased linears run addmm,
    which the policy does not keep) and the attention output with its logsumexp."""
    h, kv, f, a, q = d.hidden, d.kv_dim, d.ffn, d.heads, d.q_dim
    mm = 2 if autocast else c
    block_input = (F32 if autocast else c) * h
    if d.moe:                  # mm order q, k, v, o, router: q, v and the router's logits kept
        kept = q + kv + d.experts
    else:
        kept = (q + kv + f + h) if d.style == "llama" else 0
    return block_input + mm * kept + mm * q + F32 * a


def _layer_compiled(d: DecoderConfig, spec: TrainSpec, c: int, mode: str) -> float:
    """Bytes per token one torch.compile'd block keeps: what AOTAutograd's min-cut partitioner
    (inductor's) hands the backward, read from the traced graph (hybrid/measure/compiled.py;
    tests/runtime/test_compile.py holds the two equal). The norms' normalised outputs and the pointwise
    ops between matmuls are recomputed inside the fused backward, not kept.
    none   llama: block input, both norm outputs, q and k after rotary, v, the attention output
           (its reshape is a view: flash kernels lay it out as b, s, heads, d), the o projection output
           (the residual sum is rebuilt from
           it), gate, up and their product, rsqrt per norm, logsumexp per head; gpt2: the same
           with the post-attention residual sum, LayerNorm mean and rstd, and gelu_new's tanh
    selective  the block input and the matmul outputs backward needs (not the down/second MLP
           projection: nothing reads it) with attention's output and logsumexp
    op     (llama) the block input and the kept matmul outputs backward needs (q, v, gate: the
           down projection's is dropped) with attention's output and logsumexp
    full   the block input."""
    h, kv, f, a = d.hidden, d.kv_dim, d.ffn, d.heads
    llama = d.style == "llama"
    if mode == "full":
        return c * h
    if mode == "selective":
        return c * (4 * h + 2 * kv + (2 * f if llama else f)) + F32 * a
    if mode == "op":
        return c * (3 * h + kv + f) + F32 * a
    if llama:
        return c * (6 * h + 2 * kv + 3 * f) + F32 * (a + 2)
    return c * (6 * h + 2 * kv + 3 * f) + 4 * c + F32 * a


def _norm(kind: str, width: int, c: int, pre: bool) -> float:
    """Bytes per token one norm keeps. RMSNorm as Llama writes it: its fp32 input (the upcast), the
    rsqrt and the normalised value cast back (kept by the weight's multiply); Gemma's (1 + weight)
    form multiplies in fp32, keeping the fp32 normalised value instead; LayerNorm: input, mean and
    rstd. A pre-norm's output is kept by the projections after it; a post-norm's (Gemma 3, OLMo 2)
    goes into the residual sum, which keeps nothing."""
    if kind == "layer":
        return c * width + 2 * F32 + (c * width if pre else 0)
    body = (2 * F32 * width + F32) if kind == "rms1p" else (F32 * width + F32 + c * width)
    return body + (c * width if pre else 0)


def _attention_read(at, spec: TrainSpec, c: int, norm: str = "rms") -> float:
    """Bytes per token one read attention keeps (the projections' outputs backward needs and what
    the attention kernel saves): SDPA's mask-free path keeps q, k, v, its output and a logsumexp per
    head; with a mask (a window or chunk shorter than the sequence) k and v expanded to every head
    and the float mask; eager attention (and sinks, which need it) the s-wide probabilities per
    head. MLA keeps its two compressed projections and their norms, and the up-projected keys
    (nope + rope), values and queries."""
    s = spec.seq_len
    a = at.heads
    q, kv = a * at.head_dim, at.kv_heads * at.head_dim
    v_width = at.kv_heads * at.v_dim
    out = a * at.v_dim
    extra = 0.0
    if at.kind == "mla":
        kv = a * at.head_dim
        v_width = a * at.v_dim
        # q_a's output is the q norm's input; kv_a's output is split: its compressed part feeds a norm
        extra += (_norm("rms", at.q_lora, c, True) if at.q_lora else 0) + c * (at.kv_lora + at.rope_dim)
        extra += _norm("rms", at.kv_lora, c, True) + c * a * (at.head_dim - at.rope_dim + at.v_dim)
    # a q/k norm keeps its fp32 input and its normalised value: cast back (Llama's form), or in fp32
    # where the layer's norms multiply their weight in fp32 (`norm` 'rms1p': Gemma 3, OLMo 2)
    normed = F32 if norm == "rms1p" and at.qk_norm != "l2" else c
    if at.qk_norm == "head" or at.qk_norm == "l2":
        groups = a + at.kv_heads
        extra += (F32 + normed) * (q + kv) + F32 * groups
    elif at.qk_norm == "full":
        extra += (F32 + normed) * (q + kv) + 2 * F32
    eager = spec.attention == "eager" or at.sinks or at.softcap
    if eager:
        probs = (F32 + (c if c < F32 else 0)) * a * s
        # with sinks the softmax runs over s + 1 logits per query and a max's indices are kept
        probs = probs * (s + 1) / s if at.sinks else probs
        return extra + c * (2 * q + 2 * a * at.v_dim) + probs + (8 * a if at.sinks else 0)
    if at.masked(s):
        return extra + c * (2 * q + 2 * a * at.v_dim) + F32 * a + c * s
    if at.fused_qkv:       # v is a view of the fused projection's whole output, which stays
        v_width = q + 2 * kv
    return extra + c * (q + kv + v_width + out) + F32 * a


def _mlp_read(mlp, h: int, c: int, autocast: bool) -> float:
    """Bytes per token one read MLP keeps: a gated one its gate, activation, up and product (f wide
    each), a plain one its input to the activation and output; an MoE block its routed pairs (as
    moe_pair), the fp32 router scores, the renormalised weights, and the shared expert(s)."""
    if not mlp.moe:
        return (4 if mlp.gated else 2) * c * mlp.ffn
    cc = F32 if autocast else c
    # gpt-oss's clamped SwiGLU keeps the clamped gate, gate x alpha's sigmoid and up + 1 as well
    kept = 7 if mlp.act == "swiglu_clamp" else 4
    pair = cc * (2 * h + kept * mlp.moe_ffn) + F32 + 4 * 8
    pairs = mlp.experts if mlp.dense_dispatch else mlp.top_k
    out = pairs * pair + F32 * mlp.experts + (F32 * (mlp.top_k + 1) if mlp.renorm else 0)
    if mlp.shared_ffn:
        out += 4 * cc * mlp.shared_ffn + (cc * h + F32 if mlp.shared_gate else 0)
    return out


def layer_read_full(layer, d: DecoderConfig, spec: TrainSpec, c: int, autocast: bool) -> float:
    """Bytes per token one read block (hybrid/model/anatomy.py Layer) keeps with no checkpointing."""
    h = d.hidden
    cc = 2 if autocast else c
    if autocast:   # the residual stream and norms in fp32; each matmul input cast to bf16 once per consumer
        norms = (2 * F32 * h + F32) * layer.norms + cc * h * 2
    elif layer.post_norms and layer.norms == 2:       # OLMo 2: norms after attention and MLP only
        norms = 2 * c * h + 2 * _norm(layer.norm, h, c, pre=False)
    else:
        pre = 2 * _norm(layer.norm, h, c, pre=True)
        norms = pre + (2 * _norm(layer.norm, h, c, pre=False) if layer.post_norms else 0)
    return norms + _attention_read(layer.attention, spec, cc, layer.norm) + _mlp_read(layer.mlp, h, cc, autocast)


def layer_read_selective(layer, d: DecoderConfig, spec: TrainSpec, c: int, autocast: bool) -> float:
    """Bytes per token one read block keeps under selective checkpointing (runtime/activation_checkpoint.py
    _selective_policy: the outputs of aten.mm/addmm and of SDPA's flash/efficient kernels are saved,
    everything else recomputed): the block input, the output of every linear of the block (q/k/v/o or
    the fused qkv; MLA's q_a, q_b, kv_a, kv_b; gate/up/down; the router, shared experts and their gate:
    each 2-D matrix of Layer.matrices), and SDPA's output with its logsumexp per head. Routed experts
    run grouped_mm (or bmm under dense dispatch) and eager attention (sinks, softcap) bmm: neither is
    in the policy's set, so both are recomputed. A window shorter than the sequence still runs a saved
    kernel (CPU's flash takes the mask; CUDA's efficient kernel). Measured with MemTracker on tiny
    transformers models (tests/model/test_anatomy.py
    test_checkpointed_activations_are_what_memtracker_sees)."""
    at, mlp, h = layer.attention, layer.mlp, d.hidden
    mm = 2 if autocast else c
    if mlp.moe:          # the router's logits; a shared expert's gate, up and down, and its scalar gate
        widths = mlp.experts + ((2 * mlp.shared_ffn + h) if mlp.shared_ffn else 0) + (1 if mlp.shared_gate else 0)
    else:
        widths = (2 * mlp.ffn if mlp.gated else mlp.ffn) + h
    linears = sum(m[0] for m in at.matrices(h) if len(m) == 2) + widths
    eager = spec.attention == "eager" or at.sinks or at.softcap
    kernel = 0 if eager else mm * at.heads * at.v_dim + F32 * at.heads
    return (F32 if autocast else c) * d.hidden + mm * linears + kernel


def compiled_supported(d: DecoderConfig, spec: TrainSpec, autocast: bool) -> str | None:
    """Why a compiled block's memory is not modelled for this job (None when it is)."""
    if autocast:
        return ("compiled blocks under autocast (ddp with bf16-mixed) are not modelled; use fsdp (bf16 compute "
                "over fp32 masters), or --precision bf16 / fp32")
    if spec.attention != "sdpa" or (d.sliding_window is not None and spec.seq_len >= d.sliding_window):
        return "compiled blocks are modelled with SDPA's mask-free flash attention; use --attention sdpa"
    if d.style == "gpt2" and d.gelu != "new":
        return "compiled gpt2 blocks are modelled with gelu_new"
    if spec.activation_checkpointing not in ("none", "selective", "full") and not (
            spec.activation_checkpointing == "op" and d.style == "llama"):
        return "compiled blocks are modelled with none, selective or full checkpointing (and op for llama)"
    return None


def checkpointed_blocks(layers: int, every: int) -> int:
    """Blocks layer:N recomputes: indices 0, N, 2N... (torchtitan's ac_freq)."""
    return -(-layers // every)


def _read_terms(d: DecoderConfig, spec: TrainSpec, autocast: bool,
                adapters_autocast: bool = False) -> tuple[float, float]:
    """(mean bytes a block keeps, most bytes one recomputed block needs) over a read stack (with
    spec.lora: each block's LoRA delta, lora_read_delta)."""
    from ...errors import NotApplicable
    c = spec.bytes.compute
    T = spec.micro_batch * spec.seq_len
    ckpt = spec.activation_checkpointing
    if getattr(spec, "compile", False):
        from .compiled import compiled_terms
        return compiled_terms(d, spec, autocast)
    if ckpt in ("selective", "op") and spec.lora:
        raise NotApplicable(f"{ckpt} checkpointing with LoRA of {d.hf_model_type or 'this'} decoder (read from its "
                            "module) is not modelled; use none, full or layer:N")
    full = [(layer_read_full(ly, d, spec, c, autocast)
             + (lora_read_delta(ly, i, d, spec, c, adapters_autocast) if spec.lora else 0)) * T
            for i, ly in enumerate(d.stack)]
    kept = (F32 if autocast else c) * d.hidden * T
    if ckpt == "none":
        return sum(full) / len(full), 0.0
    if ckpt == "full":
        return kept, max(full)
    if ckpt in ("selective", "op"):
        # recomputing a block rebuilds what it keeps without checkpointing beyond what the policy saved
        from .compiled import layer_read_op
        sel = [(layer_read_selective(ly, d, spec, c, autocast) if ckpt == "selective"
                else layer_read_op(ly, d.hidden, spec, c, autocast)) * T for ly in d.stack]
        return sum(sel) / len(sel), max(max(f - s, 0.0) for f, s in zip(full, sel))
    every = layer_every(ckpt)
    per = [kept if i % every == 0 else f for i, f in enumerate(full)]
    return sum(per) / len(per), max(full)


def attention_tp_delta(at, spec: TrainSpec, c: int, tp: int) -> float:
    """Bytes per token one tensor-parallel rank keeps of a read attention beyond 1/tp of what
    _attention_read counts (heads split tp ways; hybrid/runtime/backends/tp.py _hf_plan): with a
    mask, the float mask SDPA keeps is (b, 1, s, s) on every rank, not split with the heads; and
    where the rank holds one key/value head for several query heads, k and v expanded to its heads
    are views of k and v (repeat_kv's reshape over a size-1 dimension), not copies."""
    if at.kind == "mla":
        return 0.0
    eager = spec.attention == "eager" or at.sinks or at.softcap
    if not (eager or at.masked(spec.seq_len)):
        return 0.0
    delta = 0.0 if eager else c * spec.seq_len * (1 - 1 / tp)
    heads, kv_heads = at.heads // tp, at.kv_heads // tp
    if kv_heads == 1 and heads > 1:
        delta -= c * 2 * (heads - kv_heads) * at.v_dim
    return delta


def read_tp_terms(d: DecoderConfig, spec: TrainSpec, autocast: bool, tp: int) -> tuple[float, float]:
    """(stored, redone): bytes per micro-batch a tensor-parallel rank keeps of a read stack beyond
    1/tp of _read_terms' (mean bytes a block keeps, most bytes one recomputed block needs), from
    attention_tp_delta: every stored block's with no checkpointing, the uncheckpointed blocks' with
    layer:N, and the recomputed block's (the largest, as a rank holds it) with checkpointing."""
    if not d.stack:
        return 0.0, 0.0
    c = spec.bytes.compute
    cc = 2 if autocast else c
    T = spec.micro_batch * spec.seq_len
    ckpt = spec.activation_checkpointing
    delta = [attention_tp_delta(ly.attention, spec, cc, tp) * T for ly in d.stack]
    full = [layer_read_full(ly, d, spec, c, autocast) * T for ly in d.stack]
    redone = (max(f / tp + x for f, x in zip(full, delta)) - max(full) / tp) if ckpt != "none" else 0.0
    every = layer_every(ckpt)
    if ckpt == "none":
        stored = sum(delta) / len(delta)
    elif every is not None:
        stored = sum(x for i, x in enumerate(delta) if i % every) / len(delta)
    else:                      # full (and any mode that keeps no attention tensors of its own)
        stored = 0.0
    return stored, redone


def lora_layer_delta(d: DecoderConfig, spec: TrainSpec, c: int, autocast: bool, mask_bytes: int = 1) -> float:
    """Bytes per token a LoRA block saves beyond (or short of) the fully trained block of the same
    regime (tests/estimation/test_lora.py holds it to saved-tensors hooks on PEFT models). Per
    adapted linear: B's input, the r-wide A x, and A's input: the linear's own input (shared by
    the linears that read it), or a copy of its own under autocast (fp32 adapters over a bf16 base,
    DDP: PEFT casts the input to the adapter's fp32, autocast back to bf16) and with dropout (its
    output, and its mask: `mask_bytes`, 1 for CUDA's fused dropout's bool mask, c for the scaled
    noise the CPU kernel keeps). Frozen weights need no input for their gradient: a llama RMSNorm's
    normalised value (kept only for the norm weight's gradient) and a linear input no trainable
    weight reads (norm outputs, the MLP product) are not saved."""
    from ...model.lora import adapted
    lora = spec.lora
    ca = 2 if autocast else c                       # the adapters' matmuls: autocast's bf16, else the base's dtype
    linears = [shape for shapes in adapted(d, lora).values() for shape in shapes]
    delta = sum(ca * lora.rank for _ in linears)
    own_copy = autocast or lora.dropout > 0         # A reads a tensor of its own, not the linear's input
    if own_copy:
        delta += sum(i * (2 if autocast else c) + (mask_bytes if lora.dropout else 0) * i for i, _ in linears)
    names = set(() if own_copy else adapted(d, lora))
    h, f = d.hidden, d.ffn
    if d.qk_norm is not None:           # frozen q/k norm weights: their normalised values are not kept (_qk_norm)
        delta -= c * (d.q_dim + d.kv_dim)
    if d.style == "llama":
        delta -= 2 * c * h
        delta -= c * h * (not names & {"q_proj", "k_proj", "v_proj"}) + c * h * (not names & {"gate_proj", "up_proj"})
        delta -= c * f * ("down_proj" not in names)
    else:
        delta -= c * h * (not names & {"qkv_proj", "c_attn"}) + c * h * (not names & {"fc", "c_fc"})
        delta -= c * f * (not names & {"proj", "c_proj"})
    return delta


NORM_WEIGHT_INPUT = {"rms": "c", "rms1p": "fp32", "layer": None}
"""What a norm's weight multiply keeps for the weight's gradient (see _norm): Llama's RMSNorm the
normalised value cast back (c bytes), Gemma's (1 + weight) its fp32 normalised value, LayerNorm
nothing apart (one fused op keeps its input and statistics whatever trains)."""


def _norm_weight_input(kind: str, width: int, c: int) -> float:
    return width * {"c": c, "fp32": F32, None: 0}[NORM_WEIGHT_INPUT[kind]]


def lora_read_delta(layer, index: int, d: DecoderConfig, spec: TrainSpec, c: int, autocast: bool,
                    mask_bytes: int = 1) -> float:
    """Bytes per token block `index` of a read stack (an anatomy Layer with its linears) keeps
    under spec.lora beyond what layer_read_full counts for it trained whole: lora_layer_delta's
    rules on the linears the module has. Added: per adapted linear B's input (A x, r wide), and
    with dropout or under autocast A's own copy of its input (and dropout's mask). Not kept where
    nothing trainable needs them: what each frozen norm weight's multiply keeps, the q/k norms'
    normalised values, the attention's and the MLP's inputs when no adapter reads them, the MLP's
    activation product without an adapter on the down projection, eager attention's output copy
    without one on the o projection (SDPA keeps its output itself), and in the first block what
    lies before every adapter (first_block_unkept)."""
    from ...errors import NotApplicable
    from ...model.lora import layer_adapted
    lora, at, mlp, h = spec.lora, layer.attention, layer.mlp, d.hidden
    if mlp.moe or at.kind == "mla":
        raise NotApplicable(f"LoRA on {'mixture-of-experts' if mlp.moe else 'multi-head latent attention'} blocks of "
                            f"{d.hf_model_type or 'this'} decoder (read from its module) is not modelled; fine-tune "
                            "it in full")
    adapted = layer_adapted(layer, index, lora)
    ca = 2 if autocast else c
    own_copy = autocast or lora.dropout > 0
    delta = sum(ca * lora.rank for _ in adapted)
    if own_copy:
        delta += sum(ln.in_features * ((2 if autocast else c) + (mask_bytes if lora.dropout else 0))
                     for ln in adapted)
    reads = {ln.reads for ln in adapted}
    reading = set() if own_copy else reads
    delta -= layer.norms * _norm_weight_input(layer.norm, h, c)
    if at.qk_norm in ("head", "full"):
        delta -= c * (at.q_width + at.kv_width)
    delta -= c * h * ("attention" not in reading) + c * h * ("mlp" not in reading)
    delta -= c * mlp.ffn * ("product" not in reading)
    eager = spec.attention == "eager" or at.sinks or at.softcap
    if eager and "core" not in reading:
        delta -= c * at.heads * at.v_dim
    if index == 0:
        masks = [(ln.reads, ln.in_features) for ln in adapted] if lora.dropout else []
        delta -= first_block_unkept(layer, spec, h, c, reads, "core" in reading, masks, mask_bytes)
    return delta


def first_block_unkept(layer, spec: TrainSpec, h: int, c: int, reads: set, core_read: bool,
                       masks: list = (), mask_bytes: int = 1) -> float:
    """Bytes per token the first block of a LoRA model does not keep beyond lora_read_delta's: its
    input (a frozen embedding's output) needs no gradient, so an op keeps what only an input's
    gradient needs only downstream of an adapter (autograd records no node for an op none of whose
    inputs needs a gradient). The norms before the first adapter keep nothing of theirs; the
    attention core, its q/k norms included, nothing unless a q/k/v projection is adapted (then its
    output is kept by an adapter on the o projection alone, `core_read`); the MLP's activation
    nothing unless something before or in it is adapted (counted whole when gate or up is: which
    of them is adapted is not read); an adapter's dropout on an input that needs no gradient keeps
    no mask (`masks`: (what each adapted linear reads, its in_features) under dropout)."""
    at, mlp = layer.attention, layer.mlp
    attn = "attention" in reads
    after_attn = attn or "core" in reads
    in_mlp = after_attn or "mlp" in reads
    after_mlp = in_mlp or "product" in reads
    no_grad = {"attention": True, "core": not attn, "mlp": not after_attn, "product": not in_mlp, "other": False}
    body = _norm(layer.norm, h, c, pre=False) - _norm_weight_input(layer.norm, h, c)
    if layer.post_norms and layer.norms == 2:          # OLMo 2: after the attention and after the MLP
        needs = (after_attn, after_mlp)
    elif layer.post_norms:                             # Gemma 3: before and after each
        needs = (False, after_attn, after_attn, after_mlp)
    else:
        needs = (False, after_attn)
    out = body * sum(not n for n in needs)
    if not attn:
        core = _attention_read(at, spec, c) - (c * (at.q_width + at.kv_width) if at.qk_norm in ("head", "full") else 0)
        eager = spec.attention == "eager" or at.sinks or at.softcap
        # the output copy eager attention makes for o_proj is lora_read_delta's; SDPA's own output
        # stays when an adapter on the o projection reads it
        out += core - (c * at.heads * at.v_dim if eager or core_read else 0)
    if not in_mlp and not mlp.moe:          # gate, activation and up (a plain MLP: its activation's input)
        out += c * mlp.ffn * (3 if mlp.gated else 1)
    return out + sum(mask_bytes * i for r, i in masks if no_grad[r])


def _closed_first_block(d: DecoderConfig, spec: TrainSpec, c: int, autocast: bool) -> float:
    """first_block_unkept for a closed-form decoder's first block (its blocks share one figure,
    so activation_terms spreads it over them)."""
    from ...model.lora import READS, adapted
    lora = spec.lora
    found = adapted(d, lora)
    reads = {r for name in found for r in READS[name]}
    core_read = "core" in reads and not (autocast or lora.dropout > 0)
    # GPT-2's c_proj: the attention's output projection, then the MLP's second linear
    masks = [(READS[n][k], i) for n, shapes in found.items() for k, (i, _) in enumerate(shapes)] if lora.dropout else []
    return first_block_unkept(d.layer_list()[0], spec, d.hidden, c, reads, core_read, masks)


def activation_terms(d: DecoderConfig, spec: TrainSpec, autocast: bool) -> ActivationTerms:
    c = spec.bytes.compute
    T = spec.micro_batch * spec.seq_len
    lora = spec.lora is not None
    adapters_autocast, autocast = autocast and lora, autocast and not lora   # a LoRA base is in the compute dtype
    ckpt = spec.activation_checkpointing
    full = 0.0 if d.stack else (_layer_full(d, spec, c, autocast)
                                + (lora_layer_delta(d, spec, c, adapters_autocast)
                                   - _closed_first_block(d, spec, c, adapters_autocast) / d.layers if lora else 0)) * T
    if d.stack:
        per_layer, recompute = _read_terms(d, spec, autocast, adapters_autocast)
    elif getattr(spec, "compile", False) and (d.moe or d.qk_norm or d.head_size) and d.hf_model_type:
        # transformers builds these (sources._decoder_builder): its blocks' closed forms
        from .compiled import compiled_terms
        per_layer, recompute = compiled_terms(d, spec, autocast)
    elif getattr(spec, "compile", False):
        why = compiled_supported(d, spec, autocast)
        if why is not None:
            from ...errors import NotApplicable
            raise NotApplicable(why)
        # a recomputed compiled block keeps, while its backward runs, what an uncheckpointed one does
        full = _layer_compiled(d, spec, c, "none") * T
        per_layer = _layer_compiled(d, spec, c, ckpt) * T
        recompute = {"none": 0.0, "full": full}.get(ckpt, full - per_layer)
    elif ckpt == "none":
        per_layer, recompute = full, 0.0
    elif ckpt == "full":
        per_layer = (F32 if autocast else c) * d.hidden * T   # the block input
        recompute = full
    elif ckpt == "selective":
        per_layer = _layer_selective(d, c, autocast) * T
        recompute = (full - _selective_unrebuilt(d, c, autocast) * T if d.style == "llama" and not d.moe
                     else full - per_layer)
    elif ckpt == "op":
        per_layer = _layer_op(d, c, autocast) * T
        recompute = (full - _op_unrebuilt(d, c, autocast) * T if d.style == "llama" and not d.moe
                     else full - per_layer)
    else:                                   # layer:N: the blocks' average
        k = checkpointed_blocks(d.layers, layer_every(ckpt))
        kept = (F32 if autocast else c) * d.hidden * T
        per_layer = (k * kept + (d.layers - k) * full) / d.layers
        recompute = full
    head_fwd, head_bwd = loss_terms(d, spec, autocast or adapters_autocast)
    if lora:      # a frozen final norm and head keep only what the norm's input gradient needs
        fp32_norm = autocast or adapters_autocast
        frozen_norm = (final_norm(d, c, fp32_norm) - frozen_final_norm(d, c, fp32_norm)) * T
        head_fwd, head_bwd = head_fwd - frozen_norm, head_bwd - frozen_norm
    cache = 0
    if adapters_autocast:                                     # bf16 copies of the fp32 adapters
        from ...model.lora import adapter_params
        cache = 2 * adapter_params(d, spec.lora)
    if autocast:
        # the bf16 copy of every matmul weight (an MoE block's router; its experts run outside autocast's
        # list) that a kept matmul saves: the LM head's, and an uncheckpointed block's. A checkpointed block
        # keeps none (they are made again with it, and autocast's cache is emptied when forward leaves it),
        # so the block being recomputed holds its own (measured with the tracker at the loss's backward)
        blocks = d.layers - (0 if ckpt == "none" else checkpointed_blocks(d.layers, layer_every(ckpt))
                             if ckpt.startswith("layer:") else d.layers)
        cache = 2 * (d.block_matmul_params * blocks / d.layers + d.vocab * d.hidden)
        if blocks < d.layers:
            recompute += 2 * d.block_matmul_params / d.layers
    # every checkpointing mode checkpoints a stage's first block (layer:N: each piece's blocks 0, N, 2N...:
    # runtime/activation_checkpoint.py), which keeps its input whole
    compiled = getattr(spec, "compile", False)
    block_input = (F32 if autocast else c) * d.hidden * T if ckpt != "none" and not compiled else 0
    modelled = not (d.stack or d.moe or compiled or (d.style == "gpt2" and d.gelu == "new"))
    transient = mlp_backward_transient(d, spec, autocast or adapters_autocast) if modelled else 0
    return ActivationTerms(per_layer=int(per_layer), recompute=int(recompute), head_forward=int(head_fwd),
                           head_backward=int(head_bwd), autocast_cache=int(cache), layers=d.layers,
                           backward_transient=int(transient), block_input=int(block_input))


LOSS_CHUNKS = 8
"""Token chunks of the chunked loss: torchtune's CEWithChunkedOutputLoss num_output_chunks default."""


def final_norm(d: DecoderConfig, c: int, autocast: bool) -> float:
    """Bytes per token the final norm keeps: as a block's pre-norm (_norm, its kind read from the last
    block), its output kept by the head's projection; under autocast it runs in fp32 (its input is the
    fp32 residual stream) and the head keeps its bf16 cast of the output instead
    (tests/estimation/test_activations.py test_head_formula_matches_autograd)."""
    kind = d.stack[-1].norm if d.stack else ("rms" if d.style == "llama" else "layer")
    if autocast:
        return _norm(kind, d.hidden, F32, pre=False) + 2 * d.hidden
    return _norm(kind, d.hidden, c, pre=True)


def frozen_final_norm(d: DecoderConfig, c: int, autocast: bool) -> float:
    """Bytes per token a frozen final norm (LoRA) keeps with a frozen head: its input and statistics, which
    its input's gradient reads; no normalised value or output, which only the frozen weights' gradients
    would (measured with saved-tensor hooks: Llama's RMSNorm its fp32 input and rsqrt in every regime)."""
    kind = d.stack[-1].norm if d.stack else ("rms" if d.style == "llama" else "layer")
    if kind == "layer":
        return (F32 if autocast else c) * d.hidden + 2 * F32
    return F32 * d.hidden + F32


def loss_terms(d: DecoderConfig, spec: TrainSpec, autocast: bool, vocab_parallel: bool = False) -> tuple[int, int]:
    """(head_forward, head_backward) bytes of one micro-batch's final norm, logits and loss under
    spec.loss, before the tp split (ActivationTerms' fields; share_activations divides by tp).
    eager: the c-byte logits, log_softmax's fp32 output, and in backward the fp32 gradients of both.
    chunked (hybrid/runtime/loss.py): LOSS_CHUNKS chunks of head and cross-entropy, each under
    activation checkpointing, so forward keeps only the norm's output; backward recomputes one
    chunk at a time (eager's bytes for T / LOSS_CHUNKS tokens).
    fused (liger_kernel fused_linear_cross_entropy_forward): forward allocates and keeps the
    input's gradient (T x h) and the head weight's (vocab x h, the weight's dtype) and makes the
    logits a chunk at a time, chunk = next power of 2 of T / ceil(vocab / h) tokens; backward only
    scales them. fused and `vocab_parallel` (tensor parallelism; Megatron-LM's
    _VocabParallelCrossEntropy): the logits' fp32 copy is turned in place into the softmax it
    keeps; backward's gradient is that buffer, cast to c.
    eager and `vocab_parallel` (torch's loss_parallel, torch/distributed/tensor/parallel/loss.py,
    on the vocab shards): forward keeps the logits and the fp32 log-softmax; the nll backward
    (fused with log-softmax's) makes a zero one-hot, exp of the log-softmax and their sum before
    their product with the loss gradient: four fp32 tensors beside the logits at its peak."""
    c = spec.bytes.compute
    T = spec.micro_batch * spec.seq_len
    V, h = d.vocab, d.hidden
    norm = final_norm(d, c, autocast) * T
    logit = 2 if autocast else c
    if spec.loss == "eager" and vocab_parallel:
        return int(norm + (logit + F32) * V * T), int(norm + (logit + 4 * F32) * V * T)
    if spec.loss == "fused" and vocab_parallel:
        fwd = norm + F32 * V * T
        return int(fwd), int(fwd + c * V * T)
    if spec.loss == "fused":
        chunk = min(T, 1 << max(0, math.ceil(T / math.ceil(V / h)) - 1).bit_length())
        fwd = norm + (F32 if autocast else c) * (T * h + V * h) + F32 * T      # + the fp32 per-token loss
        return int(fwd), int(fwd + logit * chunk * V)
    # log_softmax keeps its fp32 output; the fp32 upcast of bf16 logits is transient.
    # loss backward: grad of the log-softmax output and grad of its input, both fp32.
    kept = T if spec.loss == "eager" else math.ceil(T / LOSS_CHUNKS)
    fwd = norm + ((logit + F32) * V * T if spec.loss == "eager" else 0)
    return int(fwd), int(norm + (logit + 3 * F32) * V * kept)


def largest_transient(d: DecoderConfig, spec: TrainSpec, autocast: bool, tp: int = 1) -> int:
    """The largest tensor a block makes in forward and frees before the next block (the cause of
    the default allocator's fragmentation floor, memory/breakdown.fragmentation_floor): one
    f-wide MLP intermediate, or with eager attention the per-head s x s scores (fp32 softmax);
    split tp ways under tensor parallelism."""
    c = 2 if autocast else spec.bytes.compute
    T = spec.micro_batch * spec.seq_len
    # an MoE block's experts: one m-wide intermediate per routed (token, expert) pair
    mlp = c * (d.moe_ffn * d.top_k if d.moe else d.ffn) * T
    scores = F32 * d.heads * spec.seq_len * T if spec.attention == "eager" else 0
    return int(max(mlp, scores) / tp)
