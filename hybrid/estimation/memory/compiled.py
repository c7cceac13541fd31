"""What one block of a decoder read from its module (hybrid/model/anatomy.py Layer) keeps for its
backward under torch.compile, per anatomy component, and which matmul outputs torchtitan's per-op
checkpointing policy keeps (eager and compiled).

Under torch.compile (hybrid/runtime/compile.py: each block fullgraph) AOTAutograd traces a block's
forward and backward as one graph, and inductor's min-cut partitioner chooses which forward values
the backward receives; the rest is recomputed inside the fused backward. For these blocks it keeps:
the block input; each norm's statistic (rsqrt per row, fp32) and, where a matmul reads it, its
output; the matmul outputs a nonlinear op or a norm reads (q, k, v, o, gate, up; a down projection
only where a post-norm reads it); what the attention kernel saves; the MLP's activation product.
The pointwise work between them (rotary, the norms' scaling, the residual sums, the routing's
renormalisation) is rebuilt. hybrid/measure/compiled.py block_saved reads the partitioner's choice
on transformers' own blocks, the reference tests/estimation/test_compiled_blocks.py holds each
family's closed form to (exact, one block kind at a time) and inductor's compiled blocks on CPU to
the estimate.

All figures are bytes per token of one block, `c` the compute dtype's bytes, plus bytes per block
that do not grow with the tokens (an MoE block's expert offsets).
"""
from __future__ import annotations

from dataclasses import dataclass

F32 = 4
I64 = 8
I32 = 4


@dataclass(frozen=True)
class Matmul:
    """One 2-D matmul of a block's forward (aten.mm, or aten.addmm when biased), in forward order."""

    width: int
    """Output features."""
    addmm: bool = False
    """Biased: aten.addmm, which torchtitan's per-op policy does not count or keep."""
    needed: bool = True
    """Whether the block's backward reads its output (a compiled block keeps only those): every
    projection a nonlinear op or a norm reads; not a down projection summed into the residual."""
    fp32: bool = False
    """Computed in fp32 over lower-precision tokens (DeepSeek-V3's router): an fp32 output."""


def matmuls(layer, hidden: int) -> list[Matmul]:
    """The block's 2-D matmuls in forward order (what the per-op policy counts): the attention's
    projections (q, k, v or the fused qkv; MLA's q_a, q_b, kv_a, kv_b) and o; a dense MLP's gate
    and up (or the fused gate_up) and down; an MoE block's router, shared expert(s) (before the router
    where the module runs them first: MLP.shared_first) and the shared expert's scalar gate. Routed
    experts run grouped matmuls (or bmm under dense dispatch), which are not 2-D matmuls."""
    at, mlp, h = layer.attention, layer.mlp, hidden
    bias = at.qkv_bias
    if at.kind == "mla":
        nope = at.head_dim - at.rope_dim
        q = [Matmul(at.q_lora, bias), Matmul(at.q_width)] if at.q_lora else [Matmul(at.q_width, bias)]
        out = q + [Matmul(at.kv_lora + at.rope_dim, bias), Matmul(at.heads * (nope + at.v_dim))]
    elif at.fused_qkv:
        out = [Matmul(at.q_width + 2 * at.kv_width, bias)]
    else:
        out = [Matmul(at.q_width, bias), Matmul(at.kv_width, bias), Matmul(at.kv_heads * at.v_dim, bias)]
    out.append(Matmul(h, at.out_bias))
    if not mlp.moe:
        f = mlp.ffn
        up = [Matmul(2 * f, mlp.bias)] if mlp.fused_gate_up else [Matmul(f, mlp.bias)] * (2 if mlp.gated else 1)
        return out + up + [Matmul(h, mlp.bias, needed=layer.post_norms)]
    router = [Matmul(mlp.experts, mlp.router_bias, fp32=mlp.router_fp32)]
    s = mlp.shared_ffn
    shared = [Matmul(s), Matmul(s), Matmul(h, needed=mlp.shared_gate)] if s else []
    gate = [Matmul(1)] if mlp.shared_gate else []
    return out + (shared + router if mlp.shared_first else router + shared) + gate


def op_kept(layer, hidden: int, compiled: bool) -> list[Matmul]:
    """The matmul outputs torchtitan's per-op policy keeps (runtime/activation_checkpoint.py
    _op_context: the 1st, 3rd, 5th... aten.mm of the block; addmm is not counted): all of them
    in eager autograd, which stores what the policy saves; those the backward reads when compiled."""
    mms = [m for m in matmuls(layer, hidden) if not m.addmm]
    return [m for i, m in enumerate(mms) if i % 2 == 0 and (m.needed or not compiled)]


def _eager(at, spec) -> bool:
    return spec.attention == "eager" or at.sinks or at.softcap > 0


def kernel(at, spec, c: int) -> float:
    """Bytes per token SDPA's flash or efficient kernel keeps (its output and a logsumexp per head:
    what the selective and per-op policies save); 0 for eager attention, whose matmuls they recompute."""
    return 0.0 if _eager(at, spec) else c * at.heads * at.v_dim + F32 * at.heads


