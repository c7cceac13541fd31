"""The order a layout is applied in, written once (torchtitan's parallelize_llama):

    split pipeline stages -> float8 -> tensor parallel -> context parallel -> expert parallel
    -> activation checkpointing -> compile -> the family's data-parallel wrap

then one engine: the pipeline's when the layout has stages, else the family's. float8 converts the
linears before they are parallelised, as torchtitan's model converters run at build time, so that
tensor parallelism and FSDP2 see the float8 modules. Each family's runtime module (runtime/backends/ddp.py,
fsdp.py, deepspeed.py) supplies only its own steps: check, place (materialise or cast before
parallelising), wrap, engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.nn as nn

from ..errors import HybridError
from ..layout.layout import Layout
from ..layout.dims import ParallelDims

if TYPE_CHECKING:
    from ..layout.applied import AppliedPlan


@dataclass
class Parallelized:
    """A model with a layout applied, before its engine exists."""

    model: nn.Module
    """The user's module (FSDP2 shards it in place; with stages, other ranks' blocks go to meta)."""
    runners: list = field(default_factory=list)
    """What runs after the data-parallel wrap: [DDP's wrapper, the sharded model, or the model for
    DeepSpeed to initialize] without stages; this rank's wrapped stage chunks with them."""
    tp: object = None
    """backends.tp.TensorParallel when tp > 1."""
    cp: object = None
    """backends.cp.ContextParallel when cp > 1."""
    indices: list = field(default_factory=list)
    """With stages: the stage index of each runner."""
    renames: dict = field(default_factory=dict)
    """With stages: optimizer-state FQN -> the model's own (canonical) name."""
    tied: list = field(default_factory=list)
    """With stages: groups of names that shared one Parameter before the split."""
    plan: object = None
    """hybrid.layout.applied.AppliedPlan: what was applied (decided before applying it)."""


def implementation_of(model: nn.Module) -> str:
    """Which code a module is (hybrid.layout.applied.IMPLEMENTATIONS): hybrid's decoder (or a
    pipeline stage of it), a transformers decoder, or another module."""
    from ..model.decoder import Decoder
    from .stages import DecoderStage, HFDecoderStage
    if isinstance(model, (Decoder, DecoderStage)):
        return "hybrid"
    if isinstance(model, HFDecoderStage):
        return "transformers"
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return "module"
    return "transformers" if isinstance(model, PreTrainedModel) else "module"


def plan_of(model: nn.Module, layout: Layout, spec) -> "AppliedPlan":
    """The AppliedPlan parallelize applies to `model` (hybrid.layout.applied.applied_plan, the
    function the estimate reads too)."""
    from ..layout.applied import applied_plan
    return applied_plan(layout, implementation_of(model), layout.train_spec(spec).precision)


def layout_of_mesh(strategy, mesh, spec) -> Layout:
    """The layout a built mesh stands for (pp 1), at the spec's checkpointing, compile and float8."""
    from .mesh import dim_size, ep_size
    dims = ParallelDims(**{n: dim_size(mesh, n) for n in ("dp_replicate", "dp_shard", "cp", "tp")}, ep=ep_size(mesh))
    return Layout(dims, strategy, spec.activation_checkpointing, compile=spec.compile, float8=spec.float8)


def check_model(model: nn.Module, layout: Layout, spec, software: str) -> None:
    """What the model must have for the layout's cp and ep, and what its experts cannot run under
    (HybridError, one line): checked before any mesh is built. `software`: where the job runs
    (GPUSpec.software of the planned cluster, Runtime.software of a rank)."""
    dims = layout.dims
    from ..model.profile import runs_grouped_experts
    problem = layout.dp.family_obj.autocast_experts_problem(layout, spec, runs_grouped_experts(model), software)
    if problem is not None:
        raise problem
    if dims.cp > 1:
        from .backends.cp import check_context_parallel
        check_context_parallel(model, dims.cp, spec.seq_len)
    if dims.ep > 1:
        from .backends.ep import check_expert_parallel
        check_expert_parallel(model, dims.ep, layout.dp, layout.pipeline is not None or dims.pp > 1, dims.tp)
    from .loss import check_loss
    split = dims.tp > 1 or dims.cp > 1 or dims.pp > 1 or layout.pipeline is not None
    check_loss(model, spec, f"tp {dims.tp}, cp {dims.cp}, pp {dims.pp}" if split else None)
    check_quantized_base(model, layout)


def check_quantized_base(model: nn.Module, layout: Layout | None) -> None:
    """A bitsandbytes-quantised base trains on CUDA (its 4-bit and int8 matmuls), whole on every
    rank: a family that runs it (Family.runs_bitsandbytes_base), no tp, cp or pipeline stages
    (layout None: the device only)."""
    from ..model.lora import quantization_of
    kind = quantization_of(model)
    if kind is None:
        return
    import torch
    if not torch.cuda.is_available():
        raise HybridError(f"this model's base is bitsandbytes-quantised ({kind}), which trains on CUDA only; plan it "
                          "anywhere with `hybrid plan MODEL --lora-rank R --quantize-base nf4`, train it on CUDA GPUs")
    if layout is None:
        return
    d = layout.dims
    if not layout.dp.family_obj.runs_bitsandbytes_base or d.tp > 1 or d.cp > 1 or d.pp > 1:
        raise HybridError(f"{layout.label}: a bitsandbytes-quantised ({kind}) base trains here as whole replicas "
                          "(FSDP2 and ZeRO-3 would shard away its quantisation state); pass strategy='ddp' with "
                          "tp, cp and pp 1")


