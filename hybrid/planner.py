"""Candidates from the catalogue, the memory filter, the cost model, and the choice with reasons.

A candidate is a preset at one shard size and one activation-checkpointing setting. It fits when
its estimated per-GPU total (overhead included) is within the GPU's capacity; among those that fit
the fastest wins, and near-ties (within TIE) go to the simpler one. When nothing fits, `suggest`
finds the smallest change that would make something fit.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .catalogue import Strategy, load_catalogue
from .parallel import ParallelDims, valid_shard_sizes
from .cluster import GPUS, Cluster
from .cost import EFFICIENCY, StepCost, step_cost
from .errors import HybridError
from .memory.analytic import NotApplicable, check_job, estimate
from .memory.breakdown import MemoryBreakdown
from .profile import ModelProfile, tp_degrees
from .report import format_plan
from .spec import TrainSpec
from .units import fmt_bytes

TIE = 0.02
"""Predicted step times within 2% are a tie, broken by simplicity (the cost model is not finer)."""
CKPT_ORDER = {"none": 0, "selective": 1, "full": 2}


@dataclass(frozen=True)
class Candidate:
    """One strategy at one shard size and checkpointing choice, with its estimates."""

    strategy: Strategy
    parallel: ParallelDims
    """How the world is laid out for this candidate (dp_replicate x dp_shard x tp x pp)."""
    spec: TrainSpec
    memory: MemoryBreakdown | None
    """None when the strategy cannot run this job at all (see reason)."""
    fits: bool
    reason: str
    cost: StepCost | None = None

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def shard_size(self) -> int:
        """Ranks one copy of the model state is sharded over (parallel.dp_shard)."""
        return self.parallel.dp_shard

    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def label(self) -> str:
        ckpt = self.spec.activation_checkpointing
        return self.name + ("" if self.tp == 1 else f"+tp{self.tp}") + ("" if ckpt == "none" else f"+ac:{ckpt}")

    def simplicity(self) -> tuple:
        return (self.strategy.rank(), CKPT_ORDER[self.spec.activation_checkpointing], self.tp, -self.shard_size)

    def to_dict(self) -> dict:
        m = self.memory
        return {
            "name": self.name, "family": self.strategy.family, "shard_size": self.shard_size,
            "parallel": self.parallel.to_dict(),
            "activation_checkpointing": self.spec.activation_checkpointing,
            "per_gpu": m.to_dict() if m else None,
            "per_cpu": {"total": m.cpu if m else 0},
            "model_states": m.model_states if m else None,
            "phase": m.phase if m else None,
            "fits": self.fits, "reason": self.reason,
            **(self.cost.to_dict() if self.cost else {}),
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
    suggestions: tuple[str, ...] = ()
    """When nothing fits: the smallest changes that would make something fit."""

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of the chosen layout (the world when nothing was chosen)."""
        return self.chosen.parallel.dp_size if self.chosen else self.cluster.world_size

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: micro-batch x accumulation x data-parallel ranks."""
        return self.spec.micro_batch * self.spec.gradient_accumulation * self.dp_size

    def __str__(self) -> str:
        """The decision: one row per strategy (its best variant) with the reason, and the choice."""
        return format_plan(self, summary=True)

    def to_dict(self) -> dict:
        """The JSON contract shared by `hybrid estimate` and `hybrid plan` (see README)."""
        c = self.chosen
        return {
            "model": self.model.name, "params": self.model.params, "world_size": self.cluster.world_size,
            "capacity_bytes": self.cluster.capacity_bytes,
            "chosen": c.name if c else None,
            "chosen_candidate": ({"name": c.name, "shard_size": c.shard_size, "parallel": c.parallel.to_dict(),
                                  "activation_checkpointing": c.spec.activation_checkpointing} if c else None),
            "method": self.method, "gpu": self.cluster.gpu.name, "nodes": self.cluster.nodes,
            "gpus_per_node": self.cluster.gpus_per_node, "spec": self.spec.to_dict(),
            "global_batch": self.global_batch,
            "strategies": [x.to_dict() for x in self.candidates],
            "suggestions": list(self.suggestions),
        }


def judge(strategy: Strategy, profile: ModelProfile, spec: TrainSpec, cluster: Cluster,
          shard_size: int | None = None, estimator=None, efficiency: float = EFFICIENCY, tp: int = 1) -> Candidate:
    """Estimate one candidate and say whether and why it fits. `estimator(strategy, spec, n)`
    replaces the analytic memory model (traced, measured) for tp 1; the analytic one still rules
    out strategies that cannot run the job at all, before anything expensive runs."""
    n = strategy.shard_size(cluster, shard_size, tp)
    dims = ParallelDims(dp_replicate=cluster.world_size // tp // n, dp_shard=n, tp=tp).validate(
        cluster.world_size, cluster.gpus_per_node)
    try:
        m = estimate(strategy, profile, spec, cluster, n, tp)
        if estimator is not None and tp == 1:
            m = estimator(strategy, spec, n)
    except NotApplicable as e:
        return Candidate(strategy, dims, spec, None, False, f"not applicable: {e}")
    cost = step_cost(strategy, profile, spec, cluster, n, efficiency, tp)
    cap, host = cluster.capacity_bytes, cluster.host_bytes_per_rank
    fits = m.total <= cap and m.cpu <= host
    if m.total > cap:
        why = f"needs {fmt_bytes(m.total)} > {fmt_bytes(cap)}: {m.describe_largest()}"
    elif m.cpu > host:
        why = (f"needs {fmt_bytes(m.cpu)} of host memory per rank > {fmt_bytes(host)} "
               f"({fmt_bytes(cluster.gpu.host_memory_bytes)} per node / {cluster.gpus_per_node} ranks)")
    else:
        # a bare parameter count: only the model states are known to fit, never the job
        verdict = "fits" if m.activations is not None else "model states fit"
        why = f"{verdict}: {fmt_bytes(m.total)} of {fmt_bytes(cap)}, largest {m.describe_largest()}"
        if m.cpu:
            why += f"; host {fmt_bytes(m.cpu)} of {fmt_bytes(host)} per rank"
    if m.activations is None:
        why += "; activations unknown"
    return Candidate(strategy, dims, spec, m, fits, why, cost)


def enumerate_candidates(catalogue: dict[str, Strategy], profile: ModelProfile, spec: TrainSpec,
                         cluster: Cluster, names: list[str], shard_size: int | None,
                         search_checkpointing: bool, search_shards: bool = True,
                         tp: int | None = 1) -> list[tuple[Strategy, int, TrainSpec, int]]:
    """Every preset x tensor-parallel degree (tp None: every valid one for families that run
    over tp groups; an int pins it) x its shard sizes (a free-shard preset: every valid size
    between 1 and the world; --shard-size pins it) x checkpointing {none, selective, full} when
    it can apply."""
    can_ckpt = profile.num_blocks > 0 and (profile.decoder is not None or profile.activation_bytes_per_sample)
    ckpts = list(CKPT_ORDER) if search_checkpointing and can_ckpt else [spec.activation_checkpointing]
    degrees = tp_degrees(profile, cluster.gpus_per_node) if tp is None else [tp]
    out = []
    for name in names:
        s = catalogue[name]
        for t in degrees:
            if t > 1 and not s.family_obj.supports_tp and tp is None:
                continue
            groups = cluster.world_size // t
            if s.shard_is_free and shard_size is None and search_shards:
                default = s.shard_size(cluster, None, t)
                sizes = sorted({default, *(n for n in valid_shard_sizes(cluster.world_size, cluster.gpus_per_node, t)
                                           if 1 < n < groups)})
            else:
                sizes = [s.shard_size(cluster, shard_size, t)]
            for n in sizes:
                for ac in ckpts:
                    out.append((s, n, replace(spec, activation_checkpointing=ac), t))
    return out


def choose(cands) -> Candidate | None:
    """The fastest candidate that fits; near-ties (TIE) go to the simpler one."""
    fitting = [c for c in cands if c.fits]
    if not fitting:
        return None
    best = min(c.cost.time_per_token for c in fitting)
    close = [c for c in fitting if c.cost.time_per_token <= best * (1 + TIE)]
    return min(close, key=lambda c: (c.simplicity(), c.cost.time_per_token))


def plan(profile: ModelProfile, spec: TrainSpec, cluster: Cluster,
         catalogue: dict[str, Strategy] | None = None, shard_size: int | None = None,
         strategies: list[str] | None = None, estimator=None, method: str = "analytic",
         search_checkpointing: bool = False, efficiency: float = EFFICIENCY,
         suggest_fixes: bool = True, search_shards: bool = True, tp: int | None = None) -> Plan:
    """Judge every candidate and choose. With search_checkpointing the planner also tries each
    activation-checkpointing setting (the spec's own is otherwise kept); tp None tries every valid
    tensor-parallel degree, an int pins it."""
    check_job(profile, spec)
    cat = catalogue if catalogue is not None else load_catalogue()
    names = strategies or list(cat)
    for n in names:
        if n not in cat:
            raise HybridError(f"unknown strategy {n!r}. Available: {', '.join(cat)}")
    if shard_size is not None and not any(cat[n].shard_is_free for n in names):
        raise HybridError("--shard-size applies to strategies with a free shard size (hsdp); "
                          f"none of {', '.join(names)} has one")
    # an expensive estimator (traced, measured) runs once per preset, not per shard size
    if tp is not None:
        valid = tp_degrees(profile, cluster.gpus_per_node)
        if tp not in valid:
            raise HybridError(f"--tp {tp} is not a valid tensor-parallel degree for {profile.name} on "
                              f"{cluster.gpus_per_node} GPUs per node (it must divide the GPUs per node and the "
                              f"attention and key/value heads of a llama-style decoder); valid: "
                              f"{', '.join(map(str, valid))}")
    todo = enumerate_candidates(cat, profile, spec, cluster, names, shard_size, search_checkpointing,
                                search_shards=search_shards and estimator is None,
                                tp=tp if tp is not None or estimator is None else 1)
    cands = [judge(s, profile, sp, cluster, n, estimator, efficiency, t) for s, n, sp, t in todo]
    chosen = choose(cands)
    order = sorted(cands, key=lambda c: (not c.fits, c.memory is None,
                                         c.cost.time_per_token if c.fits else (c.memory.total if c.memory else 0)))
    fixes = ()
    if chosen is None and suggest_fixes and estimator is None:
        fixes = tuple(suggest(profile, spec, cluster, cat, names, search_checkpointing, efficiency, tp))
    return Plan(profile, cluster, spec, tuple(order), chosen, method, fixes)


def _fits_with(profile, spec, cluster, cat, names, search_checkpointing, efficiency, tp=None) -> Candidate | None:
    try:
        check_job(profile, spec)
    except HybridError:
        return None
    todo = enumerate_candidates(cat, profile, spec, cluster, names, None, search_checkpointing, tp=tp)
    return choose([judge(s, profile, sp, cluster, n, None, efficiency, t) for s, n, sp, t in todo])


def suggest(profile: ModelProfile, spec: TrainSpec, cluster: Cluster, cat: dict[str, Strategy],
            names: list[str], search_checkpointing: bool, efficiency: float = EFFICIENCY,
            tp: int | None = None) -> list[str]:
    """The smallest change along each axis that makes some candidate fit."""
    out = []
    if tp is not None:      # tp was pinned: would another degree fit?
        for t in tp_degrees(profile, cluster.gpus_per_node):
            c = t > tp and _fits_with(profile, spec, cluster, cat, names, True, efficiency, t)
            if c:
                out.append(f"--tp {t} ({c.label}: {fmt_bytes(c.memory.total)})")
                break
    args = (cat, names, True, efficiency)
    if not search_checkpointing and spec.activation_checkpointing != "full":
        for ac in ("selective", "full"):
            c = _fits_with(profile, replace(spec, activation_checkpointing=ac), cluster, *args)
            if c:
                out.append(f"--activation-checkpointing {ac} ({c.label}: {fmt_bytes(c.memory.total)})")
                break
    nodes = cluster.nodes
    while nodes < 4096:
        nodes *= 2
        c = _fits_with(profile, spec, replace(cluster, nodes=nodes), *args)
        if c:
            out.append(f"--nodes {nodes} ({c.label} x{c.shard_size}: {fmt_bytes(c.memory.total)} per GPU)")
            break
    if profile.decoder is not None:
        seq = spec.seq_len
        while seq > 128:
            seq //= 2
            c = _fits_with(profile, replace(spec, seq_len=seq), cluster, *args)
            if c:
                out.append(f"--seq-len {seq} ({c.label}: {fmt_bytes(c.memory.total)})")
                break
    if spec.micro_batch > 1:
        c = _fits_with(profile, replace(spec, micro_batch=1), cluster, *args)
        if c:
            out.append(f"--micro-batch 1 ({c.label}: {fmt_bytes(c.memory.total)})")
    for gpu in sorted(GPUS.values(), key=lambda g: g.memory_bytes):
        if gpu.memory_bytes > cluster.gpu.memory_bytes:
            c = _fits_with(profile, spec, replace(cluster, gpu=gpu), *args)
            if c:
                out.append(f"--gpu {gpu.name} ({c.label}: {fmt_bytes(c.memory.total)})")
                break
    return out
