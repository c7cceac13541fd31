"""FSDP2's hand-off: its settings as YAML, Accelerate's FSDP plugin, torchtitan's reshard and offload flags."""
from __future__ import annotations

import yaml

from ..model.profile import transformers_layer_class

from .base import Handoff, provenance


class FSDPHandoff(Handoff):
    def emit(self, c, plan, profile, target="engine"):
        """The FSDP2 settings as YAML: mesh, units, mixed precision, reshard, offload."""
        s = c.strategy
        dims = c.parallel
        layer = transformers_layer_class(profile)
        settings = {
            "strategy": s.name,
            # with context parallelism FSDP shards over dp_shard x cp flattened (hybrid.runtime.mesh.fsdp_mesh)
            "mesh": {"shape": [dims.dp_replicate, dims.dp_shard * dims.cp],
                     "dim_names": ["dp_replicate", "dp_shard" if dims.cp == 1 else "dp_shard_cp"],
                     "hybrid_sharding": dims.dp_replicate > 1, "parallel": dims.to_dict()},
            "fully_shard": {
                "units": [layer, "root"] if layer else ["root"],
                "reshard_after_forward": s.config.reshard_after_forward,
                "mp_policy": ({"param_dtype": {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}[c.spec.precision],
                               "reduce_dtype": "float32"} if c.spec.mixed
                              else {"param_dtype": None, "reduce_dtype": None}),
                "offload_policy": "CPUOffloadPolicy(pin_memory=True)" if s.config.offload_params else None,
            },
            "activation_checkpointing": c.spec.activation_checkpointing,
            "train": c.spec.to_dict(),
            "_hybrid": provenance(plan, c),
        }
        return yaml.safe_dump(settings, sort_keys=False)

    def torchtitan_reshard(self, s):
        return "default" if s.config.reshard_after_forward else "never"

    def torchtitan_offload(self, s):
        return s.config.offload_params

    def torchtitan_check(self, c):
        return None

    def accelerate(self, c, layer_class):
        s, d, ac = c.strategy, c.parallel, c.spec.activation_checkpointing
        wrap = ({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": layer_class}
                if layer_class else {"fsdp_auto_wrap_policy": "NO_WRAP"})
        keys = {"distributed_type": "FSDP",
                "fsdp_config": {"fsdp_version": 2, **wrap,
                                "fsdp_reshard_after_forward": bool(s.config.reshard_after_forward),
                                "fsdp_offload_params": bool(s.config.offload_params),
                                "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                                "fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": True,
                                "fsdp_activation_checkpointing": ac != "none"},
                "parallelism_config": {"parallelism_config_dp_replicate_size": d.dp_replicate,
                                       "parallelism_config_dp_shard_size": d.dp_shard,
                                       "parallelism_config_tp_size": d.tp, "parallelism_config_cp_size": d.cp}}
        notes = []
        if d.cp > 1:    # Accelerate's torch CP: all-gather of K/V, as hybrid runs and estimates it
            keys["parallelism_config"]["parallelism_config_cp_comm_strategy"] = "allgather"
            notes.append("context parallelism: run forward and backward inside accelerator.maybe_context_parallel("
                         "buffers=[input_ids, labels, position_ids], buffer_seq_dims=[1, 1, 1]); SDPA attention only")
        if ac == "selective":
            notes.append("Accelerate's fsdp_activation_checkpointing recomputes whole blocks (the plan's "
                         "'selective' keeps matmul outputs): less memory, more compute than estimated")
        return keys, notes


HANDOFF = FSDPHandoff()
