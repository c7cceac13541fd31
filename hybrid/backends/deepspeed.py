"""DeepSpeed ZeRO stage 1/2/3 through deepspeed.initialize, with the user's optimizer."""
from __future__ import annotations

import logging

import torch

from ..errors import HybridError
from ..profile import profile_module
from .base import Engine, apply_activation_checkpointing, optimizer_tensors
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

    def tensor_roles(self):
        """DeepSpeed's own flat buffers: 16-bit params (or their partitions and hpZ copies),
        gradient partitions, fp32 masters and states; attribute names differ by stage."""
        zo = self.runner.optimizer
        params = []
        for p in self.model.parameters():
            # under stage 3 the module parameter itself is the gathered (temporary) copy
            own = (getattr(p, "ds_tensor", None), getattr(p, "ds_secondary_tensor", None))
            params += [t for t in (own if hasattr(p, "ds_tensor") else (p,)) if isinstance(t, torch.Tensor)]
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        for attr in ("averaged_gradients", "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"):
            value = getattr(zo, attr, None) or {}
            for v in value.values():
                grads += v if isinstance(v, list) else [v]
        flat = getattr(zo, "grad_partitions_flat_buffer", None)
        if isinstance(flat, torch.Tensor):
            grads.append(flat)
        inner = getattr(zo, "optimizer", zo)
        masters = [t for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
                   for t in getattr(zo, attr, None) or []]
        grads += [m.grad for m in masters if m.grad is not None]
        return {"params": params, "grads": [g for g in grads if isinstance(g, torch.Tensor)],
                "optimizer": masters + optimizer_tensors(inner, params)}


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


def traced_apply(strategy, model, optimizer_factory, mesh, spec, runtime):
    """DeepSpeed cannot run on fake tensors. Its compute is FSDP2's with bf16 params (the module
    is cast to bf16, like MixedPrecisionPolicy), so the trace runs the FSDP2 equivalent (full
    shard; blocks re-gathered in backward only for stage 3) and memory/traced.py replaces the
    model states and buffers with DeepSpeed's layout (its partitions and bucket sizes)."""
    from dataclasses import replace

    from . import fsdp
    proxy = replace(strategy, name=f"{strategy.name}-as-fsdp", family="fsdp", stage=0, hpz=None,
                    reshard_after_forward=strategy.stage == 3, offload_params=False, offload_optimizer=False)
    return fsdp.apply(proxy, model, optimizer_factory, mesh, spec, runtime)