def problem(layer, spec) -> str | None:
    """Why this block's compiled memory is not modelled (None when it is): the components whose
    partitioner choice has not been read (LayerNorm, a plain MLP or ungated experts, soft-capped
    attention, multi-head latent attention run eagerly)."""
    at, mlp = layer.attention, layer.mlp
    if layer.norm == "layer":
        return "LayerNorm blocks"
    if not mlp.gated:
        return "plain (ungated) MLPs"
    if at.softcap:
        return "soft-capped attention"
    if at.kind == "mla" and _eager(at, spec):
        return "eager multi-head latent attention"
    return None


def _qk_norm(at, c: int) -> float:
    """The query/key norms: their inputs (the projections' outputs, or the rotated q and k under Llama
    4's L2 norm) and an fp32 statistic per normalised group."""
    if at.qk_norm is None:
        return 0.0
    groups = 2 if at.qk_norm == "full" else at.heads + at.kv_heads
    return c * (at.q_width + at.kv_width) + F32 * groups


def attention_none(at, spec, c: int) -> float:
    """Bytes per token a compiled attention keeps (no checkpointing). GQA/MHA: the queries after
    rotary; the keys after rotary and the values (a view of a fused projection's whole output),
    or, where SDPA gets a mask, eager attention or head dims it does not keep GQA for (transformers'
    use_gqa_in_sdpa), both expanded to every head; the q/k norms' inputs and statistics. MLA: q_a's
    output and its norm's, kv_a's whole output and its norm's, kv_b's whole output (the keys' nope
    part and the values are views of it), the queries and keys after rotary. SDPA's kernel keeps its
    output and logsumexp, the float mask it is given (b, 1, s, s; per layer), and where the queries
    are a concatenation (Attention.rope_cat) and a flash kernel runs, the o projection reads a copy
    of the output. Eager attention keeps the softmax's output and what the matmul after it reads:
    the fp32 probabilities and their cast (a softmax with sinks: over s + 1 logits in the compute
    dtype, the copy without the sink column and the max's indices), and its output for the o
    projection."""
    a, d, v, s = at.heads, at.head_dim, at.v_dim, spec.seq_len
    eager = _eager(at, spec)
    if at.kind == "mla":
        out = (2 * c * at.q_lora + F32) if at.q_lora else 0.0
        out += c * (at.kv_lora + at.rope_dim) + F32 + c * at.kv_lora
        out += c * a * (d - at.rope_dim + v) + 2 * c * a * d
    else:
        out = _qk_norm(at, c) + c * at.q_width
        gqa = not (eager or at.masked(s)) and d == v <= 256
        expanded = at.kv_heads < a and not gqa
        if expanded:
            out += c * a * (d + v)
        else:
            out += c * at.kv_width + c * (at.q_width + 2 * at.kv_width if at.fused_qkv else at.kv_heads * v)
    if eager:
        probs = c * a * (2 * s + 1) + I64 * a if at.sinks else (F32 + (c if c < F32 else 0)) * a * s
        return out + probs + c * a * v
    # flash kernels (CUDA's, as torch's meta registration allocates it, and CPU's) lay their output out
    # like q; CUDA's efficient kernel, which takes masks and unequal head dims, as (b, s, heads, d)
    flash = not at.masked(s) and d == v <= 256
    mask = c * s if at.masked(s) else 0
    return out + kernel(at, spec, c) + (c * a * v if at.rope_cat and flash else 0) + mask


def mlp_none(mlp, hidden: int, c: int) -> tuple[float, float]:
    """(bytes per token, bytes per block) a compiled MLP keeps. Dense and gated: the gate and up
    outputs (one fused output, or two) and their product. MoE, per routed (token, expert) pair (every
    expert under dense dispatch): the expert's input (gathered; Llama 4: repeated, and weighted),
    its gate_up output, the activation product and the down projection's output (the routing
    weight's gradient reads it), gpt-oss's clamped SwiGLU's sigmoid, the routing weight (fp32 where
    the router runs in fp32) and, grouped, three int64 index vectors (the sort order, its token
    index, the inverse order; with expert biases the sorted expert ids); per token the top-k
    indices, the router's fp32 softmax or sigmoid over every expert (a softmax over the top k: its
    output), the top-k values a renormalisation divides, an fp32 router's fp32 copy of the tokens;
    the shared expert(s)' gate, up and product, with a sigmoid gate the shared output and the gate.
    Per block: the grouped matmuls' int32 offsets, and an fp32 router's fp32 weight."""
    if not mlp.moe:
        return 3 * c * mlp.ffn, 0.0
    h, m, e, k = hidden, mlp.moe_ffn, mlp.experts, mlp.top_k
    upcast = mlp.router_fp32 and c < F32
    weight = F32 if mlp.router_fp32 else c
    pair = c * (2 * h + 3 * m) + (c * m if mlp.act == "swiglu_clamp" else 0) + weight
    if not mlp.dense_dispatch:
        pair += I64 * (3 + (1 if mlp.bias else 0))
    router = c * k if mlp.router == "topk_softmax" else F32 * e + (F32 * (k + 1) if mlp.renorm else 0)
    tok = (e if mlp.dense_dispatch else k) * pair + I64 * k + router + (F32 * h if upcast else 0)
    if mlp.shared_ffn:
        tok += 3 * c * mlp.shared_ffn + ((c * h + c) if mlp.shared_gate else 0)
    return tok, (0 if mlp.dense_dispatch else I32 * e)


