"""Hand-off to other tools: the chosen layout as a DeepSpeed JSON config (for deepspeed.initialize,
or the HF Trainer's "auto" form) or FSDP2 settings as YAML, written by the family
(hybrid/families/); a torchtitan TOML fragment for any FSDP/DDP layout; an Accelerate config
YAML (`accelerate launch --config_file`) for any layout Accelerate can express."""
from __future__ import annotations

from .errors import HybridError
from .families import FAMILIES
from .planner import Candidate, Plan
from .profile import ModelProfile

KINDS = {f.emits: f for f in FAMILIES.values() if f.emits}
"""--emit choices a family writes -> that family."""
CHOICES = (*KINDS, "torchtitan", "accelerate")


def _pick(p: Plan, family, name: str | None) -> Candidate:
    """The named strategy's best fitting candidate, else the chosen one if it is of this family,
    else the fastest fitting candidate of this family."""
    pool = [c for c in p.candidates if c.strategy.family_obj is family and c.memory is not None]
    if name:
        pool = [c for c in pool if c.name == name]
        if not pool:
            from .catalogue import load_catalogue
            valid = sorted(n for n, s in load_catalogue().items() if s.family_obj is family)
            raise HybridError(f"strategy {name!r} is not a {family.name} strategy; --emit {family.emits} "
                              f"needs one of: {', '.join(valid)}")
    elif p.chosen is not None and p.chosen.strategy.family_obj is family:
        return p.chosen
    fitting = [c for c in pool if c.fits]
    if not fitting:
        raise HybridError(f"no {family.name} candidate fits this job; see `hybrid plan` for why")
    return min(fitting, key=lambda c: c.cost.time_per_token)


def emit(kind: str, p: Plan, profile: ModelProfile, name: str | None = None,
         target: str = "engine") -> tuple[str, Candidate]:
    """The config text and the candidate it describes (which may differ from the plan's choice
    when the choice is of another family: the caller says so)."""
    if kind == "torchtitan":
        c = _pick_torchtitan(p, name)
        return torchtitan_toml(c, p), c
    if kind == "accelerate":
        c = _named(p, name) or p.chosen
        if c is None:
            raise HybridError("nothing fits this job, so there is no layout to emit; see `hybrid plan` for why")
        return accelerate_yaml(c, p, profile), c
    if kind not in KINDS:
        raise HybridError(f"unknown --emit {kind!r}. Available: {', '.join(CHOICES)}")
    family = KINDS[kind]
    c = _pick(p, family, name)
    return family.emit(c, p, profile, target), c


def _named(p: Plan, name: str | None) -> Candidate | None:
    """The fastest fitting candidate of the named strategy (None without a name)."""
    if not name:
        return None
    fitting = [c for c in p.candidates if c.name == name and c.memory is not None and c.fits]
    if not fitting:
        raise HybridError(f"strategy {name!r} has no layout that fits this job; see `hybrid plan --strategy {name}`")
    return min(fitting, key=lambda c: c.cost.time_per_token)


def _pick_torchtitan(p: Plan, name: str | None) -> Candidate:
    """torchtitan runs FSDP2/HSDP (and DDP) with TP; not DeepSpeed."""
    pool = [c for c in p.candidates if c.memory is not None and c.strategy.family_obj.supports_tp
            and (name is None or c.name == name)]
    if name and not pool:
        raise HybridError(f"strategy {name!r} has no torchtitan equivalent; --emit torchtitan needs an fsdp or ddp "
                          "strategy")
    if p.chosen is not None and p.chosen in pool:
        return p.chosen
    fitting = [c for c in pool if c.fits]
    if not fitting:
        raise HybridError("no fsdp or ddp candidate fits this job; see `hybrid plan` for why")
    return min(fitting, key=lambda c: c.cost.time_per_token)


