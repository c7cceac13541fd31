"""Tensor parallelism, the inner mesh dimension: DTensor `parallelize_module`, applied first
(torchtitan's order: TP, then activation checkpointing, then data-parallel sharding).

Our llama-style decoder (Megatron-LM's layout, Shoeybi et al. arXiv 1909.08053, with sequence
parallelism from Korthikanti et al. arXiv 2205.05198):
  embed         row-wise (vocab-sharded), output sequence-sharded
  norms         sequence parallel: the residual stream is sharded on the sequence between blocks
  q, k, v       column-wise (heads split); o_proj row-wise, output reduce-scattered on the sequence
  gate, up      column-wise; down row-wise, output reduce-scattered on the sequence
  lm_head       column-wise, logits vocab-sharded; the loss is computed on the shards (loss parallel)
transformers models use their own `base_model_tp_plan` (q/k/v/gate/up column-wise, o/down
row-wise) and the head's `_tp_plan` (unless the head is tied to the replicated input embedding),
without sequence parallelism.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.nn as nn

from ...errors import HybridError


@dataclass
class TensorParallel:
    """What the engines need to know after TP was applied."""
    degree: int
    loss_parallel: bool
    """The logits stay vocab-sharded: forward and backward run under torch's loss_parallel()."""

    def context(self):
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel
        return loss_parallel()


def _our_plan(model, cfg, blocks=None, first=True, last=True):
    """blocks: the block indices present (a pipeline stage's), default all; first/last: whether
    the embedding / the final norm and head are present."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    plan = {}
    if first:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if last:
        plan["norm"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    for i in (range(cfg.layers) if blocks is None else blocks):
        b = f"blocks.{i}"
        plan.update({
            f"{b}.norm1": SequenceParallel(), f"{b}.norm2": SequenceParallel(),
            f"{b}.attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            f"{b}.attn.q_proj": ColwiseParallel(), f"{b}.attn.k_proj": ColwiseParallel(),
            f"{b}.attn.v_proj": ColwiseParallel(), f"{b}.attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            f"{b}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{b}.mlp.gate_proj": ColwiseParallel(), f"{b}.mlp.up_proj": ColwiseParallel(),
            f"{b}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan, True


def _hf_plan(model):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    base = getattr(model.config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "model")
    plan = {}
    for pattern, style in base.items():
        if style not in styles:
            raise HybridError(f"{type(model).__name__}'s tensor-parallel plan uses {style!r} for {pattern}, which "
                              "hybrid does not apply; use tp=1")
        plan[f"{prefix}.{pattern}"] = styles[style]()
    tied = model.get_output_embeddings() is not None and \
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for pattern, style in (getattr(model, "_tp_plan", None) or {}).items():
        # a head tied to the (replicated) input embedding stays replicated with it
        if style in ("colwise_rep", "colwise_gather_output") and not tied:
            plan[pattern] = ColwiseParallel(output_layouts=Replicate())
    return plan, False


def check_tensor_parallel(model: nn.Module, tp: int) -> None:
    """tp must split heads and key/value heads evenly; the model needs a plan."""
    from ...model.decoder import Decoder
    from ...model.profile import decoder_of
    cfg = decoder_of(model)
    if isinstance(model, Decoder) and cfg.style != "llama":
        raise HybridError(f"tensor parallelism needs separate q/k/v projections; {cfg.style} fuses them (qkv_proj): "
                          "use tp=1")
    if not isinstance(model, Decoder) and not getattr(getattr(model, "config", None), "base_model_tp_plan", None):
        raise HybridError(f"{type(model).__name__} has no tensor-parallel plan (hybrid's llama-style decoders and "
                          "transformers models with base_model_tp_plan have one): use tp=1")
    if cfg is not None:
        for what, n in (("attention heads", cfg.heads), ("key/value heads", cfg.n_kv_heads)):
            if n % tp:
                valid = [d for d in range(1, cfg.n_kv_heads + 1) if cfg.n_kv_heads % d == 0 and cfg.heads % d == 0]
                raise HybridError(f"tp {tp} does not divide the {n} {what} of {type(model).__name__}; valid tp: "
                                  f"{', '.join(map(str, valid))}")


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> TensorParallel:
    """Shard the model's matrices over `tp_mesh` in place; a tied embedding/head stays tied."""
    from torch.distributed.tensor.parallel import parallelize_module

    from ...model.decoder import Decoder
    from ..stages import DecoderStage
    tp = tp_mesh.size()
    if isinstance(model, DecoderStage):
        # a pipeline stage of our decoder: its blocks (and embedding / head); the residual stream
        # crosses the stage boundary as this rank's sequence shard, a plain tensor
        if model.config.style != "llama":
            raise HybridError("tensor parallelism needs separate q/k/v projections; gpt2 fuses them: use tp=1")
        plan, loss_parallel = _our_plan(model, model.config, [int(k) for k in model.blocks], model.first, model.last)
        parallelize_module(model, tp_mesh, plan)
        model.tp_mesh = tp_mesh
        return TensorParallel(tp, loss_parallel and model.last)
    check_tensor_parallel(model, tp)
    tied = isinstance(model, Decoder) and model.lm_head.weight is model.embed.weight
    plan, loss_parallel = _our_plan(model, model.config) if isinstance(model, Decoder) else _hf_plan(model)
    parallelize_module(model, tp_mesh, plan)
    if tied:    # both sides are Shard(0) over vocab: one parameter again
        model.lm_head.weight = model.embed.weight
    return TensorParallel(tp, loss_parallel)
