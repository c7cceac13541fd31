"""The family interface: everything the planner, estimators, CLI and emitters ask of a backend
family, in one object per family (pure: no torch until `runtime()` is called)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass



GROUPED_MM_FP32 = {
    "CUDA": "on CUDA torch._grouped_mm takes fp32 but runs its grouped kernel on bf16 only, on SM90/SM100: fp32 "
            "runs one matmul per expert after copying the offsets to the host",
    "ROCm": "on ROCm torch._grouped_mm takes fp32",
    "CPU": "on CPU torch._grouped_mm takes fp32, one matmul per expert as for every dtype there",
}
"""What torch._grouped_mm does with fp32 inputs, by accelerator software (GPUSpec.software). Every real
kernel takes fp32, bf16 and fp16 (aten/src/ATen/native/GroupedMMUtils.h _grouped_mm_validate_inputs);
CUDA's runs its CUTLASS grouped kernel for bf16 on SM90/SM100 only, else _grouped_mm_fallback: the offsets
copied to the host, one mm per group (native/cuda/GroupedBlas.cpp _grouped_mm_cuda); the CPU kernel always
runs that fallback (native/Blas.cpp _grouped_mm); ROCm's takes fp32 into CK's grouped kernel where built
(native/hip/ck_group_gemm.hip). Its meta kernel, which fake tensors (the trace) run, takes bf16 only
(torch/_meta_registrations.py _meta_grouped_mm_common)."""


@dataclass(frozen=True)
class Comm:
    """A family's communication for one optimizer step, seconds (Links prices them)."""
    fwd: float = 0.0
    """Collectives in every micro-batch's forward (FSDP/ZeRO-3 all-gathers)."""
    bwd: float = 0.0
    """Collectives in every micro-batch's backward (re-gathers; ZeRO-2/3 reduce-scatters)."""
    sync_bwd: float = 0.0
    """Collectives only in the window's last backward (the gradient reduction no-sync defers)."""
    tail: float = 0.0
    """The part no compute can hide (first gather, last reduce-scatter), per micro-batch."""
    sync_tail: float = 0.0
    """... only in the window's last micro-batch (DDP's last bucket)."""
    after_step: float = 0.0
    """After the optimizer step, never hidden (ZeRO-1/2's all-gather of updated params)."""
    offload: float = 0.0
    """Host transfers and the host optimizer step."""
    copied_micro: float = 0.0
    """Bytes packed into and out of communication buffers every micro-batch."""
    copied_sync: float = 0.0
    """... only at the window's end."""


@dataclass(frozen=True)
class FamilyConfig:
    """A family's own knobs, typed; each family subclasses it with its fields (their defaults the
    library's) and validates them in __post_init__ (HybridError naming the knob and the rule)."""

    @property
    def offload(self) -> bool:
        """Anything (optimizer state, parameters) kept in host memory."""
        return False

    @property
    def optimizer_on_host(self) -> bool:
        """The optimizer step runs on the host (its states, the fp32 master and the step there)."""
        return False


@dataclass(frozen=True)
class HostOffloadConfig(FamilyConfig):
    """A config whose subclass has the knobs offload_optimizer and offload_params (FSDP2's
    CPUOffloadPolicy, DeepSpeed's offload_optimizer / offload_param)."""

    @property
    def offload(self) -> bool:
        return self.offload_optimizer or self.offload_params

    @property
    def optimizer_on_host(self) -> bool:
        return self.offload_optimizer


