"""LoRA and QLoRA on a decoder (pure, no torch): which linears get adapters, the adapters' sizes,
the quantised base's bytes, and a profile of the adapted model.

Adapters as PEFT builds them (Hu et al. 2021, arXiv 2106.09685, sec. 4.1; peft/tuners/lora/layer.py):
each target linear W (out x in) keeps W frozen and gains A (r x in) and B (out x r), trained.
Quantised bases as bitsandbytes stores them (Dettmers et al. 2023, QLoRA, arXiv 2305.14314, sec. 3;
bitsandbytes/functional.py quantize_4bit and int8_vectorwise_quant), for the block linears only
(transformers' bitsandbytes integration keeps the embeddings, norms and lm_head in the compute dtype).
"""
from __future__ import annotations

import dataclasses
import math

from ..config.spec import LoRA
from ..errors import HybridError
from .presets import DecoderConfig

NF4_BLOCK = 64
"""Elements per absmax of bitsandbytes' 4-bit quantisation (quantize_4bit's default blocksize;
QLoRA sec. 3: 'we use a blocksize of 64 for W')."""
NF4_SCALER_BLOCK = 256
"""Absmax values per second-level constant with double quantisation (quantize_4bit with
compress_statistics=True calls quantize_blockwise(absmax - offset, blocksize=256); QLoRA sec. 3:
'a blocksize of 256 for c2')."""
NF4_TENSOR_CONSTANTS = 4 * 16 + 4
"""Bytes per quantised tensor besides its blocks: the 16-value NF4 code (fp32, get_4bit_type makes
one per tensor) and the absmax mean subtracted before double quantisation (fp32 offset). The
256-value dynamic map of the second level is one tensor bitsandbytes shares (name2qmap)."""


def nf4_bytes(elements: int) -> int:
    """Bytes one tensor of `elements` weights keeps as bitsandbytes nf4 with double quantisation:
    two 4-bit codes per byte, one uint8 absmax per 64 weights, one fp32 absmax per 256 of those,
    and the tensor's constants. Per weight 0.5 + 1/64 + 4/16384 bytes (4.127 bits: QLoRA sec. 3,
    'reduces the memory footprint of the constants from 32/64 = 0.5 bits to 8/64 + 32/(64*256) =
    0.127 bits per parameter')."""
    blocks = math.ceil(elements / NF4_BLOCK)
    return math.ceil(elements / 2) + blocks + 4 * math.ceil(blocks / NF4_SCALER_BLOCK) + NF4_TENSOR_CONSTANTS


def int8_bytes(out_features: int, in_features: int) -> int:
    """Bytes of one out x in weight as LLM.int8 keeps it (Dettmers et al. 2022, arXiv 2208.07339,
    sec. 3.2; bitsandbytes Int8Params: CB int8 and SCB, one fp32 absmax scale per output row)."""
    return out_features * in_features + 4 * out_features


def quantized_bytes(shape: tuple[int, int], method: str) -> int:
    """Bytes of one (out, in) linear weight stored by `method` (nf4 | int8)."""
    out, inp = shape
    return nf4_bytes(out * inp) if method == "nf4" else int8_bytes(out, inp)


def target_shapes(d: DecoderConfig) -> dict[str, list[tuple[int, int]]]:
    """Each target name a block of this decoder has -> the (in, out) shapes of its linears under
    that name (transformers' GPT-2 calls both the attention's and the MLP's output c_proj). MoE
    experts are stacked parameters, not linears PEFT targets: their blocks offer the attention
    projections."""
    h, kv, f, q = d.hidden, d.kv_dim, d.ffn, d.q_dim
    if d.style == "llama":
        attn = {"q_proj": [(h, q)], "k_proj": [(h, kv)], "v_proj": [(h, kv)], "o_proj": [(q, h)]}
        return attn if d.moe else {**attn, "gate_proj": [(h, f)], "up_proj": [(h, f)], "down_proj": [(f, h)]}
    qkv = [(h, h + 2 * kv)]
    return {"qkv_proj": qkv, "o_proj": [(h, h)], "fc": [(h, f)], "proj": [(f, h)],
            "c_attn": qkv, "c_proj": [(h, h), (f, h)], "c_fc": [(h, f)]}


def adapted(d: DecoderConfig, lora: LoRA) -> dict[str, list[tuple[int, int]]]:
    """The target names of `lora` this decoder has, with their (in, out) linears per block. Given
    targets must all exist (one line listing the model's names); the default's absent ones are
    skipped. Our decoder's and transformers' gpt2 names stand for the same linears, so the
    default adapts them once."""
    shapes = target_shapes(d)
    names = _closed_names(d, lora.targets, shapes)
    unknown = [t for t in lora.targets if t not in shapes and t not in names]
    if unknown and not lora.default_targets:
        raise HybridError(f"unknown lora-targets {', '.join(unknown)} for this {d.style}-style decoder"
                          f"{' (MoE experts are not linears)' if d.moe else ''}. Available: {', '.join(shapes)}")
    found = {n: shapes[n] for n in dict.fromkeys(names.get(t, t) for t in lora.targets) if n in shapes}
    if d.style == "gpt2" and lora.default_targets:
        found = {t: found[t] for t in ("qkv_proj", "o_proj", "fc", "proj")}
    return found