def torchtitan_toml(c: Candidate, p: Plan) -> str:
    """The [parallelism], [activation_checkpoint] and [training] keys of a torchtitan job file
    (torchtitan/config/job_config.py names)."""
    d, s = c.parallel, c.strategy
    ac = c.spec.activation_checkpointing
    lines = [f"# hybrid plan: {p.model.name} on {p.cluster.describe()}: {c.label} ({d.describe()})",
             f"# predicted {c.memory.total / 2**30:.1f} GiB per GPU, {c.cost.tokens_per_s_per_gpu:,.0f} tokens/s per GPU",
             "", "[parallelism]",
             f"data_parallel_replicate_degree = {d.dp_replicate}",
             f"data_parallel_shard_degree = {d.dp_shard}",
             f"fsdp_reshard_after_forward = \"{'default' if s.reshard_after_forward else 'never'}\"",
             f"tensor_parallel_degree = {d.tp}",
             f"pipeline_parallel_degree = {d.pp}"]
    if c.pipeline is not None:
        # torchtitan's schedule names (torch.distributed.pipelining class names without "Schedule");
        # its micro-batch is a slice of local_batch_size
        name = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}[c.pipeline.schedule]
        lines += [f"pipeline_parallel_schedule = \"{name}\"",
                  f"pipeline_parallel_microbatch_size = {c.spec.micro_batch}"]
    if ac in ("none", "full"):
        lines += ["", "[activation_checkpoint]", f"mode = \"{ac}\""]
    else:                                   # torchtitan's selective: per-op ("op") or every N-th layer
        option = "op" if ac in ("op", "selective") else ac.split(":", 1)[1]
        lines += ["", "[activation_checkpoint]", "mode = \"selective\"", f"selective_ac_option = \"{option}\""]
        if ac == "selective":
            lines += ["# hybrid's selective keeps every matmul and attention output; torchtitan's op policy",
                      "# (hybrid's `op`) keeps every second matmul output, so it holds less than this estimate"]
    mixed = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}.get(c.spec.precision)
    local = c.spec.micro_batch * (c.pipeline.micro_batches if c.pipeline is not None else 1)
    lines += ["", "[training]", f"local_batch_size = {local}",
              f"global_batch_size = {c.spec.micro_batch * c.spec.gradient_accumulation * d.dp_size}",
              f"seq_len = {c.spec.seq_len}"]
    if mixed:
        lines += [f"mixed_precision_param = \"{mixed}\"", "mixed_precision_reduce = \"float32\""]
    if c.spec.compile:                      # torchtitan compiles each block and the loss, as hybrid does
        lines += ["", "[compile]", "enable = true", "components = [\"model\", \"loss\"]"]
    if c.spec.float8:                       # torchtitan's float8 converter with hybrid's settings (hybrid/float8.py)
        fsdp = d.dp_shard > 1                # torchtitan shards with FSDP2 whenever dp_shard > 1
        lines += ["", "[model]", "converters = [\"float8\"]", "", "[float8]", "recipe_name = \"tensorwise\"",
                  f"enable_fsdp_float8_all_gather = {'true' if fsdp else 'false'}",
                  f"precompute_float8_dynamic_scale_for_fsdp = {'true' if fsdp else 'false'}",
                  "filter_fqns = [\"output\"]"]
    return "\n".join(lines) + "\n"


_MIXED = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}
_HF_LAYERS = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer",
              "gpt2": "GPT2Block"}
"""transformers' decoder-layer class per model_type, for presets (a config.json or a module
profile already names the class it found)."""


def _layer_class(profile: ModelProfile) -> str | None:
    """The class Accelerate wraps: the transformers class a preset stands for (a preset is built
    from our own Block, but users train the transformers model), else the class we found."""
    mt = profile.decoder.hf_model_type if profile.decoder is not None else None
    if profile.block_class == "Block" and mt in _HF_LAYERS:
        return _HF_LAYERS[mt]
    return profile.block_class


def accelerate_yaml(c: Candidate, p: Plan, profile: ModelProfile) -> str:
    """An Accelerate config file (accelerate/commands/config/config_args.py ClusterConfig keys):
    the machine keys here, the family's distributed_type and plugin section (FSDP2 with dp
    replicate/shard/tp sizes, DeepSpeed's plugin fields, MULTI_GPU). Accelerate rejects unknown
    keys, so provenance goes in comments."""
    import yaml

    spec, d = c.spec, c.parallel
    if c.pipeline is not None:
        raise HybridError(f"{c.label}: Accelerate has no pipeline stages for FSDP or DeepSpeed plans; emit a pp 1 "
                          "layout (--pp 1) or use --emit torchtitan")
    keys, notes = c.strategy.family_obj.accelerate(c, _layer_class(profile))
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
            f"# predicted {c.memory.total / 2**30:.1f} GiB per GPU, {c.cost.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; "
            f"per-device batch {spec.micro_batch}, seq {spec.seq_len}",
            "# accelerate launch --config_file THIS.yaml train.py  (more than one machine: add "
            "--machine_rank and --main_process_ip on each)"]
    head += [f"# {n}" for n in notes]
    return "\n".join(head) + "\n" + yaml.safe_dump(cfg, sort_keys=False)
