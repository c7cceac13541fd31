"""What is being trained: batch shape, precision, optimizer, checkpointing (pure, no torch)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ..errors import HybridError, short

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16"]
Optimizer = Literal["adamw", "adamw-bf16", "adamw-8bit", "adafactor", "lion", "muon", "sgd"]
Loss = Literal["eager", "chunked", "fused"]
Checkpointing = Literal["none", "selective", "op", "full"]
"""Plus "layer:N" (full recomputation of every N-th block), checked by checkpointing()."""
Attention = Literal["sdpa", "eager"]
Quantize = Literal["nf4", "int8"]

_ALIASES = {"flash": "sdpa", "bf16_mixed": "bf16-mixed", "mixed": "bf16-mixed", "adam": "adamw",
            "adamw8bit": "adamw-8bit", "adamw_8bit": "adamw-8bit", "adamw_bf16": "adamw-bf16",
            "fp16_mixed": "fp16-mixed", "16-mixed": "fp16-mixed",
            "off": "none", "false": "none", "true": "full"}


def choice(kind: str, value: str, allowed) -> str:
    """Normalise a user string to one of `allowed` once, at the boundary."""
    options = get_args(allowed) if not isinstance(allowed, (tuple, list)) else allowed
    v = str(value).strip().lower()
    v = _ALIASES.get(v, v)
    if v not in options:
        raise HybridError(f"unknown {kind} {value!r}. Available: {', '.join(options)}")
    return v


def checkpointing(value) -> str:
    """none | selective | op | full | layer:N (N a positive integer), normalised."""
    v = str(value).strip().lower()
    if v.startswith("layer:"):
        n = v.split(":", 1)[1]
        if not n.isdigit() or int(n) < 1:
            raise HybridError(f"activation checkpointing {value!r}: layer:N needs a positive integer N (full "
                              "recomputation of every N-th block), e.g. layer:2")
        return f"layer:{int(n)}"
    try:
        return choice("activation checkpointing", v, Checkpointing)
    except HybridError:
        raise HybridError(f"unknown activation checkpointing {value!r}. Available: none, selective, op, full, "
                          "layer:N") from None


def layer_every(mode: str) -> int | None:
    """N of a layer:N checkpointing mode, else None."""
    return int(mode.split(":", 1)[1]) if mode.startswith("layer:") else None


def recomputed_blocks(mode: str, blocks: int) -> list[bool]:
    """Per block, whether checkpointing mode `mode` reruns its forward in backward: every block under
    full, selective and op, blocks 0, N, 2N... under layer:N (torchtitan's ac_freq), none under none.
    The runtime checkpoints these (runtime/activation_checkpoint.py) and the estimate prices them."""
    every = layer_every(mode)
    return [mode != "none" and (every is None or i % every == 0) for i in range(blocks)]


MOE_IMBALANCE = 1.25
"""Tokens the busiest expert-parallel rank receives over the mean (tokens x top_k / ep per rank
of an ep group): the headroom MoE training recipes give their experts. Switch Transformer
(Fedus et al. 2021, arXiv 2101.03961, sec. 2.2 and Table 1) trains with expert capacity factors
1.0-1.25 under its load-balancing loss, 1.25 dropping few tokens; dropless training (torchtitan,
Megatron-LM with no capacity factor, DeepEP) has no cap, and early in training a rank can receive
more (deepseek-ai/DeepEP issue #99: out of memory in the first steps): raise --moe-imbalance
for a cold start, up to ep (every token to one rank's experts)."""

FLOAT8_RECIPES = ("tensorwise", "mxfp8")
"""torchao's float8 training recipes the estimate prices: tensorwise (torchao.float8, Ada/Hopper and
newer, CUDA and ROCm MI300+) and mxfp8 (torchao.prototype.mx_formats, Blackwell's block-scaled
tensor cores through cuBLAS: CUDA only)."""

DEFAULT_SEQ_LEN = 4096
"""Sequence length when none is given: the model's maximum positions, at most this (the common
pre-training length of 7B-70B recipes); this when the model states no maximum (a module without a
readable decoder) and for a TrainSpec built without one. The one default of the CLI's --seq-len
help, plan, estimate, auto_wrap and tune (default_seq_len)."""


def default_precision(cluster) -> str:
    """The precision a job trains in unless told: bf16-mixed where the GPU computes in bf16,
    fp16-mixed (with loss scaling) on older CUDA GPUs (V100, T4), fp32 on CPU ranks (what auto_wrap
    runs there). One rule for plan, estimate, auto_wrap and tune."""
    if not cluster.gpu.is_cuda:
        return "fp32"
    return "bf16-mixed" if cluster.gpu.bf16 else "fp16-mixed"


def check_precision(precision: str, cluster) -> None:
    """bf16 precisions need a GPU that computes in bf16 (Ampere or newer)."""
    if "bf16" in str(precision).lower() and cluster.gpu.is_cuda and not cluster.gpu.bf16:
        raise HybridError(f"{cluster.gpu.name} has no bf16 (it needs Ampere or newer): use --precision fp16-mixed "
                          "or fp32")


def default_seq_len(max_positions: int | None) -> int:
    """The model's maximum positions, at most DEFAULT_SEQ_LEN; DEFAULT_SEQ_LEN when it states none."""
    return min(max_positions or DEFAULT_SEQ_LEN, DEFAULT_SEQ_LEN)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "qkv_proj", "fc", "proj", "c_attn", "c_proj", "c_fc")
"""Default --lora-targets: the attention and MLP projections (llama-style names, which transformers
and our decoder share, then gpt2-style: our decoder's qkv_proj, o_proj, fc, proj and transformers'
c_attn, c_proj, c_fc); the names a model does not have are skipped."""

MAX_LORA_RANK = 65536
"""Largest --lora-rank: beyond any adapter (LoRA papers use 1-256) and below any hidden size that
would make an adapter pointless."""


@dataclass(frozen=True)
class LoRA:
    """Low-rank adapters on a frozen base (Hu et al. 2021, arXiv 2106.09685), as PEFT builds them:
    each target linear (out x in) gains A (rank x in) and B (out x rank), trained; everything else
    frozen. With `quantize`, the base linears are stored quantised (QLoRA, arXiv 2305.14314)."""

    rank: int
    """r, the adapters' inner dimension (PEFT's LoraConfig.r), 1 to MAX_LORA_RANK."""
    targets: tuple[str, ...] = LORA_TARGETS
    """Module-name suffixes that get adapters (PEFT's target_modules): the given ones must all
    exist in the model; the default's names a model lacks are skipped."""
    quantize: Quantize | None = None
    """nf4 (bitsandbytes 4-bit NormalFloat, blocksize 64, double-quantised constants) | int8
    (LLM.int8, row-wise scales) for the base's block linears; None: the base in the training dtype."""
    dropout: float = 0.0
    """PEFT's lora_dropout on each adapter's input (default 0: PEFT's, no mask saved)."""

    def __post_init__(self):
        r = self.rank
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= MAX_LORA_RANK:
            raise HybridError(f"lora-rank must be a positive integer at most {MAX_LORA_RANK} (the adapters' inner "
                              f"dimension, e.g. 16), got {r!r}")
        targets = (self.targets,) if isinstance(self.targets, str) else self.targets
        if not isinstance(targets, (tuple, list)) or not targets \
                or not all(isinstance(t, str) and t.strip() for t in targets):
            raise HybridError(f"lora-targets must be module-name suffixes, e.g. q_proj,v_proj; got {self.targets!r}")
        object.__setattr__(self, "targets", tuple(dict.fromkeys(t.strip() for t in targets)))
        if self.quantize is not None:
            object.__setattr__(self, "quantize", choice("quantize-base", self.quantize, Quantize))
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d < 1.0:
            raise HybridError(f"lora-dropout must be a number in [0, 1), got {d!r}")

    @property
    def default_targets(self) -> bool:
        return self.targets == LORA_TARGETS

    def to_dict(self) -> dict:
        return {"lora_rank": self.rank, **({} if self.default_targets else {"lora_targets": list(self.targets)}),
                **({"quantize_base": self.quantize} if self.quantize else {}),
                **({"lora_dropout": self.dropout} if self.dropout else {})}


@dataclass(frozen=True)
class DtypeBytes:
    """Bytes per element of each kind of tensor under a precision mode."""

    param: int
    """Parameter storage the optimizer updates (fp32 master in bf16-mixed)."""
    compute: int
    """Weights and activations inside forward/backward."""
    grad: int
    """Gradients as the optimizer sees them."""
    state: int
    """Each optimizer state element (torch keeps states in the parameter's dtype)."""


_DTYPE_BYTES = {
    "fp32": DtypeBytes(param=4, compute=4, grad=4, state=4),
    "bf16-mixed": DtypeBytes(param=4, compute=2, grad=4, state=4),
    "fp16-mixed": DtypeBytes(param=4, compute=2, grad=4, state=4),
    "bf16": DtypeBytes(param=2, compute=2, grad=2, state=2),
}


@dataclass(frozen=True)
class TrainSpec:
    """One training step's shape and numerics, per rank."""

    micro_batch: int = 1
    """Sequences per rank per forward (the micro-batch). Must be >= 1."""
    seq_len: int = DEFAULT_SEQ_LEN
    """Tokens per sequence (default DEFAULT_SEQ_LEN). Must be >= 1 and at most the model's maximum positions."""
    precision: Precision = "bf16-mixed"
    """fp32; bf16-mixed (bf16 compute, fp32 master weights, grads and optimizer state);
    fp16-mixed (the same in fp16, with dynamic loss scaling: GPUs without bf16); or bf16
    (everything in bf16, optimizer state included)."""
    optimizer: Optimizer = "adamw"
    """What the optimizer keeps per trainable parameter (hybrid/families/placement.optimizer_state_bytes):
    adamw (exp_avg and exp_avg_sq in the state dtype); adamw-bf16 (both in bf16, as torchtitan and
    DeepSeek-V3 run it); adamw-8bit (bitsandbytes' AdamW8bit: 8-bit blockwise states with an fp32
    absmax per 256 elements, fp32 states for tensors under 4096 elements); adafactor (factored
    second moment: one row and one column vector per matrix, no first moment); lion (one
    momentum); muon (a momentum on the blocks' 2-D matrices, AdamW on embeddings, head and vectors;
    the Newton-Schulz step gathers each whole matrix); sgd with momentum (one state)."""
    activation_checkpointing: Checkpointing = "none"
    """none; selective (keep matmul/attention outputs, recompute the rest); op (torchtitan's per-op
    policy: keep every second matmul output, counted per block from the first, and the attention
    output); full (keep only each block's input and recompute the block in backward); layer:N
    (full recomputation of every N-th block, blocks 0, N, 2N...; the others keep everything)."""
    loss: Loss = "eager"
    """How the head and cross-entropy run (hybrid/estimation/memory/activations.loss_terms): eager
    (the whole logits, upcast to fp32); chunked (torchtune's CEWithChunkedOutputLoss: the head and
    cross-entropy per chunk of tokens, each chunk recomputed in backward, so the whole logits never
    exist); fused (Liger's fused linear cross-entropy: logits made and differentiated chunk by
    chunk inside forward, the gradient kept). Under tp every kind is vocab-parallel."""
    attention: Attention = "sdpa"
    """sdpa (fused/flash kernels: no s x s score matrix kept) or eager (softmax scores kept)."""
    gradient_accumulation: int = 1
    """Micro-batches per optimizer step; the global batch is micro_batch x this x data-parallel
    ranks. 1 = no accumulation."""
    global_batch: int | None = None
    """Sequences per optimizer step over all data-parallel ranks. None: micro_batch x
    gradient_accumulation x the layout's data-parallel ranks, as given. Set: the planner chooses
    each layout's micro-batch and accumulation so that their product with its data-parallel ranks
    is this (hybrid/planning/batch.py); micro_batch and gradient_accumulation are then that layout's."""
    compile: bool = False
    """torch.compile each block (and the loss) as torchtitan does (hybrid/runtime/compile.py): the
    blocks keep what AOTAutograd's partitioner saves (hybrid/measure/compiled.py), and fusion
    removes most of eager's memory-bound elementwise traffic (hybrid/estimation/cost/step.py). False: eager."""
    float8: bool = False
    """torchao's float8 training of the blocks' linears (tensorwise scaling, float8 all-gather
    under FSDP2), behind compile, as torchtitan's float8 converter (hybrid/runtime/float8.py): their
    matmuls at the float8 peak, plus the casts. Needs compile and a GPU with float8 tensor
    cores (Ada, Hopper, Blackwell, MI300). False: the compute dtype."""
    float8_recipe: str = "tensorwise"
    """Which float8 recipe `float8` runs (FLOAT8_RECIPES): tensorwise (torchao's Float8Linear, one
    scale per tensor, at the GPU's fp8 peak) or mxfp8 (torchao's MX recipe, one e8m0 scale per 32
    elements, cuBLAS's MXFP8 GEMM: Blackwell only, at its MXFP8 peak). Never chosen for the user:
    tensorwise unless asked (torchao's B200 runs: tensorwise 25% over bf16, mxfp8 20%)."""
    moe_imbalance: float = MOE_IMBALANCE
    """Mixture-of-experts models with expert parallelism (ep > 1): tokens the busiest rank's
    experts receive over the mean, >= 1 (MOE_IMBALANCE: the published default). Scales the routed
    activations, the all-to-all buffers and the busiest rank's expert compute; 1 = perfectly
    balanced routing. Unused for dense models and at ep 1 (a rank computes its own tokens)."""
    fault_tolerant: bool = False
    """torchft replica groups (hybrid/runtime/ft.py): each dp_replicate group a failure domain; the
    gradients are averaged across the groups by torchft's all-reduce after backward (unhidden),
    and every step takes a quorum (hybrid/estimation/cost/step.py). False: one job, no failover."""

    lora: LoRA | None = None
    """Fine-tune low-rank adapters on a frozen base (QLoRA with lora.quantize): only the adapters
    have fp32 masters, gradients and optimizer state; the frozen base is held in the compute dtype
    under the mixed precisions (nothing updates it, so it has no fp32 master) or quantised. None:
    every parameter the model trains (requires_grad) is trained in full."""

    def __post_init__(self):
        if self.lora is not None and not isinstance(self.lora, LoRA):
            raise HybridError(f"lora must be a hybrid LoRA(rank=...), got {type(self.lora).__name__}")
        for attr in ("micro_batch", "seq_len", "gradient_accumulation", "global_batch"):
            v = getattr(self, attr)
            if v is None and attr == "global_batch":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise HybridError(f"{attr.replace('_', '-')} must be a positive integer, got {v!r}")
        if isinstance(self.moe_imbalance, bool) or not isinstance(self.moe_imbalance, (int, float)) \
                or not 1.0 <= self.moe_imbalance <= 1e6:
            raise HybridError(f"moe-imbalance must be a number >= 1 (the busiest expert-parallel rank's tokens over "
                              f"the mean; 1 = balanced), got {self.moe_imbalance!r}")
        for attr in ("compile", "float8", "fault_tolerant"):
            if not isinstance(getattr(self, attr), bool):
                raise HybridError(f"{attr} must be True or False, got {getattr(self, attr)!r}")
        if self.float8_recipe not in FLOAT8_RECIPES:
            raise HybridError(f"unknown float8 recipe {short(self.float8_recipe)}. Available: "
                              f"{', '.join(FLOAT8_RECIPES)}")
        if self.float8_recipe != "tensorwise" and not self.float8:
            raise HybridError(f"float8 recipe {self.float8_recipe} goes with float8: add --float8 (float8=True)")
        if self.float8 and not self.compile:
            raise HybridError("float8 runs behind torch.compile, as torchtitan runs it (its casts fuse into the "
                              "compiled blocks): add --compile (compile=True)")
        object.__setattr__(self, "precision", choice("precision", self.precision, Precision))
        object.__setattr__(self, "optimizer", choice("optimizer", self.optimizer, Optimizer))
        object.__setattr__(self, "activation_checkpointing", checkpointing(self.activation_checkpointing))
        object.__setattr__(self, "attention", choice("attention", self.attention, Attention))
        object.__setattr__(self, "loss", choice("loss", self.loss, Loss))

    @property
    def mixed(self) -> bool:
        """Low-precision compute over fp32 master weights (bf16-mixed or fp16-mixed)."""
        return self.precision in ("bf16-mixed", "fp16-mixed")

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def bytes(self) -> DtypeBytes:
        return _DTYPE_BYTES[self.precision]

    @property
    def frozen_bytes(self) -> int:
        """Bytes per element of a frozen (requires_grad=False) parameter: the compute dtype under
        the mixed precisions (nothing updates it, so no fp32 master is kept; the runtime casts it:
        runtime/parallelize.py), else the parameter dtype."""
        b = self.bytes
        return b.compute if self.mixed else b.param

    def to_dict(self) -> dict:
        return {"micro_batch": self.micro_batch, "seq_len": self.seq_len, "precision": self.precision,
                "optimizer": self.optimizer, "activation_checkpointing": self.activation_checkpointing,
                "attention": self.attention, **({"loss": self.loss} if self.loss != "eager" else {}),
                "gradient_accumulation": self.gradient_accumulation,
                **({"global_batch": self.global_batch} if self.global_batch is not None else {}),
                **({"compile": True} if self.compile else {}), **({"float8": True} if self.float8 else {}),
                **({"float8_recipe": self.float8_recipe} if self.float8_recipe != "tensorwise" else {}),
                **({"moe_imbalance": self.moe_imbalance} if self.moe_imbalance != MOE_IMBALANCE else {}),
                **({"fault_tolerant": True} if self.fault_tolerant else {}),
                **(self.lora.to_dict() if self.lora else {})}
