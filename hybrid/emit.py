"""Hand-off to other tools: the chosen layout as a DeepSpeed JSON config (for deepspeed.initialize,
or the HF Trainer's "auto" form) or FSDP2 settings as YAML, written by the family
(hybrid/families/); the torchrun command line of torchtitan 0.3 for any FSDP/DDP layout; an Accelerate config
YAML (`accelerate launch --config_file`) for any layout Accelerate can express."""
from __future__ import annotations

from .errors import HybridError
from .families import FAMILIES
from .planner import Candidate, Plan
from .profile import ModelProfile, transformers_layer_class

KINDS = {f.emits: f for f in FAMILIES.values() if f.emits}
"""--emit choices a family writes -> that family."""
CHOICES = (*KINDS, "torchtitan", "accelerate")


def emit_notes(kind: str, c: Candidate, target: str = "engine") -> list[str]:
    """Lines for stderr beside an emitted config: what its family says the user sets elsewhere."""
    return KINDS[kind].emit_notes(c, target) if kind in KINDS else []


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
        return torchtitan_command(c, p), c
    if kind == "accelerate":
        c = _named(p, name) or p.chosen
        if c is None:
            raise HybridError("nothing fits this job, so there is no layout to emit; see `hybrid plan` for why")
        _expressible(c, kind)
        return accelerate_yaml(c, p, profile), c
    if kind not in KINDS:
        raise HybridError(f"unknown --emit {kind!r}. Available: {', '.join(CHOICES)}")
    family = KINDS[kind]
    c = _pick(p, family, name)
    _expressible(c, kind)
    return family.emit(c, p, profile, target), c


HANDOFF_DIMS = {"accelerate": ("tp", "cp")}
"""The model-parallel dimensions each hand-off can express (the families' own emitters: tp, pp and
cp, their Family.emit says where not). Expert parallelism is torchtitan's alone among the tools we
hand off to: DeepSpeed's JSON, the HF Trainer, Accelerate's FSDP plugin and plain FSDP2 settings
have no key that splits a transformers MoE block's experts over ranks; Accelerate has no pipeline
stages for FSDP or DeepSpeed plans."""


