"""`hybrid export CKPT OUT`: a consolidated model state dict as safetensors, offline, on the CPU.

Tensors are read from the sharded checkpoint a file-shard at a time (never the whole model at
once), written as HF-style `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`.
A transformers model keeps its keys (tied duplicates dropped, as transformers saves them); our own
llama/gpt2 decoders are renamed to the transformers layout (GPT-2's Conv1D weights transposed)
and get a config.json, so `AutoModelForCausalLM.from_pretrained(OUT)` loads the export.
"""
from __future__ import annotations

import json
import os
import re

from .checkpoint import check_files, read_meta
from .errors import HybridError
from .units import parse_bytes

_LLAMA = [(r"^embed\.", "model.embed_tokens."), (r"^blocks\.(\d+)\.norm1\.", r"model.layers.\1.input_layernorm."),
          (r"^blocks\.(\d+)\.norm2\.", r"model.layers.\1.post_attention_layernorm."),
          (r"^blocks\.(\d+)\.attn\.", r"model.layers.\1.self_attn."), (r"^blocks\.(\d+)\.mlp\.", r"model.layers.\1.mlp."),
          (r"^norm\.", "model.norm."), (r"^lm_head\.", "lm_head.")]
_GPT2 = [(r"^embed\.", "transformer.wte."), (r"^pos_embed\.", "transformer.wpe."),
         (r"^blocks\.(\d+)\.norm1\.", r"transformer.h.\1.ln_1."), (r"^blocks\.(\d+)\.norm2\.", r"transformer.h.\1.ln_2."),
         (r"^blocks\.(\d+)\.attn\.qkv_proj\.", r"transformer.h.\1.attn.c_attn."),
         (r"^blocks\.(\d+)\.attn\.o_proj\.", r"transformer.h.\1.attn.c_proj."),
         (r"^blocks\.(\d+)\.mlp\.fc\.", r"transformer.h.\1.mlp.c_fc."),
         (r"^blocks\.(\d+)\.mlp\.proj\.", r"transformer.h.\1.mlp.c_proj."), (r"^norm\.", "transformer.ln_f."),
         (r"^lm_head\.", "lm_head.")]
_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "gpt2": "GPT2LMHeadModel"}


def _rename(name: str, rules) -> str:
    for pattern, repl in rules:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    raise HybridError(f"no transformers name for parameter {name!r}")


def plan_keys(meta: dict) -> tuple[list[tuple[str, str, bool]], dict | None]:
    """[(checkpoint key, exported key, transpose)] and the config.json to write (or None)."""
    dropped = {name for group in meta.get("tied", []) for name in group[1:]}
    names = [n for n in meta["params"] if n not in dropped]
    info = meta["model"]
    if "decoder" in info:
        d = info["decoder"]
        rules = _GPT2 if d["style"] == "gpt2" else _LLAMA
        from .presets import DecoderConfig
        cfg = DecoderConfig(**d).hf_config()
        cfg["architectures"] = [_ARCH[cfg["model_type"]]]
        transposed = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$") if d["style"] == "gpt2" else None
        out = []
        for n in names:
            new = _rename(n, rules)
            out.append((n, new, bool(transposed and transposed.search(new))))
        return out, cfg
    return [(n, n, False) for n in names], info.get("hf_config")


def export(ckpt: str, out: str, dtype: str | None = None, max_shard: str = "5GB") -> list[str]:
    """Write the export; returns the files written. No process group, no GPU."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    meta = read_meta(ckpt)
    check_files(ckpt, meta)
    limit = parse_bytes(max_shard)
    cast = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in cast:
        raise HybridError(f"unknown dtype {dtype!r}. Available: fp32, bf16, fp16")
    keys, config = plan_keys(meta)
    dcp_dir = os.path.join(ckpt, meta["data"], "dcp")
    reader = dcp.FileSystemReader(dcp_dir)
    md = reader.read_metadata().state_dict_metadata
    shards, current, size = [], [], 0
    for src, dst, transpose in keys:
        entry = md.get(f"model.{src}")
        if entry is None:
            raise HybridError(f"checkpoint {ckpt!r} has no tensor for parameter {src!r}")
        nbytes = entry.size.numel() * (torch.finfo(cast[dtype]).bits // 8 if cast[dtype] else entry.properties.dtype.itemsize)
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append((src, dst, transpose, entry))
        size += nbytes
    if current:
        shards.append(current)
    os.makedirs(out, exist_ok=True)
    written, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        state = {f"model.{src}": torch.empty(e.size, dtype=e.properties.dtype) for src, _, _, e in shard}
        dcp.load(state, storage_reader=dcp.FileSystemReader(dcp_dir), no_dist=True)
        tensors = {}
        for src, dst, transpose, _ in shard:
            t = state.pop(f"model.{src}")
            t = t.t().contiguous() if transpose else t.contiguous()
            tensors[dst] = t.to(cast[dtype]) if cast[dtype] else t
            total += tensors[dst].numel() * tensors[dst].element_size()
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        written.append(name)
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    written.append("model.safetensors.index.json")
    if config is not None:
        config = dict(config)
        if dtype:
            config["torch_dtype"] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f, indent=1)
        written.append("config.json")
    return written
