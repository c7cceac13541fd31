"""The JobConfig: every option of a job, once. Each row gives the name, type, default, --help
text, argparse group, checks and where the option applies; the CLI's flags (cli._common), the job
file's keys (hybrid/config/jobfile.py) and the job options among auto_wrap's arguments are read from it,
and tests/config/test_jobconfig.py holds auto_wrap's, Cluster's and TrainSpec's explicit defaults to it.

A table of rows rather than one dataclass whose fields are the options: a row carries what a
dataclass field cannot without an untyped metadata dict (help, group, range, where it applies),
and several defaults depend on other options (`--gpus-per-node` on CPU ranks, `--micro-batch`
under a global batch, checkpointing that `plan` searches), so "not given" (None) and the
documented default are two values, which a field's single default cannot say. Pure: no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, get_args

from .cluster import (A100_EFFICIENCY, ALLOCATOR_HEADROOM, DEFAULT_EFFICIENCY, EXPANDABLE_HEADROOM, H100_EFFICIENCY,
                      gpu_names)
from ..errors import HybridError, short
from .spec import DEFAULT_SEQ_LEN, MAX_LORA_RANK, MOE_IMBALANCE, Checkpointing, Loss, Optimizer, Precision

Kind = Literal["int", "float", "str", "list", "onoff", "bool"]
Use = Literal["argument", "cluster", "plan", "cli"]


@dataclass(frozen=True)
class Option:
    """One job option: its type, default, --help text, checks and where it applies."""

    name: str
    """The job key and argparse dest (the long flag is --name with - for _)."""
    kind: Kind
    """int | float | str | list (of strings; a repeatable flag) | onoff | bool (a switch: true or false)."""
    default: object = None
    """What the job runs with when the option is not given; None: decided per job, as the help says."""
    help: str = ""
    """--help text; {default} stands for the default (or `searched` in the commands that search)."""
    use: Use = "argument"
    """argument: an auto_wrap argument of the same name; cluster: part of auto_wrap's cluster=;
    plan: only what `hybrid plan` estimates (auto_wrap has the module and the optimizer); cli: a
    switch of the command, not a job key."""
    fill: bool = False
    """The parser fills in the default; False: it leaves None (not given) for the command to
    resolve, because the default depends on other options (or_default gives it)."""
    searched: str | None = None
    """The default's wording in `plan` and `tune`, which search this option when it is not given."""
    lo: float | None = None
    """Smallest value (int, float), inclusive."""
    hi: float | None = None
    """Largest value (int, float), inclusive."""
    choices: tuple[str, ...] | None = None
    """The accepted strings (checked by `normalise` where aliases exist)."""
    listed: bool = False
    """argparse lists the choices (`{1f1b,gpipe,interleaved}` in --help) and rejects others itself;
    else the check does, naming the valid ones."""
    normalise: str | None = None
    """A hybrid.config.spec checker (precision, optimizer, attention, checkpointing) the string must pass."""
    number_text: bool = False
    """A YAML number is read as its text (params: 7.5e9; gpu_memory: 80 is then refused for want of a unit)."""
    flag_per_command: bool = False
    """The commands add this flag themselves (estimate and measure require --strategy, plan filters by it)."""
    positional: bool = False
    """The command's positional argument (the model), optional."""
    group: str = ""
    """The --help group (cluster, training step, method and output); "" for the command's own."""

    @property
    def flag(self) -> str:
        return self.name if self.positional else "--" + self.name.replace("_", "-")

    def help_text(self, search: bool = False) -> str:
        shown = self.searched if search and self.searched else self.default
        return self.help.replace("{default}", str(shown))

    def check(self, value, label: str | None = None):
        """The value as the option's type; HybridError (naming `label`, default the key, the rule,
        and the value cut to 80 characters) otherwise. None (not given) passes."""
        label = label or self.name
        if value is None:
            return None
        if self.kind in ("int", "float"):
            return self._number(value, label)
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            raise HybridError(f"{label} must be true or false, got {short(value)}")
        if self.kind == "onoff":
            if isinstance(value, bool) or value in ("on", "off"):
                return value
            raise HybridError(f"{label} must be on or off, got {short(value)}")
        if self.kind == "list":
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            return [replace(self, kind="str").check(v, label) for v in items]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and self.number_text:
            value = str(value)
        if not isinstance(value, str):
            raise HybridError(f"{label} must be a string, got {type(value).__name__} {short(value)}")
        if not value.strip():
            raise HybridError(f"{label} is empty; give a value, or leave the option out for its default")
        if len(value) > 4096:
            raise HybridError(f"{label} is {len(value)} characters long; no valid value is")
        if self.choices is not None and value not in self.choices:
            raise HybridError(f"unknown {self.name} {short(value)}. Available: {', '.join(self.choices)}")
        if self.normalise is not None:
            from . import spec
            if self.normalise == "checkpointing":
                spec.checkpointing(value)
            else:
                spec.choice(self.name.replace("_", " "), value, getattr(spec, self.normalise))
        return value

    def _number(self, value, label: str):
        kind = int if self.kind == "int" else float
        number = None
        if not isinstance(value, bool) and not (kind is int and isinstance(value, float)):
            try:
                number = kind(value)
            except (TypeError, ValueError, OverflowError):
                pass
        if number is None or (kind is float and not math.isfinite(number)):
            rule = "an integer" if kind is int and isinstance(value, float) else \
                "a finite number" if kind is float and isinstance(value, (int, float)) else "a number"
            raise HybridError(f"{label} must be {rule}, got {short(value)}")
        if number < self.lo:
            rule = "a positive integer" if kind is int and self.lo == 1 else f"at least {self.lo:g}"
            raise HybridError(f"{label} must be {rule}, got {short(value)}")
        if number > self.hi:
            raise HybridError(f"{label} must be at most {self.hi:g}, got {short(value)}")
        return number