def _expressible(c: Candidate, kind: str) -> None:
    c.layout.check_handoff(f"--emit {kind}", HANDOFF_DIMS.get(kind, ("tp", "pp", "cp")))


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
    pool = [c for c in p.candidates if c.memory is not None and c.strategy.family_obj.torchtitan
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


TORCHTITAN_CONFIGS = {"llama3-8b": "llama3_8b", "llama3-70b": "llama3_70b"}
"""Presets torchtitan 0.3 has a config_registry function for that trains what the plan estimates
(torchtitan/models/llama3/config_registry.py; its llama3_405b converts the linears to float8 and
compiles, which the plan does not model)."""
TORCHTITAN_AC = {"none": "none", "full": "full", "op": "selective", "selective": "selective"}
"""Our checkpointing modes -> torchtitan 0.3's activation-checkpoint subcommands (its SelectiveAC is
the per-op policy, our `op`; torchtitan/distributed/activation_checkpoint.py)."""

def torchtitan_args(c: Candidate, p: Plan) -> list[str]:
    """The arguments torchtitan 0.3's ConfigManager reads after `-m torchtitan.train` (see
    _torchtitan_groups)."""
    return [a for group in _torchtitan_groups(c, p) for a in group]


def _torchtitan_groups(c: Candidate, p: Plan) -> list[list[str]]:
    """The arguments torchtitan 0.3's ConfigManager reads after `-m torchtitan.train`:
    `--module/--config` (a config_registry function), `--section.key value` overrides
    (torchtitan/config/configs.py ParallelismConfig and TrainingConfig), and the activation
    checkpointing as its subcommand, last (a tyro subcommand takes the options after it)."""
    d, s, spec = c.parallel, c.strategy, c.spec
    if spec.float8:
        raise HybridError("torchtitan 0.3 sets float8 in its config_registry function (Float8LinearConverter, "
                          "rowwise recipes), not on the command line, and hybrid plans tensorwise float8: emit "
                          "without --float8 and add the converter to your config function")
    if spec.precision == "fp16-mixed":
        raise HybridError("torchtitan trains in bfloat16 or float32 only (training.mixed_precision_param); plan "
                          "with --precision bf16-mixed, or emit fp16 with --emit deepspeed or --emit accelerate")
    ac = spec.activation_checkpointing
    if ac not in TORCHTITAN_AC:
        raise HybridError(f"torchtitan 0.3 checkpoints every block or none (activation-checkpoint:selective|full|"
                          f"memory-budget|none), not {ac}; plan with --activation-checkpointing full or op")
    config = TORCHTITAN_CONFIGS.get(p.model.name)
    args = [["--module", "llama3" if config else "${TT_MODULE:?your torchtitan model module}"],
            ["--config", config or "${TT_CONFIG:?your config_registry function}"],
            ["--parallelism.data_parallel_replicate_degree", str(d.dp_replicate)],
            ["--parallelism.data_parallel_shard_degree", str(d.dp_shard)],
            ["--parallelism.fsdp_reshard_after_forward", s.family_obj.torchtitan_reshard(s)]]
    s.family_obj.torchtitan_check(c)
    args += c.layout.torchtitan_parallelism(spec)
    args += [["--training.local_batch_size", str(c.layout.local_batch(spec))],
             ["--training.global_batch_size", str(spec.micro_batch * spec.gradient_accumulation * d.dp_size)],
             ["--training.seq_len", str(spec.seq_len)]]
    if spec.precision == "bf16":
        args += [["--training.dtype", "bfloat16"]]
    else:
        args += [["--training.dtype", "float32"],
                 ["--training.mixed_precision_param", "bfloat16" if spec.precision == "bf16-mixed" else "float32"],
                 ["--training.mixed_precision_reduce", "float32"]]
    if s.family_obj.torchtitan_offload(s):
        args += [["--training.enable_cpu_offload"]]           # tyro bool flags take no value
    # compiled as the plan estimates it (each block and the loss, as hybrid compiles), or eager; no
    # CUDA-graph capture (whose private memory pool the plan does not model; torchtitan also refuses
    # graphs with pipeline parallelism)
    compiled = [["--compile.enable"], ["--compile.components", "model", "loss"]] if spec.compile else \
        [["--compile.no_enable"]]
    return args + compiled + [["--training.disable_cuda_graphs"], [f"activation-checkpoint:{TORCHTITAN_AC[ac]}"]]


def torchtitan_command(c: Candidate, p: Plan) -> str:
    """A shell script: the torchrun line that runs torchtitan 0.3 (`-m torchtitan.train`) with the
    plan's layout, to run on every node."""
    import shlex

    cl = p.cluster
    groups = _torchtitan_groups(c, p)
    d = c.parallel
    head = ["#!/usr/bin/env bash",
            f"# hybrid plan: {p.model.name} on {cl.describe()}: {c.label} ({d.describe()})",
            f"# predicted {c.memory.total / 2**30:.1f} GiB per GPU ({c.verdict}), "
            f"{c.cost.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; for torchtitan 0.3 (pip install torchtitan==0.3.0)"]
    if p.model.name not in TORCHTITAN_CONFIGS:
        head.append(f"# torchtitan 0.3 has no config_registry function for {p.model.name}: set TT_MODULE and "
                    "TT_CONFIG to the module and function that build it")
    if c.spec.activation_checkpointing == "selective":
        head.append("# torchtitan's selective is the per-op policy (hybrid's `op`): it keeps every second matmul "
                    "output, less than this plan's selective")
    launch = ["torchrun", "--nnodes", str(cl.nodes), "--nproc-per-node", str(cl.gpus_per_node)]
    if cl.nodes > 1:
        head.append("# run on every node with MASTER_ADDR set to the first node's address")
        launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "${MASTER_ADDR:?the first node's address}:29500"]
    else:
        launch += ["--standalone"]
    env = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True " if cl.expandable_segments else ""

    def quote(a: str) -> str:
        return f'"{a}"' if a.startswith("${") or ":?" in a else shlex.quote(a)
    body = [" ".join(quote(a) for a in launch) + " -m torchtitan.train"]
    body += [" ".join(quote(a) for a in group) for group in groups]
    return "\n".join(head) + "\n" + env + " \\\n  ".join(body) + "\n"


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
    keys, notes = c.strategy.family_obj.accelerate(c, transformers_layer_class(profile))
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
