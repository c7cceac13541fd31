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
from .cost import StepCost, step_cost
from .errors import HybridError
from .memory.analytic import NotApplicable, check_job, estimate
from .memory.breakdown import MemoryBreakdown
from .pipeline import VIRTUAL, PipelineLayout, balanced_split, even_split, pp_degrees, schedules_for, stage_cluster
from .profile import ModelProfile, stage_share, tp_degrees
from .report import format_plan
from .spec import TrainSpec
from .units import fmt_bytes

TIE = 0.02
"""Predicted step times within 2% are a tie, broken by simplicity (the cost model is not finer)."""
CKPT_ORDER = {"none": 0, "selective": 1, "full": 2}
"""The modes the planner searches, simplest first (op and layer:N when asked for)."""
MAX_PP = 64
"""The deepest pipeline the planner tries unpinned (Llama 3 405B trained with 16 stages)."""


def ckpt_rank(mode: str) -> float:
    """Simplicity of a checkpointing mode for tie-breaks: none < layer:N < op = selective < full."""
    return CKPT_ORDER.get(mode, 0.5 if mode.startswith("layer:") else 1)


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
    pipeline: PipelineLayout | None = None
    """The stages and schedule when pp > 1."""
    stage_memory: tuple[MemoryBreakdown, ...] = ()
    """pp > 1: every pipeline rank's estimate (`memory` is the largest of them)."""

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
    def pp(self) -> int:
        return self.parallel.pp

    @property
    def label(self) -> str:
        ckpt = self.spec.activation_checkpointing
        pipe = "" if self.pipeline is None else f"+pp{self.pp}" + (
            "" if self.pipeline.schedule == "1f1b" else f":{self.pipeline.schedule}")
        return (self.name + ("" if self.tp == 1 else f"+tp{self.tp}") + pipe
                + ("" if ckpt == "none" else f"+ac:{ckpt}"))

    def simplicity(self) -> tuple:
        return (self.strategy.rank(), ckpt_rank(self.spec.activation_checkpointing), self.pp, self.tp,
                -self.shard_size)

    def to_dict(self) -> dict:
        m = self.memory
        return {
            "name": self.name, "family": self.strategy.family, "shard_size": self.shard_size,
            "parallel": self.parallel.to_dict(),
            "activation_checkpointing": self.spec.activation_checkpointing,
            "per_gpu": m.to_dict() if m else None,
            "allocated_bytes": m.allocated if m else None,
            "reserved_bytes": m.reserved if m else None,
            "per_cpu": {"total": m.cpu if m else 0},
            "model_states": m.model_states if m else None,
            "phase": m.phase if m else None,
            # "fits": the whole step is known to fit; a bare parameter count knows only the model states
            "fits": self.fits and m is not None and m.activations is not None,
            "activations_known": m is not None and m.activations is not None, "reason": self.reason,
            **(self.cost.to_dict() if self.cost else {}),
            "notes": list(m.notes) if m else [],
            **({"pipeline": {**self.pipeline.to_dict(),
                             "stages": [{"rank": r, "blocks": sum(self.pipeline.blocks[i] for i in
                                                                  self.pipeline.rank_stages(r)),
                                         "in_flight": self.pipeline.in_flight(r), "phase": sm.phase,
                                         "per_gpu": sm.to_dict()}
                                        for r, sm in enumerate(self.stage_memory)]}}
               if self.pipeline is not None else {}),
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
          shard_size: int | None = None, estimator=None, efficiency: float | None = None, tp: int = 1,
          pp: int = 1, schedule: str | None = None) -> Candidate:
    """Estimate one candidate and say whether and why it fits. `estimator(strategy, spec, n)`
    replaces the analytic memory model (traced, measured) for tp 1; the analytic one still rules
    out strategies that cannot run the job at all, before anything expensive runs. With pp > 1
    the blocks are split into stages (pipeline_layout) and every pipeline rank is estimated on
    the stage's share of the cluster; the largest is the candidate's memory."""
    stage_cl = stage_cluster(cluster, pp)
    n = strategy.shard_size(stage_cl, shard_size, tp)
    dims = ParallelDims(dp_replicate=stage_cl.world_size // tp // n, dp_shard=n, tp=tp, pp=pp).validate(
        cluster.world_size, cluster.gpus_per_node)
    layout, stages = None, ()
    try:
        if pp > 1:
            layout = pipeline_layout(strategy, profile, spec, stage_cl, n, tp, pp, schedule or "1f1b")
            stages = tuple(estimate(strategy, stage_share(profile, layout, r), spec, stage_cl, n, tp)
                           for r in range(pp))
            m = max(stages, key=lambda b: b.total)
        else:
            m = estimate(strategy, profile, spec, cluster, n, tp)
        if estimator is not None and tp == 1 and pp == 1:
            m = estimator(strategy, spec, n)
        elif estimator is not None and pp > 1 and hasattr(estimator, "stage"):
            busiest = max(range(pp), key=lambda r: stages[r].total)
            m = estimator.stage(strategy, spec, n, tp, layout, busiest)
    except NotApplicable as e:
        return Candidate(strategy, dims, spec, None, False, f"not applicable: {e}")
    cost = step_cost(strategy, profile, spec, cluster, n, efficiency, tp, layout)
    cap, host = cluster.capacity_bytes, cluster.host_bytes_per_rank
    fits = m.total <= cap and m.cpu <= host
    if m.total > cap:
        why = f"needs {fmt_bytes(m.total)} > {fmt_bytes(cap)}: {m.describe_largest()}"
        if m.allocated + m.context <= cap:
            why += f" (live tensors {fmt_bytes(m.allocated)} fit; the allocator's headroom does not)"
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
    if layout is not None:
        why += f"; {layout.describe()}"
    return Candidate(strategy, dims, spec, m, fits, why, cost, layout, stages)


