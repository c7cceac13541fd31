"""PyTorch FSDP2 (`fully_shard`): per-block units plus the root, on a 1D or 2D (HSDP) mesh."""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from .base import Engine, carry_plain_outputs, compute_dtype, full_state, make_scaler, shardable_blocks
from ..materialize import materialize


class FSDPEngine(Engine):
    family = "fsdp"

    def sync_context(self, sync):
        # FSDP2's native no-sync: inside a window gradients accumulate unsharded, reduce-scatter
        # (and HSDP's all-reduce) run only in the window's last backward
        self.model.set_requires_gradient_sync(sync)
        self.model.set_is_last_backward(sync)
        return contextlib.nullcontext()

    def full_state_dict(self):
        return full_state(self.model)

    def tensor_roles(self):
        roles = super().tensor_roles()
        roles["buffers"] = gathered_params(self.model)
        return roles


def gathered_params(model) -> list:
    """The unsharded (all-gathered) parameters: communication buffers, freed and re-made per use."""
    return [t for m in model.modules() if isinstance(m, FSDPModule)
            for group in _param_groups(m) for fp in group.fsdp_params for t in fp.all_gather_outputs]


def _param_groups(module):
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)   # torch >= 2.10 keeps a list
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups


def dp_mesh(mesh):
    """HSDP: replicate over dp_replicate, shard over dp_shard (x cp) (a 2D mesh); else 1D over
    dp_shard (x cp): hybrid.runtime.mesh.fsdp_mesh."""
    from ..mesh import fsdp_mesh
    return fsdp_mesh(mesh)


def fsdp_kwargs(strategy, mesh, spec, runtime) -> dict:
    """fully_shard arguments: the mesh (2D = hybrid sharding), mixed precision, offload."""
    if not runtime.traced:            # a traced run simulates the GPU job on this CPU
        strategy.family_obj.check_device(strategy, spec, runtime.device.type == "cuda")
    fsdp_mesh = dp_mesh(mesh)
    low = compute_dtype(spec)
    mp = (MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low is not None
          else MixedPrecisionPolicy())
    # a traced (fake) run simulates the GPU job on the CPU: offload is accounted afterwards
    offload = (CPUOffloadPolicy(pin_memory=True) if strategy.config.offload_params and not runtime.traced
               else OffloadPolicy())
    return dict(mesh=fsdp_mesh, reshard_after_forward=strategy.config.reshard_after_forward, mp_policy=mp,
                offload_policy=offload, shard_placement_fn=functools.partial(shard_placement, n=fsdp_mesh.size(-1)))


def shard_placement(param, n: int):
    """Where FSDP2 cuts a parameter: dim 0 (its default) unless dim 0 is shorter than the shard
    group, where FSDP2 would pad it to one row per rank (the stacked experts of an MoE block,
    8 x 28672 x 4096 for Mixtral over 64 ranks, would then cost 8x their share): such a parameter
    is cut along its first dimension that the group divides, as torchtitan shards experts."""
    from torch.distributed.tensor import Shard
    if param.dim() < 2 or param.shape[0] >= n:
        return None
    for i in range(1, param.dim()):
        if param.shape[i] % n == 0:
            return Shard(i)
    return None


def check(strategy, mesh, spec, runtime) -> None:
    """Nothing beyond the family's layout rules (fsdp_kwargs asks the family about the device)."""


def place(strategy, module, spec, runtime) -> None:
    """Nothing is allocated before sharding (a meta-built model is materialised shard by shard in
    wrap); pure bf16 casts the parameters first."""
    if spec.precision == "bf16" and any(p.dtype != torch.bfloat16 for p in module.parameters()):
        module.to(torch.bfloat16)


def float8_all_gather(layout, staged: bool) -> bool:
    return True


def wrap(strategy, module, layout, mesh, spec, runtime, options=None, staged: bool = False):
    """fully_shard the blocks, then the module as the root unit; a whole model's plain output
    objects are carried past FSDP's hooks (a stage returns plain tensors)."""
    kwargs = fsdp_kwargs(strategy, mesh, spec, runtime)
    from .ep import shard_experts
    shard_experts(module, mesh, kwargs)             # ep > 1: the experts over their own ranks first
    for block in shardable_blocks(module):
        fully_shard(block, **kwargs)
    unpack = None if staged else carry_plain_outputs(module)
    fully_shard(module, **kwargs)
    if unpack is not None:
        module.register_forward_hook(unpack)            # after FSDP's hook
    materialize(module, "cpu" if strategy.config.offload_params else runtime.device)   # meta-built: shards only
    return module


def engine(strategy, model, runner, optimizer_factory, mesh, spec, runtime, options=None) -> FSDPEngine:
    optimizer = optimizer_factory([p for p in model.parameters() if p.requires_grad])
    return FSDPEngine(model, model, optimizer, make_scaler(spec, runtime.device.type, sharded=True))


def apply(strategy, model, optimizer_factory, mesh, spec, runtime, options=None) -> FSDPEngine:
    """The whole order (hybrid/runtime/parallelize.py) for the layout `mesh` stands for."""
    from ..parallelize import apply_layout, layout_of_mesh
    return apply_layout(model, layout_of_mesh(strategy, mesh, spec), optimizer_factory, mesh, spec, runtime, options)


traced_apply = apply   # FSDP2 runs as it is under fake tensors and a fake process group


def traced_proxy(strategy):
    """The strategy whose traced program `strategy` runs: a traced run ignores host offload (fsdp_kwargs,
    wrap: the fake job stays on this CPU; measure/traced.py accounts the host state afterwards), so an
    offloading preset traces as the same preset without it (measure/traced.traced_program)."""
    from dataclasses import replace
    if not strategy.config.offload_params:
        return strategy
    return replace(strategy, config=replace(strategy.config, offload_params=False, offload_optimizer=False))
