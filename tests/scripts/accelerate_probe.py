"""Launched by `accelerate launch --config_file EMITTED.yaml`: every rank writes what Accelerate
made of the config, read through Accelerate's own plugin classes from the environment its
launcher set (Accelerate runs FSDP and DeepSpeed only on accelerators, so this stops short of
Accelerator() on CPU)."""
import json
import os
import sys

import torch.distributed as dist
from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

out = {"world_size": int(os.environ["WORLD_SIZE"]), "mixed_precision": os.environ.get("ACCELERATE_MIXED_PRECISION")}
if os.environ.get("ACCELERATE_USE_FSDP") == "true":
    from accelerate.parallelism_config import ParallelismConfig
    fsdp, par = FullyShardedDataParallelPlugin(), ParallelismConfig()
    out.update(kind="fsdp", fsdp_version=fsdp.fsdp_version, layer=sorted(fsdp.transformer_cls_names_to_wrap or []),
               reshard=fsdp.reshard_after_forward, checkpointing=fsdp.activation_checkpointing,
               dp_replicate=par.dp_replicate_size, dp_shard=par.dp_shard_size, tp=par.tp_size)
elif os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
    ds = DeepSpeedPlugin()
    out.update(kind="deepspeed", stage=ds.zero_stage, offload=ds.offload_optimizer_device)
dist.init_process_group("gloo")
dist.barrier()
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