_SIZE = 10**9
"""Largest count of nodes, GPUs, sequences or tokens: beyond any cluster, below float overflow."""
_DEGREE = 10**6
"""Largest parallel degree or accumulation: beyond any job, below float overflow."""


def _either(literal) -> str:
    return " | ".join(get_args(literal))


_GROUPS: dict[str, tuple[Option, ...]] = {
    "": (
        Option("model", "str", positional=True, use="plan",
               help="preset name, HF config.json (or its folder), package.module:factory; omit with --params"),
        Option("params", "str", number_text=True, use="plan",
               help="bare parameter count (e.g. 7.5e9): model states only"),
    ),
    "cluster": (
        Option("nodes", "int", 1, "machines (default {default})", use="cluster", fill=True, lo=1, hi=_SIZE),
        Option("gpus_per_node", "int", 8, "GPUs per machine (default {default}; `measure` on a machine without "
               "CUDA: 2 CPU ranks)", use="cluster", lo=1, hi=_SIZE),
        Option("gpu", "str", "h100-80gb", "GPU model from the catalogue, any case, short names in brackets: "
               f"{gpu_names()} (default {{default}}; `measure` without CUDA: this machine's CPU; cpu: this machine's "
               "CPU ranks, as `tune` runs them)", use="cluster"),
        Option("gpu_spec", "str", help="a GPU not in the catalogue, described in a YAML file: name, memory (96GiB), "
               "bf16_flops (1.2PFLOP/s, dense), fp8_flops (optional), memory_bandwidth (4TB/s), scale_up_bandwidth "
               "(900GB/s, both directions), scale_up_domain (GPUs on one NVLink fabric: 8, 72), scale_out_bandwidth "
               "(400Gb/s per GPU: bits); instead of --gpu", use="cluster"),
        Option("scale_up_domain", "int", help="GPUs on one NVLink/NVSwitch fabric, a whole number of nodes (default: "
               "the GPU's: the node on HGX-class machines, 72 on GB200/GB300 NVL72 racks of 4-GPU trays); tp, cp "
               "and ep groups stay inside one", use="cluster", lo=1, hi=_SIZE),
        Option("gpu_memory", "str", help="override the GPU's memory, with its unit: 80GiB or 80GB (a bare 80 is "
               "refused)", number_text=True),
        Option("host_memory", "str", help="override a node's host memory (offload), e.g. 1TiB", use="cluster",
               number_text=True),
        Option("expandable_segments", "onoff", help="the CUDA allocator setting the job runs with (default: on, as "
               "auto_wrap sets it, unless PYTORCH_CUDA_ALLOC_CONF here says otherwise); decides reserved over "
               "allocated", use="cluster"),
        # reserved/allocated - 1: public runs show 0.11-0.36 (hybrid/estimation/memory/breakdown.py)
        Option("headroom", "float", help="reserved memory over allocated, as a fraction (default: calibrated on "
               f"public runs, {EXPANDABLE_HEADROOM:.2f} with expandable segments, {ALLOCATOR_HEADROOM:.2f} without)",
               use="cluster", lo=0.0, hi=4.0),
    ),
    "training step": (
        Option("micro_batch", "int", 1, "sequences per GPU per forward (default {default}; with --global-batch: "
               "chosen per layout unless given)", lo=1, hi=_SIZE),
        Option("global_batch", "int", help="sequences per optimizer step over all data-parallel ranks: each "
               "layout's micro-batch and accumulation are chosen so that micro-batch x accumulation x "
               "data-parallel ranks = this", lo=1, hi=_SIZE),
        Option("global_batch_tokens", "int", help="the global batch in tokens (a multiple of --seq-len), instead of "
               "--global-batch", lo=1, hi=10**15),
        Option("seq_len", "int", help=f"tokens per sequence (default: the model's maximum, at most {DEFAULT_SEQ_LEN})",
               lo=1, hi=_SIZE),
        Option("precision", "str", help=f"{_either(Precision)} (default bf16-mixed; fp16-mixed on GPUs without "
               "bf16, e.g. v100, t4)", normalise="Precision"),
        Option("gradient_accumulation", "int", 1, "micro-batches per optimizer step (default {default}); global "
               "batch = micro-batch x this x data-parallel ranks", lo=1, hi=_DEGREE),
        Option("optimizer", "str", "adamw", f"{_either(Optimizer)} (default {{default}})", use="plan", fill=True,
               normalise="Optimizer"),
        Option("activation_checkpointing", "str", "none", f"{_either(Checkpointing)} | layer:N (default: "
               "{default})", searched="the planner tries none, selective and full", normalise="checkpointing"),
        Option("compile", "bool", False, "torch.compile each block and the loss, as torchtitan does (fsdp and ddp "
               "strategies)", fill=True),
        Option("float8", "bool", False, "torchao float8 training of the block linears (tensorwise, float8 "
               "all-gather under FSDP), behind --compile, as torchtitan's float8 converter; GPUs with float8 "
               "tensor cores (Ada, Hopper, Blackwell, MI300 and newer)", fill=True),
        Option("float8_recipe", "str", "tensorwise", "with --float8: tensorwise (one scale per tensor; Ada, Hopper, "
               "Blackwell, MI300) | mxfp8 (torchao's MX recipe: one e8m0 scale per 32 elements, cuBLAS's MXFP8 "
               "GEMM; Blackwell B200/B300/GB200/GB300 only) (default {default}); each priced at its GPU's peak",
               choices=("tensorwise", "mxfp8")),
        Option("fault_tolerant", "bool", False, "torchft replica groups (pip install 'hybrid[ft]'): each "
               "dp_replicate group a failure domain that is dropped and rejoins; priced with torchft's all-reduce "
               "of the gradients across the groups and a quorum per step (docs/fault_tolerance.md)", fill=True),
        Option("attention", "str", "sdpa", "sdpa (flash) | eager (default {default})", fill=True,
               normalise="Attention"),
        Option("loss", "str", "eager", f"{_either(Loss)}: the whole fp32 logits, torchtune's chunked cross-entropy "
               "or Liger's fused linear cross-entropy (default {default})", fill=True, normalise="Loss"),
        Option("shard_size", "int", help="ranks per shard group for hsdp (default: every valid size)",
               lo=1, hi=_SIZE),
        Option("tp", "int", help="tensor-parallel degree inside a node (default: plan tries 1, 2, 4, 8 where they "
               "divide the GPUs per node and the heads; estimate/compare use 1)", lo=1, hi=_DEGREE),
        Option("pp", "int", help="pipeline stages (default: plan tries every divisor of the nodes, or of one node's "
               "GPUs; estimate/compare use 1); micro-batches = --gradient-accumulation", lo=1, hi=_DEGREE),
        Option("cp", "int", help="context-parallel degree: each sequence split over this many ranks in 2cp chunks "
               "(default: plan tries every divisor of the GPUs that divides the sequence into 2cp chunks when "
               "--seq-len >= 16384, else 1; estimate/compare use 1)", lo=1, hi=_DEGREE),
        Option("ep", "int", help="expert-parallel degree of a mixture-of-experts model: each layer's experts split "
               "over this many of the dp_shard x cp ranks, tokens sent to them by all-to-all (default: plan tries "
               "every divisor of the experts that divides them, fsdp strategies; estimate/compare use 1)",
               lo=1, hi=_DEGREE),
        Option("moe_imbalance", "float", MOE_IMBALANCE, "MoE with --ep > 1: tokens the busiest rank's experts "
               "receive over the mean (default {default}, Switch Transformer's training capacity factor; raise it "
               "for a cold start)", lo=1.0, hi=_DEGREE),
        Option("schedule", "str", help="pipeline schedule (default: plan tries 1f1b, or gpipe with fewer "
               "micro-batches than stages, and interleaved)", choices=("1f1b", "gpipe", "interleaved"), listed=True),
    ),
    # goodput (hybrid/planning/goodput.py): what failures, restarts and checkpoints cost the plan
    "goodput": (
        Option("mtbf_gpu_hours", "float", help="GPU-hours between unexpected interruptions; the job fails every "
               "this / GPUs hours (default: Llama 3's 419 in 54 days on 16,384 GPUs = 50,677, arXiv 2407.21783)",
               use="plan", lo=1e-3, hi=1e12),
        Option("storage_bandwidth", "str", help="checkpoint write and read bandwidth per node, e.g. 10GB/s (default: "
               "Llama 3's 2 TB/s sustained over 2,048 nodes = 0.98 GB/s per node)", use="plan"),
        Option("async_checkpoint", "bool", False, "price saves as DCP async saves: training waits only for the "
               "copy to host memory (default: synchronous, training waits for the write)", use="plan", fill=True),
    ),
    "fine-tuning": (
        Option("lora_rank", "int", help="fine-tune LoRA adapters of this rank on a frozen base (PEFT's r, e.g. 16): "
               "only the adapters keep fp32 masters, gradients and optimizer state; the base is held in the compute "
               "dtype (or quantised: --quantize-base)", use="plan", lo=1, hi=MAX_LORA_RANK),
        Option("lora_targets", "str", help="with --lora-rank: comma-separated module-name suffixes that get adapters "
               "(PEFT's target_modules; default: the attention and MLP projections, "
               "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj or the gpt2-style ones)", use="plan"),
        Option("quantize_base", "str", help="with --lora-rank: store the frozen base's block linears quantised, as "
               "QLoRA: nf4 (bitsandbytes 4-bit NormalFloat, double-quantised constants) | int8 (LLM.int8)",
               use="plan", choices=("nf4", "int8")),
        Option("lora_dropout", "float", help="with --lora-rank: PEFT's lora_dropout on each adapter's input "
               "(default 0, PEFT's)", use="plan", lo=0.0, hi=0.99),
    ),
    "method and output": (
        Option("method", "str", "analytic", "analytic (closed form, instant; default) | traced (simulate one rank "
               "of the real job with fake tensors, seconds per strategy) | measured (run it here on local ranks)",
               use="plan", fill=True, choices=("analytic", "traced", "measured")),
        Option("implementation", "str", "auto", "what traced/measured runs for a preset: auto (transformers when "
               "installed, else ours) | transformers | hybrid", use="plan", fill=True,
               choices=("auto", "transformers", "hybrid")),
        # fraction of peak FLOP/s; public runs: 0.3-0.65 (hybrid/config/cluster.py)
        Option("efficiency", "float", help="fraction of peak FLOP/s the cost model assumes (default: the GPU's "
               f"figure, calibrated on public runs: a100 {A100_EFFICIENCY:g}, h100 {H100_EFFICIENCY:g}; "
               f"{DEFAULT_EFFICIENCY:g} for GPUs without public runs)", use="plan", lo=0.01, hi=1.0),
        Option("strategies_dir", "list", (), "extra catalogue directory (repeatable)", fill=True),
        Option("strategy", "str", help="the catalogue strategy that estimate and measure run and plan keeps to (each "
               "adds its own --strategy)", flag_per_command=True),
        Option("calibration", "str", help="a calibration file from `hybrid tune --save-calibration` (default: "
               "$HYBRID_CALIBRATION): the cluster's measured speed figures replace the catalogue's"),
        Option("json", "bool", False, "print the JSON contract instead of a table", use="cli", fill=True),
        Option("config", "str", help="job file (YAML) with any of these options as keys; flags override it",
               use="cli"),
        Option("save_config", "str", help="write the options in effect to this job file", use="cli"),
        Option("allow_code", "bool", False, "let the --config job file's model: be a package.module:factory, "
               "which imports and runs that code (without it a job file is data: a preset, a config.json or its "
               "folder)", use="cli", fill=True),
    ),
}

