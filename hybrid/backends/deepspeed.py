"""DeepSpeed ZeRO stage 1/2/3 through deepspeed.initialize, with the user's optimizer."""
from __future__ import annotations

import logging

import torch

from ..errors import HybridError
from ..profile import profile_module
from .base import Engine, apply_activation_checkpointing
from .ds_config import ds_config


class DeepSpeedEngine(Engine):
    family = "deepspeed"

    def backward(self, loss):
        self.runner.backward(loss)

    def step(self):
        self.runner.step()

    def zero_grad(self):
        # DeepSpeed clears gradients inside engine.step(); nothing is left to clear here.
        pass

    def full_state_dict(self):
        """fp32 master values (not the bf16 working copy), gathered on every rank."""
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        named = dict(self.model.named_parameters(remove_duplicate=False))
        for name, p in named.items():
            out[name] = safe_get_full_fp32_param(p).detach().to("cpu", copy=True)
        for name, b in self.model.named_buffers():
            out[name] = b.detach().to("cpu", copy=True)
        keys = self.model.state_dict().keys()
        return {k: out[k] for k in keys if k in out}


def apply(strategy, model, optimizer_factory, mesh, spec, runtime) -> DeepSpeedEngine:
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    cuda = runtime.device.type == "cuda"
    if strategy.offload and not cuda:
        raise HybridError(f"{strategy.name} offloads from GPU to host memory, which needs CUDA; this "
                          "machine has none. Use zero1, zero2 or zero3")
    profile = profile_module(model)
    hidden = profile.decoder.hidden if profile.decoder else None
    config = ds_config(strategy, spec, hidden, runtime.world_size, runtime.local_world_size, cuda)
    apply_activation_checkpointing(model, spec.activation_checkpointing)
    optimizer = optimizer_factory(model.parameters())
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                   dist_init_required=False)
    return DeepSpeedEngine(engine.module, engine, optimizer)