def pipeline_layout(strategy: Strategy, profile: ModelProfile, spec: TrainSpec, stage_cl: Cluster, n: int,
                    tp: int, pp: int, schedule: str) -> PipelineLayout:
    """The stages of a pp > 1 candidate. 1f1b and gpipe: blocks per rank balanced on the analytic
    memory of each rank (its embedding or head, and per block its states and in-flight
    activations: linear in the block count, so two estimates per rank fix it); interleaved: two
    chunks per rank, as even as the block count allows."""
    if not strategy.family_obj.supports_pp:
        raise NotApplicable(f"{strategy.family} strategies do not run pipeline stages here; use an fsdp or ddp "
                            "strategy with pp")
    if profile.decoder is None or profile.num_blocks == 0:
        raise NotApplicable("pipeline stages split a transformer's blocks; this model has no known decoder shape")
    L, m = profile.num_blocks, spec.gradient_accumulation
    if schedule == "1f1b" and m < pp:
        raise NotApplicable(f"1f1b needs at least pp = {pp} micro-batches (--gradient-accumulation {pp} or more); "
                            "gpipe runs fewer")
    if schedule == "interleaved":
        if L < pp * VIRTUAL:
            raise NotApplicable(f"interleaved needs at least {pp * VIRTUAL} blocks for its {pp * VIRTUAL} chunks")
        return PipelineLayout(pp, schedule, m, even_split(L, pp * VIRTUAL), VIRTUAL)
    if L < pp:
        raise NotApplicable(f"{pp} stages need at least {pp} blocks; the model has {L}")
    if L < 2 * pp:
        return PipelineLayout(pp, schedule, m, even_split(L, pp))

    def totals(k: int) -> list[int]:
        lay = PipelineLayout(pp, schedule, m, (k,) * pp)
        return [estimate(strategy, stage_share(profile, lay, r), spec, stage_cl, n, tp).total for r in range(pp)]
    one, two = totals(1), totals(2)
    per_block = [b - a for a, b in zip(one, two)]
    return PipelineLayout(pp, schedule, m, balanced_split(L, [a - d for a, d in zip(one, per_block)], per_block))


