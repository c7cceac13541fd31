"""Hand-off to other tools: the chosen layout as a DeepSpeed JSON config (for deepspeed.initialize,
or the HF Trainer's "auto" form) or FSDP2 settings as YAML, written by the family
(hybrid/families/); the torchrun command line of torchtitan 0.3 for any FSDP/DDP layout; an Accelerate config
YAML (`accelerate launch --config_file`) for any layout Accelerate can express."""
from __future__ import annotations

from ..errors import HybridError
from ..families import FAMILIES
from ..planning.planner import Candidate, Plan
from ..layout.layout import DIMENSIONS
from ..model.profile import ModelProfile
from .accelerate import accelerate_yaml
from .base import stack_notes
from .torchtitan import TORCHTITAN_DEGREES, _pick_torchtitan, torchtitan_command

KINDS = {f.emits: f for f in FAMILIES.values() if f.emits}
"""--emit choices a family writes -> that family."""
CHOICES = (*KINDS, "torchtitan", "accelerate")


def emit_notes(kind: str, c: Candidate, target: str = "engine", cluster=None) -> list[str]:
    """Lines for stderr beside an emitted config: what its family says the user sets elsewhere,
    and on `cluster`'s ROCm GPUs the ROCm stack (RCCL, HIP) in place of CUDA's."""
    notes = KINDS[kind].handoff().emit_notes(c, target) if kind in KINDS else []
    return notes + (stack_notes(cluster) if cluster is not None else [])


def _pick(p: Plan, family, name: str | None) -> Candidate:
    """The named strategy's best fitting candidate, else the chosen one if it is of this family,
    else the fastest fitting candidate of this family."""
    pool = [c for c in p.candidates if c.strategy.family_obj is family and c.memory is not None]
    if name:
        pool = [c for c in pool if c.name == name]
        if not pool:
            from ..families.catalogue import load_catalogue
            valid = sorted(n for n, s in load_catalogue().items() if s.family_obj is family)
            raise HybridError(f"strategy {name!r} is not a {family.name} strategy; --emit {family.emits} "
                              f"needs one of: {', '.join(valid)}")
    elif p.chosen is not None and p.chosen.strategy.family_obj is family:
        return p.chosen
    fitting = [c for c in pool if c.known_to_fit]
    if not fitting:
        raise HybridError(f"no {family.name} candidate fits this job; see `hybrid plan` for why")
    return min(fitting, key=lambda c: c.cost.time_per_token)


def emit(kind: str, p: Plan, profile: ModelProfile, name: str | None = None,
         target: str = "engine") -> tuple[str, Candidate]:
    """The config text and the candidate it describes (which may differ from the plan's choice
    when the choice is of another family: the caller says so)."""
    if p.missing:
        raise HybridError(f"{', '.join(p.missing)} unknown ({p.model.name} is a bare parameter count): no layout is "
                          "known to fit, so there is none to emit; give a preset, a config.json or a module")
    if kind == "torchtitan":
        c = _pick_torchtitan(p, name)
        return torchtitan_command(c, p), c
    if kind == "accelerate":
        c = _named(p, name, _accelerate_runs) or p.chosen
        if c is None:
            raise HybridError("nothing fits this job, so there is no layout to emit; see `hybrid plan` for why")
        _expressible(c, kind)
        if not _accelerate_runs(c):
            raise HybridError(f"{c.layout.label}: Accelerate's ParallelismConfig composes tp/cp only with a sharded "
                              f"data-parallel dimension, not with dp_replicate {c.parallel.dp_replicate} x dp_shard 1; "
                              "emit an fsdp or hsdp layout with dp_shard > 1 (--strategy fsdp), or --emit torchtitan")
        return accelerate_yaml(c, p, profile), c
    if kind not in KINDS:
        raise HybridError(f"unknown --emit {kind!r}. Available: {', '.join(CHOICES)}")
    family = KINDS[kind]
    c = _pick(p, family, name)
    _expressible(c, kind)
    return family.handoff().emit(c, p, profile, target), c


HANDOFF_DIMS = {"accelerate": ("tp", "cp")}
"""The model-parallel dimensions each hand-off can express (the families' own emitters: tp, pp and
cp, their Family.emit says where not). Expert parallelism is torchtitan's alone among the tools we
hand off to: DeepSpeed's JSON, the HF Trainer, Accelerate's FSDP plugin and plain FSDP2 settings
have no key that splits a transformers MoE block's experts over ranks; Accelerate has no pipeline
stages for FSDP or DeepSpeed plans."""


def _expressible(c: Candidate, kind: str) -> None:
    """HybridError naming the first dimension the layout uses that this hand-off cannot express,
    with torchtitan's key for it or pinning it to 1."""
    expresses = HANDOFF_DIMS.get(kind, ("tp", "pp", "cp"))
    for dim, n in c.layout.used().items():
        if dim not in expresses:
            raise HybridError(f"{c.layout.label}: --emit {kind} cannot express {DIMENSIONS[dim]} ({dim} {n}); use "
                              f"--emit torchtitan (--parallelism.{TORCHTITAN_DEGREES[dim]}), or plan with "
                              f"--{dim} 1")


def _accelerate_runs(c: Candidate) -> bool:
    """Accelerate's ParallelismConfig refuses tp or cp over pure replication (dp_replicate > 1 with
    dp_shard 1: accelerate/parallelism_config.py); every other layout of its dimensions it composes."""
    d, used = c.parallel, c.layout.used()
    return not (d.dp_replicate > 1 and d.dp_shard == 1 and ("tp" in used or "cp" in used))


def _named(p: Plan, name: str | None, runs=lambda c: True) -> Candidate | None:
    """The fastest fitting candidate of the named strategy that the hand-off `runs` (None without a name)."""
    if not name:
        return None
    fitting = [c for c in p.candidates if c.name == name and c.known_to_fit and runs(c)]
    if not fitting:
        raise HybridError(f"strategy {name!r} has no layout that fits this job; see `hybrid plan --strategy {name}`")
    return min(fitting, key=lambda c: c.cost.time_per_token)