def _closed_names(d: DecoderConfig, targets, shapes) -> dict[str, str]:
    """Targets that name one block's linear by its full path (PEFT's 'all-linear' expands to them:
    model.layers.3.mlp.down_proj) -> the closed form's name, where every block's is named; a
    linear adapted in some blocks only is one line (the closed form has one figure per block)."""
    blocks: dict[str, set[int]] = {}
    paths: dict[str, str] = {}
    for t in targets:
        parts = t.split(".")
        index = next((int(p) for p in reversed(parts[:-1]) if p.isdigit()), None)
        if t not in shapes and parts[-1] in shapes and index is not None:
            blocks.setdefault(parts[-1], set()).add(index)
            paths[t] = parts[-1]
    partial = [n for n, got in blocks.items() if got != set(range(d.layers))]
    if partial:
        raise HybridError(f"lora-targets adapt {', '.join(partial)} in some blocks only; this {d.style}-style decoder "
                          "is planned with one figure per block: adapt every block's, or plan the transformers module")
    return paths


READS = {"q_proj": ("attention",), "k_proj": ("attention",), "v_proj": ("attention",), "qkv_proj": ("attention",),
         "c_attn": ("attention",), "o_proj": ("core",), "gate_proj": ("mlp",), "up_proj": ("mlp",), "fc": ("mlp",),
         "c_fc": ("mlp",), "down_proj": ("product",), "proj": ("product",), "c_proj": ("core", "product")}
"""What the closed forms' target names read (anatomy.Linear.reads); GPT-2's c_proj names the
attention's output projection and the MLP's second linear."""


def closed_reads(d: DecoderConfig, lora: LoRA) -> set[str]:
    """The inputs a closed-form decoder's adapted linears read."""
    return {r for name in adapted(d, lora) for r in READS[name]}


def matches(name: str, index: int, target: str) -> bool:
    """Whether PEFT adapts block `index`'s linear at `name` (its path under the block) for this
    target (peft check_target_module_exists: the module's full name equals the target or ends in
    '.' + target; the full name is <blocks>.<index>.<name>, so a target naming the block by its
    index, as PEFT's expanded 'all-linear' does, matches that block alone)."""
    if name == target or name.endswith("." + target):
        return True
    if target.endswith("." + name):
        block = target[:-len(name) - 1]
        return block == str(index) or block.endswith(f".{index}")
    return False


def layer_adapted(layer, index: int, lora: LoRA) -> tuple:
    """The linears (anatomy.Linear) of block `index` of a read stack that `lora` adapts."""
    return tuple(ln for ln in layer.linears if any(matches(ln.name, index, t) for t in lora.targets))


def stack_adapted(d: DecoderConfig, lora: LoRA) -> tuple[tuple, ...]:
    """Per block of a decoder read from its module, the linears `lora` adapts. Given targets must
    each match some linear (one line listing the blocks' linear names); the default's absent ones
    are skipped."""
    if not all(ly.linears for ly in d.stack):
        raise HybridError(f"LoRA adapts the blocks' linears, and this {d.hf_model_type or 'read'} decoder's were not "
                          "read from its module: give a transformers module, a preset or a config.json")
    per = tuple(layer_adapted(ly, i, lora) for i, ly in enumerate(d.stack))
    if not lora.default_targets:
        hit = {t for i, ly in enumerate(d.stack) for ln in ly.linears for t in lora.targets if matches(ln.name, i, t)}
        unknown = [t for t in lora.targets if t not in hit]
        if unknown:
            names = dict.fromkeys(ln.name.rsplit(".", 1)[-1] for ly in d.stack for ln in ly.linears)
            raise HybridError(f"unknown lora-targets {', '.join(unknown)} for this {d.hf_model_type or 'read'} "
                              f"decoder. Available: {', '.join(names)}")
    return per


def adapted_per_block(d: DecoderConfig, lora: LoRA) -> tuple[list[str], int]:
    """The target names that adapt something, and the most linears one block adapts."""
    if not d.stack:
        found = adapted(d, lora)
        return list(found), sum(len(v) for v in found.values())
    per = stack_adapted(d, lora)
    names = [t for t in lora.targets if any(matches(ln.name, i, t) for i, lns in enumerate(per) for ln in lns)]
    return names, max(len(lns) for lns in per)


def _adapter_shapes(d: DecoderConfig, lora: LoRA) -> list[list[tuple[int, int]]]:
    """(in, out) of every adapted linear, per block."""
    if d.stack:
        return [[(ln.in_features, ln.out_features) for ln in lns] for lns in stack_adapted(d, lora)]
    one = [shape for shapes in adapted(d, lora).values() for shape in shapes]
    return [one] * d.layers


