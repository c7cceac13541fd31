"""PyTorch FSDP2 (`fully_shard`): per-block units plus the root, on a 1D or 2D (HSDP) mesh."""
from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ..errors import HybridError
from .base import Engine, apply_activation_checkpointing, shardable_blocks


class FSDPEngine(Engine):
    family = "fsdp"

    def full_state_dict(self):
        out = {}
        for k, v in self.model.state_dict().items():
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k] = full.detach().to("cpu", copy=True)
        return out


def fsdp_kwargs(strategy, mesh, spec, runtime) -> dict:
    """fully_shard arguments: the mesh (2D = hybrid sharding), mixed precision, offload."""
    if strategy.offload_params and runtime.device.type != "cuda":
        raise HybridError(f"{strategy.name} offloads parameters from GPU to host memory, which needs "
                          "CUDA; this machine has none. Use fsdp or hsdp")
    fsdp_mesh = mesh["shard"] if mesh.shape[0] == 1 else mesh
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if spec.precision == "bf16-mixed" else MixedPrecisionPolicy())
    offload = CPUOffloadPolicy(pin_memory=True) if strategy.offload_params else OffloadPolicy()
    return dict(mesh=fsdp_mesh, reshard_after_forward=strategy.reshard_after_forward, mp_policy=mp,
                offload_policy=offload)


def apply(strategy, model, optimizer_factory, mesh, spec, runtime) -> FSDPEngine:
    kwargs = fsdp_kwargs(strategy, mesh, spec, runtime)
    if spec.precision == "bf16":
        model.to(torch.bfloat16)
    apply_activation_checkpointing(model, spec.activation_checkpointing)
    for block in shardable_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return FSDPEngine(model, model, optimizer_factory(model.parameters()))
