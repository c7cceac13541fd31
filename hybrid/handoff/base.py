"""A family's hand-off: what `--emit` writes for its layouts (a config file, an Accelerate plugin
section, torchtitan's flags), one object per family (each family names its module: Family.handoff)."""
from __future__ import annotations

from ..errors import HybridError


class Handoff:
    """The defaults; a family's module subclasses it and overrides what it writes."""

    def torchtitan_reshard(self, s) -> str:
        """torchtitan's --parallelism.fsdp_reshard_after_forward for this preset."""
        return "default"

    def torchtitan_offload(self, s) -> bool:
        """Whether torchtitan's --training.enable_cpu_offload is on for this preset."""
        return False

    def torchtitan_check(self, c) -> None:
        """HybridError when torchtitan cannot run this family's layout: context parallelism needs
        FSDP2's dp_shard_cp mesh."""
        if c.parallel.cp > 1:
            raise HybridError(f"{c.label}: torchtitan's context parallelism shards parameters with FSDP2 over "
                              "dp_shard x cp (its dp_shard_cp mesh); emit an fsdp or hsdp layout with cp")

    def emit(self, candidate, plan, profile, target: str = "engine") -> str:
        raise HybridError(f"{self.name} strategies have no config to emit")

    def emit_notes(self, candidate, target: str = "engine") -> list[str]:
        """What to set beside the emitted config (stderr lines), for `target`."""
        return []

    def accelerate(self, candidate, layer_class: str | None) -> tuple[dict, list[str]]:
        """This family's keys of an Accelerate config file (distributed_type and its plugin
        section) and notes for the file's header; layer_class is the block class to wrap."""
        raise HybridError(f"{self.name} strategies have no Accelerate equivalent")


def user_checkpointing(c) -> list[str]:
    """The Accelerate header note where the user applies checkpointing (Accelerate does so only
    under FSDP)."""
    if c.spec.activation_checkpointing == "none":
        return []
    return ["activation checkpointing: call model.gradient_checkpointing_enable() (transformers) or wrap "
            "the blocks yourself; Accelerate applies it only under FSDP"]


def provenance(p, c) -> dict:
    """Where an emitted config came from (the plan and candidate), for the file's `_hybrid` key."""
    return {"model": p.model.name, "cluster": p.cluster.describe(), "strategy": c.name,
            "shard_size": c.shard_size, "parallel": c.parallel.to_dict(), "per_gpu_bytes": c.memory.total,
            "fits": c.known_to_fit, "step_time_s": round(c.cost.seconds, 4), "memory_method": p.method}


def alloc_conf_var(cluster) -> str:
    """The variable the GPU's caching allocator reads its settings from: PYTORCH_HIP_ALLOC_CONF on
    ROCm builds of torch, PYTORCH_CUDA_ALLOC_CONF on CUDA."""
    return "PYTORCH_HIP_ALLOC_CONF" if cluster.gpu.stack == "rocm" else "PYTORCH_CUDA_ALLOC_CONF"


def stack_notes(cluster) -> list[str]:
    """What a hand-off says beside its config where the GPUs are not CUDA (ROCm: RCCL and HIP)."""
    if cluster.gpu.stack != "rocm":
        return []
    return [f"hybrid: {cluster.gpu.name} runs ROCm: install torch's ROCm build (and DeepSpeed's, built with "
            "ROCm); torch's \"nccl\" process-group backend is RCCL there, and the allocator reads "
            "PYTORCH_HIP_ALLOC_CONF"]
