"""The family interface: everything the planner, estimators, CLI and emitters ask of a backend
family, in one object per family (pure: no torch until `runtime()` is called)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..errors import HybridError


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


class Family:
    """One backend family. Subclasses set the class attributes and override what differs."""

    name: str = ""
    knobs: frozenset = frozenset()
    """The catalogue keys this family accepts (besides name, family, description, shard, complexity)."""
    runtime_module: str = ""
    """The module with apply() and traced_apply() (imports torch and the library)."""
    emits: str | None = None
    """The `--emit` kind this family writes, if any."""
    keeps_master_copy: bool = False
    """The optimizer step also writes a low-precision copy of the fp32 master (DeepSpeed)."""

    # --- catalogue ------------------------------------------------------------------------------
    def validate(self, s, where: str) -> None:
        """Family rules on a preset's knobs; HybridError naming the file and the fix."""

    def simplicity(self, s) -> int:
        """Tie-break rank, lower is simpler (replication < partial sharding < full sharding <
        offload). An ordering we chose, not a measurement: it only decides between candidates
        whose predicted step times are within the planner's TIE."""
        return 0

    def shard_is_free(self, s) -> bool:
        """Whether the planner / --shard-size may choose this preset's shard size."""
        return False

    # --- estimation -----------------------------------------------------------------------------
    def check(self, s, spec, cuda: bool) -> None:
        """NotApplicable when the family cannot run this job at all on this kind of device (the one
        place each such rule lives: the planner asks it of the cluster, the backends of the device)."""
        if s.offload and not cuda:
            from ..memory.layout import NotApplicable
            raise NotApplicable(f"{s.name} offloads GPU memory to the host, which needs CUDA; CPU ranks run in "
                                "host memory already (use the same strategy without offload)")

    def layout(self, s, profile, spec, n: int, cluster):
        raise NotImplementedError

    def comm(self, s, profile, spec, cluster, n: int, links) -> Comm:
        raise NotImplementedError

    def host(self, s, profile, spec, cluster, n: int):
        """The step's collective calls and per-tensor host operations (hybrid/overhead.py), as
        this family's library issues them; what their seconds are is a calibration's to fit."""
        raise NotImplementedError

    supports_tp: bool = True
    supports_pp: bool = True
    """Whether the family's wrapper runs on pipeline stages (torch.distributed.pipelining)."""
    """Whether the family runs over tensor-parallel groups (tp > 1)."""

    def check_tp(self, s, tp: int) -> None:
        if tp > 1 and not self.supports_tp:
            from ..memory.layout import NotApplicable
            raise NotApplicable(f"{s.name}: not applicable with tp > 1 (use an fsdp or ddp strategy over the "
                                "tensor-parallel groups)")

    supports_cp: bool = True
    """Whether the family runs over context-parallel groups (cp > 1): its gradient reduction
    spans dp x cp (FSDP shards over dp_shard x cp; DDP all-reduces over dp_replicate x cp)."""

    def check_cp(self, s, cp: int, tp: int = 1) -> None:
        if cp > 1 and not self.supports_cp:
            from ..memory.layout import NotApplicable
            raise NotApplicable(f"{s.name}: not applicable with cp > 1 (ZeRO partitions over the whole world, "
                                "the cp ranks included; use an fsdp or ddp strategy with cp)")

    def sharded_optimizer(self, s) -> bool:
        """Whether the optimizer step runs on 1/N of the parameters."""
        return True

    def traced_replaces(self, s) -> frozenset:
        """Categories a traced run takes from `layout` (the traced proxy holds them differently)."""
        return frozenset({"params", "grads", "optimizer"}) if s.offload else frozenset()

    def traced_note(self, s) -> str:
        return f"{s.name}: traced as fsdp, with host offload in place of the traced state"

    # --- runtime and hand-off ---------------------------------------------------------------------
    def runtime(self):
        return importlib.import_module(self.runtime_module)

    def emit(self, candidate, plan, profile, target: str = "engine") -> str:
        raise HybridError(f"{self.name} strategies have no config to emit")

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
            "fits": c.fits, "step_time_s": round(c.cost.seconds, 4), "memory_method": p.method}
