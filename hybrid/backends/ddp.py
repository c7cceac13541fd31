"""DistributedDataParallel: a full replica per rank, bucketed all-reduce of gradients."""
from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import HybridError
from ..mesh import replica_group
from .base import (Engine, LoopOptions, apply_activation_checkpointing, carry_plain_outputs, compute_dtype,
                   make_scaler, materialize, prepare, to_cpu_state)


class DDPEngine(Engine):
    family = "ddp"

    def __init__(self, model, ddp, optimizer, autocast_dtype, device_type, scaler=None):
        super().__init__(model, ddp, optimizer, scaler)
        self.autocast_dtype, self.device_type = autocast_dtype, device_type

    def set_sync(self, sync):
        # what DDP.no_sync() does; the flag is read in forward, so it is set before it
        self.runner.require_backward_grad_sync = sync

    def translate_error(self, e):
        text = str(e)
        if "Expected to have finished reduction" in text or "find_unused_parameters" in text:
            return HybridError("some parameters got no gradient in a step (not used by forward), and DDP waits for "
                               "every gradient: pass find_unused_parameters=True to auto_wrap")
        return None

    def forward(self, *args, **kwargs):
        ctx = (torch.autocast(self.device_type, dtype=self.autocast_dtype) if self.autocast_dtype
               else contextlib.nullcontext())
        with ctx:
            return self.runner(*args, **kwargs)

    def full_state_dict(self):
        return to_cpu_state(self.model.state_dict().items())

    def zero_grads(self):
        if isinstance(self.runner, _EmulatedDDP):
            self.runner.attach_grads()           # gradients live in the buckets
        super().zero_grads()


def apply(strategy, model, optimizer_factory, mesh, spec, runtime, options: LoopOptions | None = None) -> DDPEngine:
    options = options or LoopOptions()
    dtype = torch.bfloat16 if spec.precision == "bf16" else None
    materialize(model, runtime.device)                  # a meta-built model: every rank holds it all
    model.to(device=runtime.device, dtype=dtype)
    if mesh["tp"].size() > 1:
        if mesh["cp"].size() > 1:
            raise HybridError(f"{strategy.name} with tp and cp: replication over tensor-parallel groups runs through "
                              "FSDP2 on the dp_replicate mesh, which has no cp dimension here; use an fsdp strategy "
                              "with tp and cp")
        return _replicate_over_tp(strategy, model, optimizer_factory, mesh, spec, runtime)
    from ..float8 import apply_float8
    apply_float8(model, spec, fsdp=False)
    apply_activation_checkpointing(model, spec.activation_checkpointing)
    from ..compile import apply_compile
    apply_compile(model, spec)                  # after checkpointing, before the DDP wrap (torchtitan)
    unpack = carry_plain_outputs(model)
    ddp = DDP(model, device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None,
              process_group=replica_group(mesh), bucket_cap_mb=strategy.bucket_cap_mb,
              gradient_as_bucket_view=strategy.gradient_as_bucket_view, static_graph=strategy.static_graph,
              find_unused_parameters=options.find_unused_parameters)
    ddp.register_forward_hook(unpack)
    optimizer = optimizer_factory([p for p in ddp.parameters() if p.requires_grad])
    return DDPEngine(model, ddp, optimizer, compute_dtype(spec), runtime.device.type,
                     make_scaler(spec, runtime.device.type, sharded=False))


def _replicate_over_tp(strategy, model, optimizer_factory, mesh, spec, runtime):
    """DDP over tensor-parallel groups (each replica a tp group, gradients all-reduced across
    replicas). torch's DDP takes no DTensor parameters (its TP bridge, the private
    `_pre_dp_module_transform`, swaps the parameters out of the module between steps, which
    checkpoints cannot follow), so replication runs through FSDP2 on the (dp_replicate, dp_shard=1)
    mesh: whole parameters on every replica, one all-reduce of the gradients, as DDP."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .fsdp import FSDPEngine
    tp = prepare(model, mesh, spec)
    low = compute_dtype(spec)
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    unpack = carry_plain_outputs(model)
    fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"], reshard_after_forward=False, mp_policy=mp)
    model.register_forward_hook(unpack)
    optimizer = optimizer_factory([p for p in model.parameters() if p.requires_grad])
    return FSDPEngine(model, model, optimizer, make_scaler(spec, runtime.device.type, sharded=True), tp=tp)


def wrap_stage(strategy, stage, mesh, spec, runtime, options=None):
    """One pipeline stage replicated over the stage's dp_replicate ranks. torch's DDP under a
    pipeline schedule breaks its reducer's bucket rebuild (several micro-batches' backward in one
    iteration: 'rebuilt parameter indices size is not same as original model parameters size'),
    and its bf16-mixed is autocast around a forward the schedule does not call; so replication
    runs through FSDP2 on the (dp_replicate, dp_shard=1) mesh, as over tp groups: whole parameters
    on every replica, one all-reduce of the gradients per step, MixedPrecisionPolicy for bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    materialize(stage, runtime.device)
    stage.to(device=runtime.device, dtype=torch.bfloat16 if spec.precision == "bf16" else None)
    tp = prepare(stage, mesh, spec)
    low = compute_dtype(spec)
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    fully_shard(stage, mesh=mesh["dp_replicate", "dp_shard"], reshard_after_forward=False, mp_policy=mp)
    return stage, tp


class _EmulatedDDP(torch.nn.Module):
    """DDP's memory behaviour without its C++ reducer, which reads tensor data and so cannot run
    on fake tensors: the same gradient buckets, allocated at wrap time, with each gradient a view
    into them (gradient_as_bucket_view) or a separate copy; the all-reduce itself costs no memory."""

    def __init__(self, module, strategy):
        super().__init__()
        self.module, self.view = module, strategy.gradient_as_bucket_view
        params = [p for p in module.parameters() if p.requires_grad]
        cap = int(strategy.bucket_cap_mb * 1e6)
        self.buckets, self.slots, bucket, size = [], [], [], 0
        for p in reversed(params):              # DDP fills buckets in reverse parameter order
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                self._close(bucket)
                bucket, size = [], 0
        if bucket:
            self._close(bucket)

    def _close(self, bucket):
        flat = torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
        self.buckets.append(flat)
        offset = 0
        for p in bucket:
            self.slots.append((p, flat, offset))
            offset += p.numel()

    def attach_grads(self):
        if self.view:                            # the reducer hands autograd bucket views as .grad
            for p, flat, off in self.slots:
                if p.grad is None:
                    p.grad = flat[off:off + p.numel()].view_as(p).zero_()

    def forward(self, *args, **kwargs):
        self.attach_grads()
        return self.module(*args, **kwargs)


def traced_apply(strategy, model, optimizer_factory, mesh, spec, runtime, options=None) -> DDPEngine:
    apply_activation_checkpointing(model, spec.activation_checkpointing)
    ddp = _EmulatedDDP(model, strategy)
    return DDPEngine(model, ddp, optimizer_factory([p for p in model.parameters() if p.requires_grad]),
                     compute_dtype(spec), runtime.device.type)
