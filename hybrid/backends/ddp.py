"""DistributedDataParallel: a full replica per rank, bucketed all-reduce of gradients."""
from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .base import Engine, apply_activation_checkpointing, to_cpu_state


class DDPEngine(Engine):
    family = "ddp"

    def __init__(self, model, ddp, optimizer, autocast_dtype, device_type):
        super().__init__(model, ddp, optimizer)
        self.autocast_dtype, self.device_type = autocast_dtype, device_type

    def forward(self, *args, **kwargs):
        ctx = (torch.autocast(self.device_type, dtype=self.autocast_dtype) if self.autocast_dtype
               else contextlib.nullcontext())
        with ctx:
            return self.runner(*args, **kwargs)

    def full_state_dict(self):
        return to_cpu_state(self.model.state_dict().items())


def apply(strategy, model, optimizer_factory, mesh, spec, runtime) -> DDPEngine:
    dtype = torch.bfloat16 if spec.precision == "bf16" else None
    model.to(device=runtime.device, dtype=dtype)
    apply_activation_checkpointing(model, spec.activation_checkpointing)
    ddp = DDP(model, device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None,
              process_group=mesh["replicate"].get_group(), bucket_cap_mb=strategy.bucket_cap_mb,
              gradient_as_bucket_view=strategy.gradient_as_bucket_view, static_graph=strategy.static_graph)
    autocast = torch.bfloat16 if spec.precision == "bf16-mixed" else None
    return DDPEngine(model, ddp, optimizer_factory(ddp.parameters()), autocast, runtime.device.type)
