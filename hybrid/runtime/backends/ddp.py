"""DistributedDataParallel: a full replica per rank, bucketed all-reduce of gradients."""
from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ...errors import HybridError
from ..mesh import replica_group
from .base import Engine, LoopOptions, carry_plain_outputs, compute_dtype, make_scaler, shardable_blocks, to_cpu_state
from ..materialize import materialize, move


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


def check(strategy, mesh, spec, runtime) -> None:
    """Nothing beyond the family's layout rules (Family.check)."""


def check_grouped_experts(module, spec, layout, software: str) -> None:
    """transformers' grouped_mm experts under a wrap that runs mixed precision under autocast over fp32
    weights (torch DDP's) cannot run: the family's rule (Family.autocast_experts_problem), asked of the
    module (profile.runs_grouped_experts), as the estimate asks it of the profile; `software`: where the
    job runs (GPUSpec.software)."""
    from ...model.profile import runs_grouped_experts
    problem = layout.dp.family_obj.autocast_experts_problem(layout, spec, runs_grouped_experts(module), software)
    if problem is not None:
        raise problem


def place(strategy, module, spec, runtime) -> None:
    """Every rank holds the whole model: a meta-built one is materialised on the device first
    (what it cannot run was refused before: parallelize.check_model)."""
    materialize(module, runtime.device)
    move(module, runtime.device, torch.bfloat16 if spec.precision == "bf16" else None)


def float8_all_gather(layout, staged: bool) -> bool:
    """Replication over tp groups and pipeline stages runs through FSDP2 (see wrap)."""
    return _through_fsdp(layout, staged)


def _through_fsdp(layout, staged: bool) -> bool:
    # torch's DDP takes no DTensor parameters and breaks under a pipeline schedule (see wrap): the
    # family's applied wrap (hybrid/layout/applied.py), which the estimate prices too
    return layout.dp.family_obj.applied_wrap(layout, staged)[2] is not None     # reshard_after_forward: FSDP2


def wrap(strategy, module, layout, mesh, spec, runtime, options=None, staged: bool = False):
    """DDP over the replicas. Over tensor-parallel groups or a pipeline stage, replication runs
    through FSDP2 on the (dp_replicate, dp_shard=1) mesh instead: whole parameters on every
    replica, a unit per block and the root kept gathered from forward to backward (each block's
    gradients all-reduced as its backward ends), MixedPrecisionPolicy for the mixed precisions.
    torch's DDP takes no DTensor parameters (its TP bridge, the private
    `_pre_dp_module_transform`, swaps the parameters out of the module between steps, which
    checkpoints cannot follow), and under a pipeline schedule its reducer's bucket rebuild breaks
    (several micro-batches' backward in one iteration: 'rebuilt parameter indices size is not
    same as original model parameters size') and its autocast wraps a forward the schedule does
    not call."""
    options = options or LoopOptions()
    if _through_fsdp(layout, staged):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        low = compute_dtype(spec)
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
        unpack = None if staged else carry_plain_outputs(module)
        kwargs = dict(mesh=mesh["dp_replicate", "dp_shard"], reshard_after_forward=False, mp_policy=mp)
        for block in shardable_blocks(module):
            fully_shard(block, **kwargs)
        fully_shard(module, **kwargs)
        if unpack is not None:
            module.register_forward_hook(unpack)
        return module
    if runtime.traced:        # DDP's C++ reducer reads data: its buckets emulated on fake tensors
        return _EmulatedDDP(module, strategy)
    unpack = carry_plain_outputs(module)
    ddp = DDP(module, device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None,
              process_group=replica_group(mesh), bucket_cap_mb=strategy.config.bucket_cap_mb,
              gradient_as_bucket_view=strategy.config.gradient_as_bucket_view,
              static_graph=strategy.config.static_graph,
              find_unused_parameters=options.find_unused_parameters)
    ddp.register_forward_hook(unpack)
    return ddp


def engine(strategy, model, runner, optimizer_factory, mesh, spec, runtime, options=None) -> Engine:
    if isinstance(runner, (DDP, _EmulatedDDP)):
        optimizer = optimizer_factory([p for p in runner.parameters() if p.requires_grad])
        return DDPEngine(model, runner, optimizer, compute_dtype(spec), runtime.device.type,
                         make_scaler(spec, runtime.device.type, sharded=False))
    from .fsdp import FSDPEngine
    optimizer = optimizer_factory([p for p in model.parameters() if p.requires_grad])
    return FSDPEngine(model, model, optimizer, make_scaler(spec, runtime.device.type, sharded=True))


class _EmulatedDDP(torch.nn.Module):
    """DDP's memory behaviour without its C++ reducer, which reads tensor data and so cannot run
    on fake tensors: the same gradient buckets, allocated at wrap time, with each gradient a view
    into them (gradient_as_bucket_view) or a separate copy; the all-reduce itself costs no memory.
    Inside an accumulation window (no_sync) the reducer is not called: autograd's own gradient tensors
    accumulate beside the buckets until the window's last backward, whose hooks copy each into its
    bucket view and make the view the gradient (Reducer::mark_variable_ready_dense); measured live on
    2 gloo ranks (tests/measure/test_matrix.py)."""

    def __init__(self, module, strategy):
        super().__init__()
        self.module, self.view = module, strategy.config.gradient_as_bucket_view
        self.require_backward_grad_sync = True
        """DDP's flag (DDPEngine.set_sync): False inside a window."""
        params = [p for p in module.parameters() if p.requires_grad]
        cap = strategy.config.bucket_bytes
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
            if self.view:
                p.register_post_accumulate_grad_hook(self._into_bucket(flat, offset))
            offset += p.numel()

    def _into_bucket(self, flat, offset: int):
        """The reducer's hook in a synchronising backward: a gradient autograd accumulated on its own is
        copied into its bucket view, which becomes the gradient."""
        def hook(p):
            if self.require_backward_grad_sync and p.grad is not None and p.grad._base is not flat:
                view = flat[offset:offset + p.numel()].view_as(p)
                view.copy_(p.grad)
                p.grad = view
        return hook

    def attach_grads(self):
        if self.view and self.require_backward_grad_sync:     # the reducer hands autograd bucket views as .grad
            for p, flat, off in self.slots:
                if p.grad is None:
                    p.grad = flat[off:off + p.numel()].view_as(p).zero_()

    def forward(self, *args, **kwargs):
        self.attach_grads()
        return self.module(*args, **kwargs)


def traced_apply(strategy, model, optimizer_factory, mesh, spec, runtime, options=None) -> Engine:
    """The whole order (hybrid/runtime/parallelize.py) on fake tensors, as the job runs it: the loss,
    tensor and context parallelism, checkpointing and compile as parallelize applies them; DDP's own
    wrap as _EmulatedDDP (wrap, on a traced rank: its reducer reads tensor data), replication over
    tensor-parallel groups through FSDP2, which runs on fake tensors as it is."""
    from ..parallelize import apply_layout, layout_of_mesh
    return apply_layout(model, layout_of_mesh(strategy, mesh, spec), optimizer_factory, mesh, spec, runtime, options)