def adapter_params(d: DecoderConfig, lora: LoRA) -> int:
    """Trainable elements of the adapters: r x (in + out) per adapted linear, every block."""
    return sum(lora.rank * (i + o) for block in _adapter_shapes(d, lora) for i, o in block)


def largest_block_adapters(d: DecoderConfig, lora: LoRA) -> int:
    """The adapter elements of the block that has the most."""
    return max(sum(lora.rank * (i + o) for i, o in block) for block in _adapter_shapes(d, lora))


def adapter_factored(d: DecoderConfig, lora: LoRA) -> int:
    """Adafactor's row and column vectors over the adapters (A: r + in, B: out + r)."""
    return sum(2 * lora.rank + i + o for block in _adapter_shapes(d, lora) for i, o in block)


def base_linears(d: DecoderConfig) -> list[tuple[int, int]]:
    """(out, in) of one block's linear weights: what a quantised base stores quantised (MoE experts,
    stacked parameters, stay in the compute dtype); a read stack: its largest block's linears."""
    if d.stack and all(ly.linears for ly in d.stack):
        block = max(d.stack, key=lambda ly: sum(ln.in_features * ln.out_features for ln in ly.linears))
        return [(ln.out_features, ln.in_features) for ln in block.linears]
    return [m for m in d.block_matrices() if len(m) == 2]


def base_quantized(d: DecoderConfig, method: str) -> tuple[int, int]:
    """(elements, bytes) of every block's linears stored by `method` (a read stack: each block's
    own linears, as transformers' bitsandbytes integration replaces every nn.Linear but the head)."""
    if d.stack and all(ly.linears for ly in d.stack):
        mats = [(ln.out_features, ln.in_features) for ly in d.stack for ln in ly.linears]
        return sum(o * i for o, i in mats), sum(quantized_bytes(m, method) for m in mats)
    mats = base_linears(d)
    return d.layers * sum(o * i for o, i in mats), d.layers * sum(quantized_bytes(m, method) for m in mats)


def with_lora(profile, lora: LoRA | None):
    """The profile of the model trained with `lora`: a profile that already has frozen parameters
    (a PEFT module, read as it is) is returned unchanged; a whole model (a preset, a config.json or
    a module without adapters) gains its adapters, trainable, with the base frozen and, with
    lora.quantize, its block linears counted quantised."""
    if lora is None:
        return profile
    d = profile.decoder
    if profile.trainable_params < profile.params:
        return profile
    if d is None:
        raise HybridError(f"LoRA adapts a transformer's projections; {profile.name} has no known decoder shape: give "
                          "a preset, a config.json or a transformers module")
    if d.moe:
        raise HybridError(f"LoRA of a mixture-of-experts model ({profile.name}) is not modelled here (its experts "
                          "are stacked parameters, split by expert parallelism); plan a dense model, or fine-tune "
                          "it in full")
    adapters = adapter_params(d, lora)
    if adapters == 0:
        available = (dict.fromkeys(ln.name.rsplit(".", 1)[-1] for ly in d.stack for ln in ly.linears) if d.stack
                     else target_shapes(d))
        raise HybridError(f"lora-targets {', '.join(lora.targets)} match no linear of {profile.name}. Available: "
                          f"{', '.join(available)}")
    q_elems, q_bytes = base_quantized(d, lora.quantize) if lora.quantize else (0, 0)
    per_block = largest_block_adapters(d, lora)
    return dataclasses.replace(
        profile, name=f"{profile.name} + LoRA r{lora.rank}" + (f" ({lora.quantize} base)" if lora.quantize else ""),
        params=profile.params + adapters, trainable_params=adapters, param_bytes=profile.param_bytes + 4 * adapters,
        dtype_bytes=tuple((k, v + (4 * adapters if k == "float32" else 0)) for k, v in profile.dtype_bytes),
        block_params=profile.block_params + per_block, factored_state=adapter_factored(d, lora),
        quantized_params=q_elems, quantized_bytes=q_bytes)


def lora_of(module) -> LoRA | None:
    """The LoRA a PEFT model trains (its active LoraConfig: r, target_modules, lora_dropout, and
    the base's bitsandbytes quantisation), read without importing peft; None for other modules."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    cfg = configs.get(getattr(module, "active_adapter", None)) or next(iter(configs.values()))
    if getattr(cfg, "peft_type", None) is not None and str(getattr(cfg.peft_type, "value", cfg.peft_type)) != "LORA":
        return None
    targets = cfg.target_modules
    targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets or ()))
    return LoRA(rank=int(cfg.r), targets=targets or LoRA(1).targets, quantize=quantization_of(module),
                dropout=float(getattr(cfg, "lora_dropout", 0.0) or 0.0))


def quantization_of(module) -> str | None:
    """nf4 or int8 when the module's parameters are bitsandbytes-quantised (Params4bit / Int8Params), else None."""
    for p in module.parameters():
        kind = type(p).__name__
        if kind == "Params4bit":
            return "nf4"
        if kind == "Int8Params":
            return "int8"
    return None