def layer_none(layer, hidden: int, spec, c: int) -> tuple[float, float]:
    """(bytes per token, bytes per block) one compiled block keeps with no checkpointing: the
    block input; per pre-norm its statistic and output; the attention's; the o projection's output
    (the residual sum is rebuilt from it, or a post-norm reads it) and a post-norm's statistic; the
    MLP's input (the pre-MLP norm's output, or OLMo 2's residual sum) with the norm's statistic; the
    MLP's; and the down projection's output with the post-norm's statistic (Gemma 3, OLMo 2)."""
    h = hidden
    pre = not (layer.post_norms and layer.norms == 2)        # OLMo 2 normalises the outputs only
    post = layer.post_norms
    tok = c * h + ((F32 + c * h) if pre else 0) + attention_none(layer.attention, spec, c)
    tok += c * h + (F32 if post else 0) + c * h + (F32 if pre else 0)
    mlp, block = mlp_none(layer.mlp, h, c)
    return tok + mlp + ((c * h + F32) if post else 0), block


def layer_compiled(layer, hidden: int, spec, c: int, mode: str) -> tuple[float, float]:
    """(bytes per token, bytes per block) one compiled block keeps under checkpointing `mode`:
    'none' (layer_none); 'full' the block input; 'selective' the block input, the matmul outputs the
    backward reads and the attention kernel's; 'op' the same for the matmuls op_kept keeps."""
    h = hidden
    if mode == "none":
        return layer_none(layer, h, spec, c)
    if mode == "full":
        return c * h, 0.0
    kept = op_kept(layer, h, compiled=True) if mode == "op" else [m for m in matmuls(layer, h) if m.needed]
    return c * h + sum(m.width * (F32 if m.fp32 else c) for m in kept) + kernel(layer.attention, spec, c), 0.0


def layer_read_op(layer, hidden: int, spec, c: int, autocast: bool) -> float:
    """Bytes per token one read block keeps under the per-op policy in eager autograd: the block
    input, every kept matmul output (op_kept; bf16 under autocast, an fp32 router's in fp32) and
    the attention kernel's output and logsumexp."""
    mm = 2 if autocast else c             # autocast runs every linear in bf16, an fp32 router's too
    kept = op_kept(layer, hidden, compiled=False)
    return ((F32 if autocast else c) * hidden + sum(m.width * (F32 if m.fp32 and not autocast else mm) for m in kept)
            + kernel(layer.attention, spec, mm))


def compiled_problem(d, spec, autocast: bool) -> str | None:
    """Why compiled blocks of a decoder transformers builds (read from its module, or a closed form
    with MoE or q/k norms) are not modelled for this job (None when they are)."""
    name = d.hf_model_type or "this"
    if autocast:
        return ("compiled blocks under autocast (ddp with bf16-mixed) are not modelled; use fsdp (bf16 compute "
                "over fp32 masters), or --precision bf16 / fp32")
    if spec.lora is not None:
        return (f"compiled blocks with LoRA of {name} decoder (read from its module) are not modelled; plan without "
                "--compile")
    for layer in d.layer_list():
        why = problem(layer, spec)
        if why is not None:
            return f"compiled {why} of {name} decoder (read from its module) are not modelled; plan without --compile"
    return None


def compiled_terms(d, spec, autocast: bool) -> tuple[float, float]:
    """(mean bytes a block keeps, most bytes one recomputed block needs) per micro-batch over the
    blocks of a decoder transformers builds, compiled (layer_compiled per distinct block). A
    recomputed compiled block keeps, while its backward runs, what an uncheckpointed one does;
    layer:N compiles the checkpointed blocks (0, N, 2N...) keeping their input, the others whole."""
    from ...config.spec import layer_every
    from ...errors import NotApplicable
    why = compiled_problem(d, spec, autocast)
    if why is not None:
        raise NotApplicable(why)
    c, ckpt = spec.bytes.compute, spec.activation_checkpointing
    T = spec.micro_batch * spec.seq_len
    stack = d.layer_list()

    def kept(mode):
        found = {}
        for ly in dict.fromkeys(stack):
            tok, block = layer_compiled(ly, d.hidden, spec, c, mode)
            found[ly] = tok * T + block
        return [found[ly] for ly in stack]
    none = kept("none")
    every = layer_every(ckpt)
    if ckpt == "none":
        return sum(none) / len(none), 0.0
    if every is not None:
        per = [c * d.hidden * T if i % every == 0 else n for i, n in enumerate(none)]
        return sum(per) / len(per), max(none[::every])
    per = kept(ckpt)
    redo = none if ckpt == "full" else [n - k for n, k in zip(none, per)]
    return sum(per) / len(per), max(redo)
