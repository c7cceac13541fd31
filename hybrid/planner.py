"""Every catalogue strategy against the cluster: memory per GPU, fits or not, and a choice."""
from __future__ import annotations

from dataclasses import dataclass

from .catalogue import Strategy, load_catalogue
from .cluster import Cluster
from .errors import HybridError
from .memory.analytic import NotApplicable, check_job, estimate
from .memory.breakdown import MemoryBreakdown
from .profile import ModelProfile
from .spec import TrainSpec
from .units import fmt_bytes


@dataclass(frozen=True)
class Candidate:
    """One strategy at one shard size and checkpointing choice, with its estimate."""

    strategy: Strategy
    shard_size: int
    spec: TrainSpec
    memory: MemoryBreakdown | None
    """None when the strategy cannot run this job at all (see reason)."""
    fits: bool
    reason: str

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def label(self) -> str:
        ckpt = self.spec.activation_checkpointing
        return self.name + ("" if ckpt == "none" else f"+ac:{ckpt}")

    def to_dict(self) -> dict:
        m = self.memory
        return {
            "name": self.name, "family": self.strategy.family, "shard_size": self.shard_size,
            "activation_checkpointing": self.spec.activation_checkpointing,
            "per_gpu": m.to_dict() if m else None,
            "per_cpu": {"total": m.cpu if m else 0},
            "model_states": m.model_states if m else None,
            "phase": m.phase if m else None,
            "fits": self.fits, "reason": self.reason,
            "notes": list(m.notes) if m else [],
        }


@dataclass(frozen=True)
class Plan:
    model: ModelProfile
    cluster: Cluster
    spec: TrainSpec
    candidates: tuple[Candidate, ...]
    chosen: Candidate | None
    method: str = "analytic"

    def to_dict(self) -> dict:
        """The JSON contract shared by `hybrid estimate` and `hybrid plan` (see README)."""
        return {
            "model": self.model.name, "params": self.model.params, "world_size": self.cluster.world_size,
            "capacity_bytes": self.cluster.capacity_bytes,
            "chosen": self.chosen.name if self.chosen else None,
            "method": self.method, "gpu": self.cluster.gpu.name, "nodes": self.cluster.nodes,
            "gpus_per_node": self.cluster.gpus_per_node, "spec": self.spec.to_dict(),
            "strategies": [c.to_dict() for c in self.candidates],
        }


def judge(strategy: Strategy, profile: ModelProfile, spec: TrainSpec, cluster: Cluster,
          shard_size: int | None = None, estimator=None) -> Candidate:
    """Estimate one strategy and say whether and why it fits. `estimator(strategy, spec, n)`
    replaces the analytic model (traced, measured); the analytic one still rules out strategies
    that cannot run the job at all, before anything expensive runs."""
    n = strategy.shard_size(cluster, shard_size)
    try:
        m = estimate(strategy, profile, spec, cluster, n)
        if estimator is not None:
            m = estimator(strategy, spec, n)
    except NotApplicable as e:
        return Candidate(strategy, n, spec, None, False, f"not applicable: {e}")
    cap = cluster.capacity_bytes
    if m.total <= cap:
        why = f"fits: {fmt_bytes(m.total)} of {fmt_bytes(cap)}, largest {m.describe_largest()}"
    else:
        why = f"needs {fmt_bytes(m.total)} > {fmt_bytes(cap)}: {m.describe_largest()}"
    if m.activations is None:
        why += " (activations unknown)"
    return Candidate(strategy, n, spec, m, m.total <= cap, why)


def plan(profile: ModelProfile, spec: TrainSpec, cluster: Cluster,
         catalogue: dict[str, Strategy] | None = None, shard_size: int | None = None,
         strategies: list[str] | None = None, estimator=None, method: str = "analytic") -> Plan:
    """Judge every strategy; choose the simplest one that fits (lowest catalogue rank)."""
    check_job(profile, spec)
    cat = catalogue if catalogue is not None else load_catalogue()
    names = strategies or list(cat)
    for n in names:
        if n not in cat:
            raise HybridError(f"unknown strategy {n!r}. Available: {', '.join(cat)}")
    if shard_size is not None and not any(cat[n].shard_is_free for n in names):
        raise HybridError("--shard-size applies to strategies with a free shard size (hsdp); "
                          f"none of {', '.join(names)} has one")
    cands = tuple(judge(cat[n], profile, spec, cluster, shard_size, estimator) for n in names)
    fitting = [c for c in cands if c.fits]
    chosen = min(fitting, key=lambda c: c.strategy.rank()) if fitting else None
    return Plan(profile, cluster, spec, cands, chosen, method)


def format_table(p: Plan) -> str:
    cols = ("params", "grads", "optimizer", "activations", "temporaries", "buffers", "overhead", "total")
    head = f"{'strategy':<22}{'shard':>6}" + "".join(f"{c[:11]:>12}" for c in cols) + "  fits  note"
    lines = [head, "-" * len(head)]
    for c in p.candidates:
        mark = "*" if p.chosen is c else " "
        if c.memory is None:
            lines.append(f"{mark}{c.label:<21}{c.shard_size:>6}" + f"{'-':>12}" * len(cols) + f"  {'n/a':>4}  {c.reason}")
            continue
        vals = "".join(f"{fmt_bytes(getattr(c.memory, k) if k != 'total' else c.memory.total):>12}" for k in cols)
        note = c.memory.describe_largest() if c.fits else c.reason.split(": ", 1)[1] if ": " in c.reason else c.reason
        lines.append(f"{mark}{c.label:<21}{c.shard_size:>6}{vals}  {'yes' if c.fits else 'no':>4}  {note}")
    return "\n".join(lines)


def format_plan(p: Plan, choose: bool = True) -> str:
    """The comparison table and the decision; choose=False for a single strategy's estimate."""
    s = p.spec
    out = [f"model {p.model.name}: {p.model.params:,} params; micro-batch {s.micro_batch} x seq {s.seq_len}, "
           f"{s.precision}, {s.optimizer}, activation checkpointing {s.activation_checkpointing}, "
           f"attention {s.attention}",
           f"cluster {p.cluster.describe()}; method {p.method}", "", format_table(p), ""]
    if not choose:
        c = p.candidates[0]
        out.append(f"{c.label} (shard size {c.shard_size}): {c.reason}")
    elif p.chosen:
        out.append(f"chosen: {p.chosen.label} (shard size {p.chosen.shard_size}), the simplest strategy that "
                   f"fits; {p.chosen.reason}")
    else:
        out.append(f"nothing fits in {fmt_bytes(p.cluster.capacity_bytes)} per GPU")
    notes = sorted({n for c in p.candidates if c.memory for n in c.memory.notes})
    out += [f"note: {n}" for n in notes]
    return "\n".join(out)

