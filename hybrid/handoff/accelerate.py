"""The chosen layout as an Accelerate config YAML (`accelerate launch --config_file`), for the layouts
Accelerate can express."""
from __future__ import annotations

from ..model.profile import ModelProfile, transformers_layer_class
from ..planning.candidate import Candidate, Plan


_MIXED = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}


ACCELERATE_IP_PLACEHOLDER = "FIRST_NODE_IP"
"""main_process_ip in a several-machine Accelerate file: to be replaced (or overridden by
--main_process_ip)."""


def accelerate_yaml(c: Candidate, p: Plan, profile: ModelProfile) -> str:
    """An Accelerate config file (accelerate/commands/config/config_args.py ClusterConfig keys):
    the machine keys here, the family's distributed_type and plugin section (FSDP2 with dp
    replicate/shard/tp sizes, DeepSpeed's plugin fields, MULTI_GPU). Accelerate rejects unknown
    keys, so provenance goes in comments."""
    import yaml

    spec, d = c.spec, c.parallel
    keys, notes = c.strategy.family_obj.handoff().accelerate(c, transformers_layer_class(profile))
    cfg = {"compute_environment": "LOCAL_MACHINE", "distributed_type": keys.pop("distributed_type"),
           "mixed_precision": _MIXED.get(spec.precision, "no"),
           "num_machines": p.cluster.nodes, "num_processes": p.cluster.world_size, "machine_rank": 0,
           "rdzv_backend": "static", "same_network": True, "main_training_function": "main", **keys}
    if spec.precision == "bf16":
        notes.append("the plan keeps bf16 parameters: load the model in torch.bfloat16")
    if spec.compile:
        notes.append("the plan compiles each block: call block.compile() on every decoder layer before "
                     "accelerator.prepare (Accelerate's dynamo_config compiles the whole model instead)")
    head = [f"# hybrid plan: {p.model.name} on {p.cluster.describe()}: {c.label} ({d.describe()})",
            f"# predicted {c.memory.total / 2**30:.1f} GiB per GPU, "
            f"{c.cost.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; "
            f"per-device batch {spec.micro_batch}, seq {spec.seq_len}"]
    if p.cluster.nodes > 1:
        # every machine must reach the first one's rendezvous (Accelerate's launch flags override
        # these keys); a placeholder address fails to resolve instead of waiting for peers
        cfg.update(machine_rank=0, main_process_ip=ACCELERATE_IP_PLACEHOLDER, main_process_port=29500)
        head += [f"# {p.cluster.nodes} machines: run on each, with its rank (0 on the first) "
                 "and the first one's address:",
                 "#   accelerate launch --config_file THIS.yaml --machine_rank $NODE_RANK "
                 "--main_process_ip $FIRST_NODE_IP --main_process_port 29500 train.py",
                 f"# (or edit machine_rank and main_process_ip below per machine: {ACCELERATE_IP_PLACEHOLDER} is a "
                 "placeholder)"]
    else:
        head.append("# accelerate launch --config_file THIS.yaml train.py")
    head += [f"# {n}" for n in notes]
    return "\n".join(head) + "\n" + yaml.safe_dump(cfg, sort_keys=False)
