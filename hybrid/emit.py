"""Hand-off to other tools: the chosen strategy as a DeepSpeed JSON config or FSDP2 settings YAML."""
from __future__ import annotations

import json

import yaml

from .backends.ds_config import ds_config
from .errors import HybridError
from .planner import Candidate, Plan
from .profile import ModelProfile


def _pick(p: Plan, family: str, name: str | None) -> Candidate:
    """The named strategy's best fitting candidate, else the chosen one if it is of this family,
    else the fastest fitting candidate of this family."""
    pool = [c for c in p.candidates if c.strategy.family == family and c.memory is not None]
    if name:
        pool = [c for c in pool if c.name == name]
        if not pool:
            from .catalogue import load_catalogue
            valid = sorted(n for n, s in load_catalogue().items() if s.family == family)
            raise HybridError(f"strategy {name!r} is not a {family} strategy; --emit {_EMIT[family]} "
                              f"needs one of: {', '.join(valid)}")
    elif p.chosen is not None and p.chosen.strategy.family == family:
        return p.chosen
    fitting = [c for c in pool if c.fits]
    if not fitting:
        raise HybridError(f"no {family} candidate fits this job; see `hybrid plan` for why")
    return min(fitting, key=lambda c: c.cost.seconds)


_EMIT = {"deepspeed": "deepspeed", "fsdp": "fsdp"}


def emit(kind: str, p: Plan, profile: ModelProfile, name: str | None = None) -> str:
    if kind == "deepspeed":
        c = _pick(p, "deepspeed", name)
        cfg = ds_config(c.strategy, c.spec, profile.decoder.hidden if profile.decoder else None,
                        p.cluster.world_size, p.cluster.gpus_per_node, cuda=p.cluster.gpu.is_cuda)
        if c.spec.activation_checkpointing != "none":
            cfg["activation_checkpointing"] = {"partition_activations": False,
                                               "contiguous_memory_optimization": False}
        cfg["_hybrid"] = _provenance(p, c)
        return json.dumps(cfg, indent=2)
    c = _pick(p, "fsdp", name)
    s = c.strategy
    replicate = p.cluster.world_size // c.shard_size
    settings = {
        "strategy": s.name,
        "mesh": {"shape": [replicate, c.shard_size], "dim_names": ["replicate", "shard"],
                 "hybrid_sharding": replicate > 1},
        "fully_shard": {
            "units": [profile.block_class, "root"] if profile.block_class else ["root"],
            "reshard_after_forward": s.reshard_after_forward,
            "mp_policy": ({"param_dtype": {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}[c.spec.precision],
                           "reduce_dtype": "float32"} if c.spec.mixed else {"param_dtype": None, "reduce_dtype": None}),
            "offload_policy": "CPUOffloadPolicy(pin_memory=True)" if s.offload_params else None,
        },
        "activation_checkpointing": c.spec.activation_checkpointing,
        "train": c.spec.to_dict(),
        "_hybrid": _provenance(p, c),
    }
    return yaml.safe_dump(settings, sort_keys=False)


def _provenance(p: Plan, c: Candidate) -> dict:
    return {"model": p.model.name, "cluster": p.cluster.describe(), "strategy": c.name,
            "shard_size": c.shard_size, "per_gpu_bytes": c.memory.total, "fits": c.fits,
            "step_time_s": round(c.cost.seconds, 4), "memory_method": p.method}