def frozen_to_compute_dtype(module: nn.Module, spec) -> None:
    """Under the mixed precisions a frozen floating-point parameter (a LoRA base) has no fp32
    master to keep, so it is held in the compute dtype, as the estimate counts it (spec.frozen_bytes);
    trainable parameters keep their fp32 masters."""
    from .backends.base import compute_dtype
    low = compute_dtype(spec)
    if low is None:
        return
    import torch
    for p in module.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype == torch.float32:
            p.data = p.data.to(low)


def parallelize(model: nn.Module, layout: Layout, mesh, spec, runtime, options=None) -> Parallelized:
    """Apply `layout` to `model` on this rank's `mesh` (ParallelDims.build_mesh), in the one order."""
    spec = layout.train_spec(spec)
    family = layout.dp.family_obj
    backend = family.runtime()
    family.check(layout)
    backend.check(layout.dp, mesh, spec, runtime)
    check_model(model, layout, spec, runtime.software)
    if layout.pipeline is not None and spec.precision == "fp16-mixed":
        raise HybridError("fp16-mixed loss scaling is not wired through pipeline schedules; use bf16-mixed or fp32 "
                          "with pp > 1")
    from .loss import apply_loss
    apply_loss(model, spec)                 # the head and loss (chunked or fused): whole models only
    out = Parallelized(model, plan=plan_of(model, layout, spec))
    pieces = [model] if layout.pipeline is None else split_stages(model, layout, mesh, out)
    for piece in pieces:
        runner, out.tp, out.cp = parallelize_piece(piece, layout, mesh, spec, runtime, options,
                                                   staged=layout.pipeline is not None)
        out.runners.append(runner)
    return out


def parallelize_piece(piece: nn.Module, layout: Layout, mesh, spec, runtime, options=None, staged: bool = False):
    """The order on one module (the model, or one pipeline stage: `staged`); returns (what runs
    after the data-parallel wrap, the TensorParallel record or None, the ContextParallel or None)."""
    from .activation_checkpoint import apply_activation_checkpointing
    from .compile import apply_compile
    from .float8 import apply_float8
    backend, dims = layout.dp.family_obj.runtime(), layout.dims
    tp = cp = None
    frozen_to_compute_dtype(piece, spec)
    backend.place(layout.dp, piece, spec, runtime)
    apply_float8(piece, spec, fsdp=backend.float8_all_gather(layout, staged))
    if dims.tp > 1:
        from .backends.tp import apply_tensor_parallel
        tp = apply_tensor_parallel(piece, mesh["tp"], plan_of(piece, layout, spec).sequence_parallel)
    if dims.cp > 1:
        from .backends.cp import ContextParallel
        cp = ContextParallel(piece, mesh["cp"])
    if dims.ep > 1:                          # after tp and cp, before checkpointing (torchtitan)
        from .backends.ep import apply_expert_parallel
        apply_expert_parallel(piece, mesh, spec)
    apply_activation_checkpointing(piece, layout.ac)
    apply_compile(piece, spec)               # after checkpointing, before data parallelism (torchtitan)
    return backend.wrap(layout.dp, piece, layout, mesh, spec, runtime, options, staged), tp, cp


def split_stages(model: nn.Module, layout: Layout, mesh, out: Parallelized) -> list[nn.Module]:
    """This rank's pipeline stages of `model` (the model's own module names kept); records the
    renames the optimizer state needs and the tied groups."""
    from .stages import pipeline_stage
    from ..model.profile import names_by_param
    pipe = layout.pipeline
    pp_rank = mesh["pp"].get_local_rank()
    out.tied = [names for names in names_by_param(model).values() if len(names) > 1]
    canonical = {n: names[0] for names in out.tied for n in names[1:]}
    local = pipe.rank_stages(pp_rank)
    chunks = []
    for k, index in enumerate(local):
        lo, hi = pipe.stage_range(index)
        chunk = pipeline_stage(model, lo, hi, first=index == 0, last=index == pipe.stages - 1)
        prefix = "" if len(local) == 1 else f"{k}."          # interleaved: the container's index
        for n, _ in chunk.named_parameters(remove_duplicate=False):
            if prefix or n in canonical:
                out.renames[prefix + n] = canonical.get(n, n)
        chunks.append(chunk)
        out.indices.append(index)
    return chunks


def build_engine(parallel: Parallelized, layout: Layout, mesh, spec, runtime, optimizer_factory, options=None):
    """The engine of a parallelized model: the pipeline's when the layout has stages, else its family's."""
    spec = layout.train_spec(spec)
    if layout.pipeline is not None:
        from .backends.pipeline import pipeline_engine
        engine = pipeline_engine(parallel, layout.pipeline, mesh, runtime, optimizer_factory)
    else:
        backend = layout.dp.family_obj.runtime()
        engine = backend.engine(layout.dp, parallel.model, parallel.runners[0], optimizer_factory, mesh, spec,
                                runtime, options)
        engine.cp = parallel.cp
    engine.tp = parallel.tp
    return engine


def apply_layout(model: nn.Module, layout: Layout, optimizer_factory, mesh, spec, runtime, options=None):
    """parallelize, then the engine: what auto_wrap, tune and the measured estimate run."""
    return build_engine(parallelize(model, layout, mesh, spec, runtime, options), layout, mesh, spec, runtime,
                        optimizer_factory, options)