class Family:
    """One backend family. Subclasses set the class attributes and override what differs."""

    name: str = ""
    config: type = FamilyConfig
    """The family's typed knobs (a FamilyConfig dataclass): the catalogue keys it accepts besides
    name, family, description, shard and complexity."""
    runtime_module: str = ""
    """The module with check, place, wrap, engine and traced_apply (imports torch and the library)."""
    emits: str | None = None
    """The `--emit` kind this family writes, if any."""
    keeps_master_copy: bool = False
    """The optimizer step also writes a low-precision copy of the fp32 master (DeepSpeed)."""

    @property
    def knobs(self) -> frozenset:
        from dataclasses import fields
        return frozenset(f.name for f in fields(self.config))

    # --- catalogue ------------------------------------------------------------------------------
    def validate(self, s, where: str) -> None:
        """Family rules on a preset's shard rule (its knobs validate themselves); HybridError
        naming the file and the fix."""

    def default_complexity(self, s) -> int:
        """Tie-break rank, lower is simpler (replication < partial sharding < full sharding <
        offload). An ordering we chose, not a measurement: it only decides between candidates
        whose predicted step times are within the planner's TIE."""
        return 0

    def shard_is_free(self, s) -> bool:
        """Whether the planner / --shard-size may choose this preset's shard size."""
        return False

    # --- checkpoints (hybrid/planning/goodput.py) ---------------------------------------------------
    def checkpoint_shards(self, dims) -> int:
        """Ranks one copy of a rank's state (its pipeline stage's tensor-parallel share) is split over in
        the state dict the checkpoint loads into (hybrid/runtime/backends/*.checkpoint_state): FSDP's
        dp_shard x cp shards."""
        return dims.dp_shard * dims.cp

    # --- estimation -----------------------------------------------------------------------------
    def check(self, layout) -> None:
        """NotApplicable, with the reason, when this family cannot run the layout's dimensions (the
        first of problems())."""
        for problem in self.problems(layout):
            raise problem
        problem = self.ep_problem(layout.dp, layout.dims.ep)
        if problem is not None:
            raise problem

    def ep_problem(self, s, ep: int):
        """Why this family cannot split experts `ep` ways (NotApplicable naming ep), or None; asked
        with the degree alone before any ParallelDims asks ep to divide the family's ranks (a ddp's
        dp_shard is 1)."""
        if ep > 1 and not self.supports_ep:
            from .placement import NotApplicable
            return NotApplicable(f"ep {ep}: expert parallelism runs under FSDP2 only, not {s.name}; use an fsdp or "
                                 "hsdp strategy with ep, or ep 1", "ep")
        return None

    def applied_wrap(self, layout, staged: bool) -> tuple[str, str, bool | None, bool]:
        """The data-parallel wrap this family's runtime applies to the layout: (wrap, units,
        reshard_after_forward, whether mixed precision runs under torch.autocast), as
        hybrid.layout.applied.AppliedPlan records it."""
        raise NotImplementedError

    def priced_strategy(self, s, applied):
        """The strategy whose placement is what runs under `applied` (an AppliedPlan or None): the
        preset itself unless the family's runtime wraps through another family (ddp over tp)."""
        return s

    def states_split(self, layout, n: int) -> tuple[int, bool] | None:
        """(the ranks one copy of the model states is split over, whether the blocks' parameters stay
        gathered from forward to backward) under the plain data-parallel wrap this family's runtime
        applies without tp, cp or ep, for the trace's floor (measure/traced.states_floor); None where
        the family's states are not torch's parameters, gradients and optimizer states as built."""
        return None

    def autocast_experts_problem(self, layout, spec, grouped_experts: bool, software: str):
        """Why the layout cannot run the model's transformers grouped_mm experts (NotApplicable), or
        None: under a wrap that runs mixed precision under torch.autocast over fp32 weights (applied_wrap)
        transformers casts the experts' inputs to their weights' dtype (integrations/moe.py _grouped_mm), and
        grouped_mm is not on autocast's list, so they multiply in fp32 and keep fp32 activations, which the
        estimate (bf16 under autocast) does not price and the trace cannot run (GROUPED_MM_FP32). The one rule
        the estimate (`grouped_experts`: ModelProfile.grouped_experts), the trace and the runtime
        (model.profile.runs_grouped_experts of the module) ask, with the line true on `software` (the planned
        cluster's GPUSpec.software, or the live rank's Runtime.software)."""
        if not grouped_experts or spec.precision not in ("bf16-mixed", "fp16-mixed"):
            return None
        if not self.applied_wrap(layout, layout.pipeline is not None or layout.dims.pp > 1)[3]:
            return None
        from .placement import NotApplicable
        return NotApplicable(f"{layout.dp.name} under {spec.precision} keeps fp32 weights under autocast, so "
                             "transformers' grouped_mm experts (not on autocast's list) multiply in fp32 and keep fp32 "
                             f"activations, which the estimate does not price ({GROUPED_MM_FP32[software]}) and the "
                             "trace cannot run (torch's fake-tensor _grouped_mm takes bf16 only): use fsdp (bf16 "
                             "compute over fp32 masters), --precision bf16, or build the model with "
                             "experts_implementation='eager'")

    def problems(self, layout) -> list:
        """Every reason (NotApplicable, naming its dimension) this family cannot run the layout's
        pipeline, tensor- and context-parallel dimensions, in that order; empty when it can."""
        return []

    def check_device(self, s, spec, cuda: bool) -> None:
        """NotApplicable when the family cannot run this job at all on this kind of device (the one
        place each such rule lives: the planner asks it of the cluster, the backends of the device)."""
        if s.offload and not cuda:
            from .placement import NotApplicable
            raise NotApplicable(f"{s.name} offloads GPU memory to the host, which needs CUDA; CPU ranks run in "
                                "host memory already (use the same strategy without offload)")
        if s.offload and spec.optimizer == "muon":
            from .placement import NotApplicable
            raise NotApplicable(f"{s.name} steps the optimizer on the host, where Muon's Newton-Schulz matmuls (5 per "
                                "block matrix) run on the CPU; use the same strategy without offload for muon")

    def placement(self, s, profile, spec, n: int, cluster, stage=None):
        raise NotImplementedError

    def comm(self, s, profile, spec, cluster, n: int, links) -> Comm:
        raise NotImplementedError

    def host(self, s, profile, spec, cluster, n: int, stage=None):
        """The step's collective calls and per-tensor host operations (hybrid/families/host.py), as
        this family's library issues them; what their seconds are is a calibration's to fit."""
        raise NotImplementedError

    torchtitan: bool = True
    """Whether torchtitan runs this family (--emit torchtitan)."""

    fault_tolerant: bool = False
    """Whether the family reduces gradients with torch's own collectives inside one replica group,
    so that torchft can average them across groups (hybrid/runtime/ft.py): DDP and FSDP2."""

    supports_ep: bool = False
    """Whether the family shards a MoE layer's experts over ep ranks (ep > 1) as a unit of their own
    over the expert_shard ranks (estimation/memory/moe.py, runtime/backends/ep.py; torchtitan's layout)."""

    runs_bitsandbytes_base: bool = False
    """Whether the runtime trains a module whose frozen base bitsandbytes quantised (Params4bit,
    Int8Params): only a family that keeps whole replicas does (FSDP2 and ZeRO-3 shard plain
    tensors, and would drop the quantisation state bitsandbytes keeps beside each parameter)."""

    def sharded_optimizer(self, s) -> bool:
        """Whether the optimizer step runs on 1/N of the parameters."""
        return True

    def traced_replaces(self, s) -> frozenset:
        """Categories a traced run takes from `placement` (the traced proxy holds them differently)."""
        return frozenset({"params", "grads", "optimizer"}) if s.offload else frozenset()

    def traced_note(self, s) -> str:
        return f"{s.name}: traced as fsdp, with host offload in place of the traced state"

    # --- runtime and hand-off ---------------------------------------------------------------------
    def runtime(self):
        return importlib.import_module(self.runtime_module)

    handoff_module: str = ""
    """The module whose HANDOFF writes this family's configs for other tools (hybrid/handoff/)."""

    def handoff(self):
        return importlib.import_module(self.handoff_module).HANDOFF
