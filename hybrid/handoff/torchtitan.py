"""The chosen layout as the torchrun command line of torchtitan 0.3 (`-m torchtitan.train` with its
ConfigManager's options), for the FSDP2/HSDP and DDP layouts torchtitan runs."""
from __future__ import annotations

from ..config.spec import TrainSpec
from ..errors import HybridError
from ..layout.layout import Layout
from ..planning.candidate import Candidate, Plan

TORCHTITAN_DEGREES = {"tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree",
                      "cp": "context_parallel_degree", "ep": "expert_parallel_degree"}
"""torchtitan 0.3's ParallelismConfig key of each dimension (torchtitan/config/configs.py)."""
TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}
"""torch.distributed.pipelining schedule class names without "Schedule", as torchtitan takes them."""


def torchtitan_parallelism(layout: Layout, spec: TrainSpec) -> list[list[str]]:
    """torchtitan's --parallelism options for the model-parallel dimensions: tp and pp always,
    cp (with the K/V all-gather hybrid runs and estimates) and ep where used, and a staged
    layout's schedule and micro-batch size."""
    used = layout.used()
    out = [[f"--parallelism.{TORCHTITAN_DEGREES[dim]}", str(getattr(layout.dims, dim))] for dim in ("tp", "pp")]
    if "cp" in used:          # torchtitan's all-gather of K/V shards per layer: what hybrid runs and estimates
        out += [["--parallelism.context_parallel_degree", str(used["cp"])],
                ["--parallelism.context_parallel_rotate_method", "allgather"]]
    if "ep" in used:          # borrows dp_shard x cp ranks, the experts FSDP-sharded over the rest
        out += [["--parallelism.expert_parallel_degree", str(used["ep"])]]
    if layout.pipeline is not None:
        out += [["--parallelism.pipeline_parallel_schedule", TORCHTITAN_SCHEDULES[layout.pipeline.schedule]],
                ["--parallelism.pipeline_parallel_microbatch_size", str(spec.micro_batch)]]
    return out


def _pick_torchtitan(p: Plan, name: str | None) -> Candidate:
    """torchtitan runs FSDP2/HSDP (and DDP) with TP; not DeepSpeed."""
    pool = [c for c in p.candidates if c.memory is not None and c.strategy.family_obj.torchtitan
            and (name is None or c.name == name)]
    if name and not pool:
        raise HybridError(f"strategy {name!r} has no torchtitan equivalent; --emit torchtitan needs an fsdp or ddp "
                          "strategy")
    if p.chosen is not None and p.chosen in pool:
        return p.chosen
    fitting = [c for c in pool if c.known_to_fit]
    if not fitting:
        raise HybridError("no fsdp or ddp candidate fits this job; see `hybrid plan` for why")
    return min(fitting, key=lambda c: c.cost.time_per_token)


TORCHTITAN_CONFIGS = {"llama3-8b": ("llama3", "llama3_8b"), "llama3.1-8b": ("llama3", "llama3_8b"),
                      "llama3-70b": ("llama3", "llama3_70b"), "llama3.1-70b": ("llama3", "llama3_70b"),
                      "llama3.1-405b": ("llama3", "llama3_405b"), "deepseek-v3": ("deepseek_v3", "deepseek_v3_671b"),
                      "gpt-oss-20b": ("gpt_oss", "gpt_oss_20b"), "gpt-oss-120b": ("gpt_oss", "gpt_oss_120b"),
                      "qwen3-30b-a3b": ("qwen3", "qwen3_30b_a3b")}
"""Presets torchtitan 0.3 has a model and config_registry function for (torchtitan/models/<module>/
config_registry.py), as (--module, --config); the options after them override its parallelism,
batch, precision, compile and checkpointing with the plan's."""
TORCHTITAN_DIFFERS = {
    "llama3_405b": "its registry function converts the linears to float8 (Float8LinearConverter) and enables "
                   "async tensor parallelism, which this bf16 plan does not price: expect less memory and a "
                   "faster step than predicted",
    "deepseek_v3_671b": "its registry function sets flex attention (attn_backend='flex'), priced here as SDPA's"}
"""What a registry function fixes in code that the command line cannot override, said in the script."""


TORCHTITAN_AC = {"none": "none", "full": "full", "op": "selective", "selective": "selective"}
"""Our checkpointing modes -> torchtitan 0.3's activation-checkpoint subcommands (its SelectiveAC is
the per-op policy, our `op`; torchtitan/distributed/activation_checkpoint.py)."""


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
    module, config = TORCHTITAN_CONFIGS.get(p.model.name, (None, None))
    args = [["--module", module or "${TT_MODULE:?your torchtitan model module}"],
            ["--config", config or "${TT_CONFIG:?your config_registry function}"],
            ["--parallelism.data_parallel_replicate_degree", str(d.dp_replicate)],
            ["--parallelism.data_parallel_shard_degree", str(d.dp_shard)],
            ["--parallelism.fsdp_reshard_after_forward", s.family_obj.handoff().torchtitan_reshard(s)]]
    s.family_obj.handoff().torchtitan_check(c)
    args += torchtitan_parallelism(c.layout, spec)
    args += [["--training.local_batch_size", str(c.layout.local_batch(spec))],
             ["--training.global_batch_size", str(spec.micro_batch * spec.gradient_accumulation * d.dp_size)],
             ["--training.seq_len", str(spec.seq_len)]]
    if spec.precision == "bf16":
        args += [["--training.dtype", "bfloat16"]]
    else:
        args += [["--training.dtype", "float32"],
                 ["--training.mixed_precision_param", "bfloat16" if spec.precision == "bf16-mixed" else "float32"],
                 ["--training.mixed_precision_reduce", "float32"]]
    if s.family_obj.handoff().torchtitan_offload(s):
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
    else:
        config = TORCHTITAN_CONFIGS[p.model.name][1]
        if config in TORCHTITAN_DIFFERS:
            head.append(f"# torchtitan's {config}: {TORCHTITAN_DIFFERS[config]}")
    if c.spec.activation_checkpointing == "selective":
        head.append("# torchtitan's selective is the per-op policy (hybrid's `op`): it keeps every second matmul "
                    "output, less than this plan's selective")
    launch = ["torchrun", "--nnodes", str(cl.nodes), "--nproc-per-node", str(cl.gpus_per_node)]
    if cl.nodes > 1:
        head.append("# run on every node with MASTER_ADDR set to the first node's address")
        launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "${MASTER_ADDR:?the first node's address}:29500"]
    else:
        launch += ["--standalone"]
    from .base import alloc_conf_var
    if cl.gpu.stack == "rocm":
        head.append(f"# {cl.gpu.name} runs ROCm: torch's ROCm build, whose nccl backend is RCCL")
    env = f"{alloc_conf_var(cl)}=expandable_segments:True " if cl.expandable_segments else ""

    def quote(a: str) -> str:
        return f'"{a}"' if a.startswith("${") or ":?" in a else shlex.quote(a)
    body = [" ".join(quote(a) for a in launch) + " -m torchtitan.train"]
    body += [" ".join(quote(a) for a in group) for group in groups]
    return "\n".join(head) + "\n" + env + " \\\n  ".join(body) + "\n"