def enumerate_candidates(catalogue: dict[str, Strategy], profile: ModelProfile, spec: TrainSpec,
                         cluster: Cluster, names: list[str], shard_size: int | None,
                         search_checkpointing: bool, search_shards: bool = True,
                         tp: int | None = 1, pp: int | None = 1, schedule: str | None = None) -> list[tuple]:
    """Every preset x tensor-parallel degree (tp None: every valid one for families that run
    over tp groups; an int pins it) x pipeline degree and schedule (pp None: 1, and for
    families that run stages every pp the cluster allows, pipeline.pp_degrees; an int pins it)
    x its shard sizes (a free-shard preset: every valid size, or with pp > 1 its default one;
    --shard-size pins it) x checkpointing {none, selective, full} when it can apply. Items: (strategy, shard
    size, spec, tp, pp, schedule)."""
    can_ckpt = profile.num_blocks > 0 and (profile.decoder is not None or profile.activation_bytes_per_sample)
    ckpts = list(CKPT_ORDER) if search_checkpointing and can_ckpt else [spec.activation_checkpointing]
    if pp is None:
        stages = [1] + ([p for p in pp_degrees(cluster) if 1 < p <= min(profile.num_blocks, MAX_PP)]
                        if profile.decoder is not None else [])
    else:
        stages = [pp]
    out = []
    for name in names:
        s = catalogue[name]
        for p in stages:
            if p > 1 and not s.family_obj.supports_pp and pp is None:
                continue
            cl = stage_cluster(cluster, p)
            scheds = [schedule] if schedule else schedules_for(p, spec.gradient_accumulation, profile.num_blocks // p)
            for t in (tp_degrees(profile, cl.gpus_per_node) if tp is None else [tp]):
                if t > 1 and not s.family_obj.supports_tp and tp is None:
                    continue
                if cl.gpus_per_node % t:          # a pinned tp wider than a stage's GPUs
                    continue
                groups = cl.world_size // t
                if s.shard_is_free and shard_size is None and search_shards and p == 1:
                    default = s.shard_size(cl, None, t)
                    sizes = sorted({default, *(n for n in valid_shard_sizes(cl.world_size, cl.gpus_per_node, t)
                                               if 1 < n < groups)})
                else:
                    sizes = [s.shard_size(cl, shard_size, t)]
                for n in sizes:
                    for ac in ckpts:
                        for sched in scheds:
                            out.append((s, n, replace(spec, activation_checkpointing=ac), t, p,
                                        sched if p > 1 else None))
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
         search_checkpointing: bool = False, efficiency: float | None = None,
         suggest_fixes: bool = True, search_shards: bool = True, tp: int | None = None,
         pp: int | None = None, schedule: str | None = None) -> Plan:
    """Judge every candidate and choose. With search_checkpointing the planner also tries each
    activation-checkpointing setting (the spec's own is otherwise kept); tp None tries every valid
    tensor-parallel degree, an int pins it; pp None tries every pipeline degree the cluster
    allows (and the schedules that fit the micro-batch count), an int pins it, as `schedule`
    pins the schedule."""
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
    if pp is not None:
        valid = [p for p in pp_degrees(cluster) if p <= max(profile.num_blocks, 1)]
        if pp not in valid:
            raise HybridError(f"--pp {pp} is not a valid pipeline degree for {profile.name} on {cluster.describe()} "
                              f"(it must divide the nodes, or the GPUs of a single node, and be at most the "
                              f"{profile.num_blocks} blocks); valid: {', '.join(map(str, valid))}")
    if schedule is not None:
        PipelineLayout(2, schedule, 1, (1, 1))             # the name check, one line
    todo = enumerate_candidates(cat, profile, spec, cluster, names, shard_size, search_checkpointing,
                                search_shards=search_shards and estimator is None,
                                tp=tp if tp is not None or estimator is None else 1,
                                pp=pp if pp is not None or estimator is None else 1, schedule=schedule)
    if estimator is not None and (pp or 1) > 1:         # a traced pipeline: its families and schedules
        todo = [t for t in todo if t[0].family_obj.supports_pp and (schedule or t[5]) != "interleaved"]
    if hasattr(estimator, "expect"):                    # how many candidates it will see (progress)
        estimator.expect(len(todo))
    cands = [judge(s, profile, sp, cluster, n, estimator, efficiency, t, p, sc) for s, n, sp, t, p, sc in todo]
    chosen = choose(cands)
    order = sorted(cands, key=lambda c: (not c.fits, c.memory is None,
                                         c.cost.time_per_token if c.fits else (c.memory.total if c.memory else 0)))
    fixes = ()
    if chosen is None and suggest_fixes and estimator is None:
        fixes = tuple(suggest(profile, spec, cluster, cat, names, search_checkpointing, efficiency, tp, pp))
    return Plan(profile, cluster, spec, tuple(order), chosen, method, fixes)


def _fits_with(profile, spec, cluster, cat, names, search_checkpointing, efficiency, tp=None,
               pp=None) -> Candidate | None:
    try:
        check_job(profile, spec)
    except HybridError:
        return None
    todo = enumerate_candidates(cat, profile, spec, cluster, names, None, search_checkpointing, tp=tp, pp=pp)
    return choose([judge(s, profile, sp, cluster, n, None, efficiency, t, p, sc) for s, n, sp, t, p, sc in todo])


def suggest(profile: ModelProfile, spec: TrainSpec, cluster: Cluster, cat: dict[str, Strategy],
            names: list[str], search_checkpointing: bool, efficiency: float | None = None,
            tp: int | None = None, pp: int | None = None) -> list[str]:
    """The smallest change along each axis that makes some candidate fit."""
    out = []
    if pp is not None:      # pp was pinned: would another degree fit?
        for p in pp_degrees(cluster):
            c = p > pp and p <= profile.num_blocks and _fits_with(profile, spec, cluster, cat, names, True,
                                                                  efficiency, tp, p)
            if c:
                out.append(f"--pp {p} ({c.label}: {fmt_bytes(c.memory.total)})")
                break
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
