"""Tensor parallelism, the inner mesh dimension: DTensor `parallelize_module`, applied first
(torchtitan's order: TP, then activation checkpointing, then data-parallel sharding).

Our llama-style decoder (Megatron-LM's layout, Shoeybi et al. arXiv 1909.08053, with sequence
parallelism from Korthikanti et al. arXiv 2205.05198):
  embed         row-wise (vocab-sharded), output sequence-sharded
  norms         sequence parallel: the residual stream is sharded on the sequence between blocks
  q, k, v       column-wise (heads split); o_proj row-wise, output reduce-scattered on the sequence
  gate, up      column-wise; down row-wise, output reduce-scattered on the sequence
  lm_head       column-wise, logits vocab-sharded; the loss is computed on the shards (loss parallel)
transformers decoders run the same layout (_hf_plan): their own `base_model_tp_plan` says which
projections are column- and row-wise; sequence parallelism and the vocab-parallel loss are on.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.nn as nn

from ...errors import HybridError
from ...model.tp_plan import HF_LAYER_STYLES, HFPlan, decoder_problem

__all__ = ["HF_LAYER_STYLES", "TensorParallel", "apply_tensor_parallel", "check_tensor_parallel", "hf_plan_problem"]


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


def hf_plan_problem(model) -> str | None:
    """Why hybrid's sequence-parallel plan cannot run this transformers decoder (one line naming
    the fix), or None: it needs the model's `base_model_tp_plan` with only the per-layer entries
    of HF_LAYER_STYLES, dense MLPs, and an `embed_tokens`, `layers` and `norm` in its base model
    (hybrid/model/tp_plan.py HFPlan.problem: the planner asks the same of a decoder read from its module)."""
    return HFPlan.of(model).problem()


def _hf_plan(model, first: bool = True, last: bool = True, stage: bool = False):
    """A transformers decoder with sequence parallelism and a vocab-parallel loss, the layout our
    decoders run (the model's own base_model_tp_plan says which projections are column- and
    row-wise): the embedding is vocab-sharded with a replicated output, since the model reads the
    sequence length from it for positions and masks; the residual stream is sequence-sharded from
    the first layer's input to the final norm; norms run sequence-parallel (q/k norms on this
    rank's heads, their weights' gradients all-reduced); the head is column-wise with vocab-sharded
    logits for torch's loss_parallel. A pipeline stage (runtime/stages.HFDecoderStage; first/last:
    whether it holds the embedding / the final norm and head) places what it holds, its layers under
    their model indices; it takes its positions from the token ids, so its embedding's output is this
    rank's sequence shard (reduce-scattered, as our decoder's), which it passes on across the stage
    boundary: no replicated copy to convert (tests/measure/test_matrix.py, 4 ranks)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    problem = (model.hf_plan.problem() if hasattr(model, "hf_plan") else hf_plan_problem(model))
    if problem:
        raise HybridError(problem)
    prefix = getattr(model, "base_model_prefix", "model")
    inner = getattr(model, prefix)
    base = model.config.base_model_tp_plan
    styles = {"colwise": ColwiseParallel, "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)),
              "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=2, use_local_output=True)}
    plan = {}
    if first:
        plan[f"{prefix}.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(),
                                                         output_layouts=Shard(1) if stage else Replicate())
    if last:
        plan[f"{prefix}.norm"] = SequenceParallel(use_local_output=True)
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    layers = inner.layers.items() if isinstance(inner.layers, nn.ModuleDict) else enumerate(inner.layers)
    for n, (i, layer) in enumerate(layers):
        b = f"{prefix}.layers.{i}"
        if n == 0 and first and not stage:      # the replicated embedding output becomes this rank's sequence shard
            plan[b] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                         use_local_output=True)
        for name, child in layer.named_children():
            # a local output: a norm after attention or the MLP (Gemma 3's post-norms) feeds the
            # residual sum with the layer's plain sequence shard
            if name not in ("self_attn", "mlp") and "norm" in type(child).__name__.lower():
                plan[f"{b}.{name}"] = SequenceParallel(use_local_output=True)
        plan[f"{b}.self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                    desired_input_kwarg_layouts={"hidden_states": Replicate()})
        plan[f"{b}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for pattern, style in base.items():
            plan[f"{b}.{pattern.removeprefix('layers.*.')}"] = styles[style]()
    return plan, True


def check_tensor_parallel(model: nn.Module, tp: int) -> None:
    """tp must split heads and key/value heads evenly; the model needs a plan (hybrid/model/tp_plan.py,
    the rule the planner's tp_degrees asks). A transformers model is judged from its config and module
    tree, not by reading its anatomy (which runs its norms: not on the fake tensors a trace builds)."""
    from ...model.decoder import Decoder
    if isinstance(model, Decoder):
        problem = decoder_problem(model.config, tp, type(model).__name__)
    else:
        problem = HFPlan.of(model).problem(tp)
    if problem:
        raise HybridError(problem)


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = True) -> TensorParallel:
    """Shard the model's matrices over `tp_mesh` in place; a tied embedding/head stays tied.
    `sequence_parallel`: the applied plan's (hybrid/layout/applied.py); both plans here run it
    with the vocab-parallel loss, the layout the estimate prices."""
    from torch.distributed.tensor.parallel import parallelize_module
    if not sequence_parallel:
        raise HybridError("tensor parallelism runs with sequence parallelism here (the layout the estimate "
                          "prices); use a plan with sequence_parallel on, or tp=1")

    from ...model.decoder import Decoder
    from ..stages import DecoderStage, HFDecoderStage
    tp = tp_mesh.size()
    if isinstance(model, HFDecoderStage):
        # a pipeline stage of a transformers decoder: the whole model's plan and heads decide (a stage
        # holds only some of its parts), its layers, embedding and head placed as the whole model's
        problem = model.hf_plan.problem(tp)
        if problem:
            raise HybridError(problem)
        plan, loss_parallel = _hf_plan(model, model.first, model.last, stage=True)
        parallelize_module(model, tp_mesh, plan)
        model.tp_mesh = tp_mesh
        return TensorParallel(tp, loss_parallel and model.last)
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
    ours = isinstance(model, Decoder)
    embed, head = ((model.embed, model.lm_head) if ours
                   else (model.get_input_embeddings(), model.get_output_embeddings()))
    tied = head is not None and head.weight is embed.weight
    plan, loss_parallel = _our_plan(model, model.config) if ours else _hf_plan(model)
    parallelize_module(model, tp_mesh, plan)
    if tied:    # both sides are Shard(0) over vocab: one parameter again
        head.weight = embed.weight
    return TensorParallel(tp, loss_parallel)