OPTIONS: dict[str, Option] = {o.name: replace(o, group=g) for g, rows in _GROUPS.items() for o in rows}
"""Every option of `hybrid plan|estimate|compare|measure|tune`, in --help order."""

JOB_KEYS = tuple(k for k, o in OPTIONS.items() if o.use != "cli")
"""What a job file may hold: the model, the cluster, the training step and the method (not output
switches such as --json or --emit)."""
WRAP_KEYS = tuple(k for k, o in OPTIONS.items() if o.use == "argument")
"""Job keys that are auto_wrap arguments of the same name."""
CLUSTER_KEYS = tuple(k for k, o in OPTIONS.items() if o.use == "cluster")
"""Job keys that make auto_wrap's cluster= (Cluster.build's arguments)."""
PLAN_ONLY = tuple(k for k, o in OPTIONS.items() if o.use == "plan")
"""Keys that describe what `hybrid plan` estimates: auto_wrap has the module and the optimizer."""


def or_default(name: str, value):
    """The value where given, else the option's default."""
    return OPTIONS[name].default if value is None else value


def lora_of_options(values: dict):
    """The LoRA (config/spec.LoRA) of the fine-tuning options in `values` (the parsed flags or a
    job), None without --lora-rank; the other fine-tuning options need it."""
    from .spec import LoRA
    rank = values.get("lora_rank")
    if rank is None:
        given = [OPTIONS[k].flag for k in ("lora_targets", "quantize_base", "lora_dropout")
                 if values.get(k) is not None]
        if given:
            raise HybridError(f"{given[0]} needs --lora-rank R (LoRA trains adapters of rank R over the frozen"
                              f"{' quantised' if values.get('quantize_base') else ''} base), e.g. --lora-rank 16")
        return None
    targets = values.get("lora_targets")
    kw = {"targets": tuple(t for t in targets.split(",") if t.strip())} if targets is not None else {}
    if targets is not None and not kw["targets"]:
        raise HybridError(f"lora-targets {short(targets)} names no module: give comma-separated suffixes, e.g. "
                          "q_proj,v_proj")
    return LoRA(rank=rank, quantize=values.get("quantize_base"), dropout=values.get("lora_dropout") or 0.0, **kw)
